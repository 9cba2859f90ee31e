"""SIGTERM ends a process that holds sandboxes the way Ctrl-C does, so the same cleanup runs.

By default SIGTERM (``kill``, ``docker stop``, a job scheduler's preemption) ends Python at once:
no ``with`` block exits and no ``atexit`` handler runs, so containers, kernels and temp dirs are
left behind. ``exit_on_sigterm`` makes it raise ``SystemExit(143)`` in the main thread instead,
which unwinds like ``KeyboardInterrupt`` (a ``BaseException``, not an ``Exception``): leased
sandboxes are retired, ``SandboxPool``'s exit handler closes the pools, and the exit status is
still 128 + SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


def exit_on_sigterm() -> None:
    """Install the SIGTERM handler, once, where nothing else has claimed SIGTERM (its handler is
    still the default) and only from the main thread (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_system_exit)


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
