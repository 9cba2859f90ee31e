"""What one execution in a sandbox produced."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ExecError:
    """An exception raised by the executed code (not by the sandbox)."""

    type: str
    message: str
    traceback: str = ""


@dataclass(frozen=True)
class ExecResult:
    """Outcome of ``Sandbox.run(code)``.

    Attributes:
        stdout: Text written to stdout, followed by the value of a trailing expression as
            Jupyter shows it (``text/plain``). Truncated to the sandbox's output cap.
        stderr: Text written to stderr, truncated to the same cap.
        error: The exception the code raised, if any.
        timed_out: True when the call ran past its timeout; ``stdout``/``stderr`` then hold the
            partial output produced before the deadline.
        state_lost: True when the kernel had to be restarted (variables and imports are gone).
        duration_s: Wall time of the call as seen by the host.
        cpu_s: CPU seconds (user + system) used while the call ran, read on the host: by every
            process in the container (Docker), or by the kernel process and the children it
            reaped (local). 0.0 when unknown or when the kernel was restarted (``state_lost``).
        peak_memory_bytes: High-water mark of memory during this call, or None when unknown
            (also after a restart). Docker: the container's memory charge (the number its
            memory limit is checked against: process memory, files in its tmpfs dirs, page
            cache). Local: the kernel process's peak resident set size (children not included).
            It is reset before each call where the host may do so (Docker on cgroup v1 with a
            root host; local on Linux); elsewhere (cgroup v2, a non-root Docker host) it is the
            peak since the container or kernel last (re)started.
        truncated: True when stdout or stderr was cut; the text then ends with a marker that says
            how many characters were cut.
        skipped_messages: Messages from the kernel that were malformed (bad signature, framing or
            field types) or too large and were skipped; stderr then ends with a line saying so.
            Only code that writes to the kernel's own sockets makes this non-zero.
    """

    stdout: str = ""
    stderr: str = ""
    error: ExecError | None = None
    timed_out: bool = False
    state_lost: bool = False
    duration_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int | None = None
    truncated: bool = False
    skipped_messages: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the code ran to completion without an exception or timeout."""
        return self.error is None and not self.timed_out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def truncate_text(text: str, limit: int) -> tuple[str, bool]:
    """Cut ``text`` to ``limit`` characters keeping head and tail, with a visible marker.

    >>> truncate_text("abcdefghij", 6)[0]
    'abc\\n... [4 characters truncated] ...\\nhij'
    """
    if limit <= 0 or len(text) <= limit:
        return text, False
    head = limit // 2
    tail = limit - head
    cut = len(text) - limit
    return f"{text[:head]}\n... [{cut} characters truncated] ...\n{text[len(text) - tail :]}", True
