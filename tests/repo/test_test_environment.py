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
