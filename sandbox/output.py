"""What the host keeps of a call's output: text up to a cap, its head and tail around a count of what
was cut, in memory O(cap) however much is written."""

from __future__ import annotations

import collections
import re

KERNEL_DROPPED = re.compile(r"\n\[the kernel dropped (\d+) characters of this output\]\n")
"""The line a kernel sends, at the start of a stream message, for the characters of a cell's output it
dropped past ``KERNEL_OUTPUT_CHARS`` (``sandbox/cells/streams.py``)."""


class OutputBuffer:
    """Text accumulated up to a cap: memory stays O(limit) however much is written.

    ``text()`` equals ``truncate_text(everything_written, limit)``: the first ``limit // 2`` and
    the last ``limit - limit // 2`` characters around a marker that says how many were cut.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._head: list[str] = []
        self._head_len = 0
        self._tail: collections.deque[str] = collections.deque()
        self._tail_len = 0

    def write(self, text: str) -> None:
        if not text:
            return
        self.total += len(text)
        if self._head_len < self.limit:
            part = text[: self.limit - self._head_len]
            self._head.append(part)
            self._head_len += len(part)
        if len(text) >= self.limit:
            self._tail.clear()
            self._tail.append(text[len(text) - self.limit :])
            self._tail_len = self.limit
            return
        self._tail.append(text)
        self._tail_len += len(text)
        while self._tail_len - len(self._tail[0]) >= self.limit:
            self._tail_len -= len(self._tail.popleft())

    def write_stream(self, text: str) -> None:
        """``write`` for a stream message: the kernel's line saying it dropped characters
        (``sandbox/cells/streams.py``) counts them as written, as if they had come, and is not kept."""
        dropped = KERNEL_DROPPED.match(text)
        if dropped is not None:
            self.total += int(dropped[1])
            text = text[dropped.end() :]
        self.write(text)

    def text(self) -> tuple[str, bool]:
        """The kept text and whether anything was cut."""
        head = "".join(self._head)
        if self.total <= self.limit:
            return head, False
        keep_head = self.limit // 2
        keep_tail = self.limit - keep_head
        tail = "".join(self._tail)
        cut = self.total - self.limit
        return (
            f"{head[:keep_head]}\n... [{cut} characters truncated] ...\n{tail[len(tail) - keep_tail :]}",
            True,
        )
