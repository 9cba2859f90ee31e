"""A child process that owns a sandbox, for tests of what a killed owner leaves behind."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_sandbox_owner(
    cls: str,
    report: str,
    ready: Path,
    timeout: float = 120,
    *,
    prefix: tuple[str, ...] = (),
    setup: str = "",
) -> tuple[subprocess.Popen, str]:
    """Start a child that runs ``setup``, makes ``sandbox.<cls>()`` and writes ``report`` (an
    expression of ``sb``) to ``ready``; return the child, still running, and what it wrote.
    ``prefix`` is a command that runs the child (e.g. ``unshare --pid ...``)."""
    code = (
        f"import time\n{setup}\nfrom sandbox import {cls}; sb = {cls}(); "
        f"open({str(ready)!r}, 'w').write({report}); time.sleep(600)"
    )
    child = subprocess.Popen([*prefix, sys.executable, "-c", code])
    deadline = time.monotonic() + timeout
    while not ready.exists() or not ready.read_text():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            raise AssertionError(f"the child never started a {cls}")
        time.sleep(0.1)
    return child, ready.read_text()
