"""A griffe extension of the docs site (mkdocs.yml): reads a Google-style ``Example:`` section as ``Examples:``.

Griffe's Google parser knows only ``Examples:``; under ``Example:`` (which the codebase uses, as Napoleon
allows) a doctest would render as a quotation instead of code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` section heading of a docstring to ``Examples:`` before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
