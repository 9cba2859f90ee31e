"""House rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = ["sandbox", "envs", "stare_agent", "stare_integrations", "tests", "benchmarks", "examples"]


def test_ruff_lint_and_format_are_clean():
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *CODE], cwd=REPO, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout[-3000:]
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *CODE], cwd=REPO, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout[-3000:]


def test_imports_go_one_way_and_lower_layers_never_import_torch():
    """stare_agent -> envs -> sandbox; envs and sandbox have no torch (users of other trainers)."""
    rules = {"sandbox": ("torch", "envs", "stare_agent"), "envs": ("torch", "stare_agent")}
    bad = []
    for package, forbidden in rules.items():
        for path in (REPO / package).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
                if m and m.group(1).split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
