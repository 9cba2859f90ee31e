"""Helpers of the adapters' tests: the README section's code blocks, and the trainers they need.

The trainers are installed into .venv by ``scripts/setup_integrations.sh`` (run by ``make setup``).
Without one a test skips, except in CI (``CI=true``), where a missing trainer is an install bug and fails.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from types import ModuleType

import pytest

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
    """``import module``, or skip (fail in CI) with the line that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{module} is not importable ({exc}): run scripts/setup_integrations.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
