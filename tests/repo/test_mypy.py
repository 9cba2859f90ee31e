"""The type hints hold: mypy checks stare_sandbox, stare_envs and stare_agent with the settings of pyproject.toml
([tool.mypy]: third-party packages without type information are Any, and nothing else is relaxed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute on a cold cache: mypy reads torch's and transformers' stubs
def test_mypy_finds_no_type_errors():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py"), "--cache-dir", str(ROOT / ".mypy_cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
