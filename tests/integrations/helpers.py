"""Helpers of the adapters' tests: the README section's code blocks, and the trainers they need.

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

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Use with verl / TRL / verifiers"


def readme_block(first_line: str) -> str:
    """The one fenced block of the section whose first line starts with ``first_line``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else len(text)]
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", section, flags=re.DOTALL | re.MULTILINE)
    [block] = [b for b in blocks if b.startswith(first_line)]
    return block


def require(module: str) -> ModuleType:
    """``import module``, or skip (fail under ``STARE_REQUIRE=integrations``) with the line that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        require_need("integrations", f"{module} is not importable ({exc}): run scripts/setup_integrations.sh")
        raise  # not reached: require skips or fails
