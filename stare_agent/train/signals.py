"""Stopping a run at a step boundary on SIGINT or SIGTERM, where a checkpoint is saved."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any


class StopAtStepBoundary:
    """While entered (from the main thread): SIGINT (Ctrl-C) and SIGTERM (``kill``, a scheduler's
    preemption) ask the run to stop at the next step boundary, where it saves a checkpoint, instead of
    dying mid-step with nothing saved. A second signal stops at once (``KeyboardInterrupt``, or
    ``SystemExit(128 + SIGTERM)``). The handlers in place before are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, step: Callable[[], int], *, quiet: bool = False) -> None:
        self.step, self.quiet = step, quiet
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        if not self.quiet:
            how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(
                f"\n{signal.Signals(signum).name}: stopping after step {self.step()}, where a checkpoint is saved "
                f"({how} again to stop at once, saving nothing)",
                file=sys.stderr,
                flush=True,
            )
