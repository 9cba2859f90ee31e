"""Griffe extensions of the docs site (mkdocs.yml): docstrings as the code writes them, rendered as the
site needs them.

- ``ExampleSections``: a Google-style ``Example:`` section is read as ``Examples:``. Griffe's Google
  parser knows only ``Examples:``; under ``Example:`` (which the codebase uses, as Napoleon allows) a
  doctest would render as a quotation instead of code. A doctest in the docstring's text, outside any
  such section, is fenced as code for the same reason.
- ``SphinxRoles``: the Sphinx roles of the docstrings (``:func:`x```, ``:class:`~a.b.C```, ...) become
  cross-references: the name is resolved in the scope of the object the docstring belongs to, and a
  name of the project becomes a link (autorefs; the strict build fails when its target is not on the
  site), any other (``torch.Tensor``) code. A role this cannot read fails the build: none is left as
  raw text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
ROLE = re.compile(r":(?:py:)?(func|class|meth|data|mod|attr|exc|obj|const):`(~?)([^`<>]+)`")
LEFTOVER = re.compile(r":(?:py:)?[a-z]+:`")
PROJECT = ("stare_sandbox", "stare_envs", "stare_agent", "stare_integrations", "stare_research")


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` section heading of a docstring to ``Examples:`` before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _fence_bare_doctests(EXAMPLE.sub(r"\1Examples:", obj.docstring.value))


SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")


def _fence_bare_doctests(text: str) -> str:
    """Each doctest block (``>>>`` lines and their output, up to a blank line) outside an ``Examples:``
    section, in a ``pycon`` code fence."""
    out: list[str] = []
    in_examples = in_block = False
    for line in text.splitlines():
        if SECTION.match(line):
            in_examples = line.strip() == "Examples:"
        starts = line.lstrip().startswith(">>>")
        if starts and not in_examples and not in_block:
            out.append(line[: len(line) - len(line.lstrip())] + "```pycon")
            in_block = True
        elif in_block and not line.strip():
            out.append(out[-1][: len(out[-1]) - len(out[-1].lstrip())] + "```")
            in_block = False
        out.append(line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Each Sphinx role of a docstring as a Markdown cross-reference (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(lambda m, o=obj: _reference(o, m), obj.docstring.value)
                left = LEFTOVER.search(obj.docstring.value)
                if left:
                    raise ValueError(
                        f"{obj.path}: a Sphinx role the docs cannot render "
                        f"({obj.docstring.value[left.start() : left.start() + 60]!r}): write :func:`name`, "
                        ":class:`name` or :meth:`name`"
                    )


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found += _walk(member)  # type: ignore[arg-type]
    return found


def _reference(obj: griffe.Object, match: re.Match[str]) -> str:
    kind, short, name = match.group(1), bool(match.group(2)), match.group(3).strip()
    shown = name.rsplit(".", 1)[-1] if short else name
    if kind in ("func", "meth"):
        shown += "()" if not shown.endswith(")") else ""
    target = _resolve(obj, name)
    if target is None or not target.startswith(PROJECT) or _private(target):
        return f"`{shown}`"
    return f"[`{shown}`][{target}]"


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path of ``name`` as the docstring's object sees it, or None when it is not the project's."""
    if name.startswith(PROJECT):
        return name
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            return scope.resolve(name)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            head, _, rest = name.partition(".")
            if rest:
                try:
                    return f"{scope.resolve(head)}.{rest}"
                except (griffe.NameResolutionError, AttributeError, KeyError):
                    pass
        scope = scope.parent  # type: ignore[assignment]
    return None


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))
