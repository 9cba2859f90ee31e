"""Run once after each kernel start: displayed values keep only their ``text/plain`` form (all the
host reads), cut to ``chunk`` characters around a marker (``streams`` bounds what is printed). Code
in the sandbox can undo this; then only its own oversized messages are lost."""

from typing import Any

from IPython import get_ipython


def bound_output(chunk: int) -> None:
    formatter = get_ipython().display_formatter

    def plain_only(
        obj: Any, include: Any = None, exclude: Any = None, format: Any = formatter.format
    ) -> tuple[dict[str, str], dict[str, Any]]:
        data, _ = format(obj, include=include, exclude=exclude)
        text = data.get("text/plain")
        if not isinstance(text, str):
            return {}, {}
        if len(text) > chunk:
            cut, keep = len(text) - chunk, chunk // 2
            text = f"{text[:keep]}\n... [{cut} characters truncated] ...\n{text[len(text) - keep :]}"
        return {"text/plain": text}, {}

    formatter.format = plain_only
