"""The commit-msg hook (scripts/check_commit_subject.py, run by pre-commit): a subject of at most 72
characters, then a blank line before the body."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_commit_subject.py"


@pytest.mark.parametrize(
    "message,problem",
    [
        ("x" * 72 + "\n\nbody with numbers 1.23 and 4.56\n", None),
        ("Fix the gate\n# a comment git strips\n", None),
        ("x" * 73 + "\n", "the commit subject has 73 characters, more than 72"),
        ("Fix the gate\nbody on the second line\n", "the subject's second line is not blank"),
        ("\n\n# only comments\n", "the commit message has no subject"),
    ],
)
def test_the_hook_refuses_a_long_subject_with_its_cause_and_fix(tmp_path, message, problem):
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == (0 if problem is None else 1), done.stderr
    assert (problem or "") in done.stderr and len(done.stderr.strip().splitlines()) <= 1


def test_pre_commit_runs_the_local_tools_only():
    """Every hook is local (nothing is downloaded: no registry but PyPI is reachable) and runs a tool of
    the project's .venv or one of its scripts."""
    import yaml

    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    assert [repo["repo"] for repo in config["repos"]] == ["local"]
    hooks = {hook["id"]: hook for hook in config["repos"][0]["hooks"]}
    assert {"ruff-check", "ruff-format", "mypy", "commit-subject"} <= set(hooks)
    for hook in hooks.values():
        assert hook["language"] == "system" and hook["entry"].startswith(".venv/bin/"), hook
