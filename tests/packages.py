"""The project's packages as tests that read source see them: import name -> folder, from pyproject's
``[tool.setuptools] packages`` and ``package-dir`` (sandbox/ is installed as ``stare_sandbox``, envs/ as
``stare_envs``)."""

from __future__ import annotations

from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
_SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = _SETUPTOOLS.get("package-dir", {})
PACKAGES: dict[str, Path] = {
    top: REPO / PACKAGE_DIRS.get(top, top)
    for top in dict.fromkeys(name.split(".")[0] for name in _SETUPTOOLS["packages"])
}
"""Top-level import name -> its folder, in layer order (sandbox, envs, stare_agent, ...)."""


def modules() -> dict[str, Path]:
    """Every module of the project by its import name (``stare_envs.rollout``) -> its file."""
    found = {}
    for top, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (top, *path.relative_to(folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found
