"""mypy over the packages by their import names: ``python scripts/typecheck.py [mypy args]``.

sandbox/ and envs/ are installed as ``stare_sandbox`` and ``stare_envs`` (pyproject's package-dir), a
mapping mypy cannot read. This links each package folder under its import name in ``.typecheck/``
(pyproject's ``[tool.mypy] mypy_path``) and checks the packages there. Run by tests/repo/test_mypy.py
and by the pre-commit hook.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
LINKS = REPO / ".typecheck"


def link_packages() -> list[str]:
    """``.typecheck/<import name>`` -> its folder, for each package mypy checks; their names."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir = pyproject["tool"]["setuptools"].get("package-dir", {})
    names = pyproject["tool"]["mypy"]["packages"]
    LINKS.mkdir(exist_ok=True)
    for name in names:
        link, target = LINKS / name, Path("..") / package_dir.get(name, name)
        if not link.is_symlink() or Path(os.readlink(link)) != target:
            link.unlink(missing_ok=True)
            link.symlink_to(target, target_is_directory=True)
    return names


if __name__ == "__main__":
    link_packages()
    sys.exit(subprocess.call([sys.executable, "-m", "mypy", *sys.argv[1:]], cwd=REPO))
