"""Run once after each kernel start: the kernel's stdout and stderr send at most ``chunk``
characters a message (a big write is split, each chunk flushed before the next), and displayed
values keep only their ``text/plain`` form (all the host reads), cut to the same size around a
marker. Code in the sandbox can undo this; then only its own oversized messages are lost."""

import sys
from typing import Any

from IPython import get_ipython


def bound(stream: Any, chunk: int) -> None:
    """Split the writes of ``stream`` into flushed pieces of at most ``chunk`` characters."""
    write, flush, pending = stream.write, stream.flush, [0]

    def chunked(text: Any) -> Any:
        if not isinstance(text, str) or len(text) + pending[0] < chunk:
            pending[0] += len(text) if isinstance(text, str) else 0
            return write(text)
        for start in range(0, len(text), chunk):
            write(text[start : start + chunk])
            flush()
        pending[0] = 0
        return len(text)

    stream.write = chunked


def bound_output(chunk: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        bound(stream, chunk)
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
