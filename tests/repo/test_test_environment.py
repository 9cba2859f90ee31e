"""What the test session gives every process it starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def test_every_process_of_the_tests_finds_the_venvs_ninja_first():
    """DeepSpeed JIT-builds its CPU shared-memory op into one cache folder with the first `ninja` on
    PATH; two ninja versions (the system's and the venv's hash commands differently) rebuilt it at every
    switch between a process started with the venv's bin on PATH (the README's launchers) and one
    without: minutes of the suite. tests/conftest.py puts the venv's bin first for the whole session."""
    venv_bin = Path(sys.executable).parent
    assert os.environ["PATH"].split(os.pathsep)[0] == str(venv_bin)
    child = subprocess.run(
        [sys.executable, "-c", "import shutil; print(shutil.which('ninja'))"], capture_output=True, text=True
    )
    found = child.stdout.strip()
    if (venv_bin / "ninja").exists():  # deepspeed's dependency
        assert found == str(venv_bin / "ninja") == shutil.which("ninja")


def test_every_test_listed_slow_exists():
    """tests/slow_tests.txt names tests by path: a test moved or renamed without its line would lose its
    ``slow`` mark silently and land in `make test-fast`'s inner loop."""
    import ast

    repo = Path(__file__).resolve().parents[2]
    lines = (repo / "tests" / "slow_tests.txt").read_text(encoding="utf-8").splitlines()
    missing = []
    for name in (line.strip() for line in lines if line.strip() and not line.startswith("#")):
        path, _, function = name.partition("::")
        file = repo / path
        defined = file.is_file() and any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8")))
        )
        if not defined:
            missing.append(name)
    assert not missing, missing
