"""Helpers of the adapters' tests: the code blocks of the integrations page (docs/integrations.md), and the
trainers they need.

The trainers are installed into .venv by ``scripts/setup_integrations.sh`` (run by ``make setup``).
Without one a test skips, except under ``STARE_REQUIRE=integrations`` (CI), where a missing trainer is an
install bug and fails (tests/conftest.py's ``require``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

from tests.conftest import require as require_need

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def readme_block(first_line: str) -> str:
    """The one fenced block of the integrations page (docs/integrations.md, moved there from the README)
    whose first line starts with ``first_line``."""
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.DOTALL | re.MULTILINE)
    [block] = [b for b in blocks if b.startswith(first_line)]
    return block


def require(module: str) -> ModuleType:
    """``import module``, or skip (fail under ``STARE_REQUIRE=integrations``) with the line that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        require_need("integrations", f"{module} is not importable ({exc}): run scripts/setup_integrations.sh")
        raise  # not reached: require skips or fails
