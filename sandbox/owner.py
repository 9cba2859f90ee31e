"""Which process owns a sandbox, so that what a killed process left behind can be found and removed.

A process killed with SIGKILL runs no cleanup: its Docker containers keep running and its local
sandbox directories stay in /tmp. Each is tagged with its owner's ``host:pid:start-time`` (the
start time, in clock ticks since boot, tells a reused pid from the old owner), and the next
process that starts a sandbox removes those whose owner on this host is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

logger = logging.getLogger(__name__)

OWNER_FILE = "owner"
"""Name of the file in a local sandbox directory that holds its owner id."""


def owner_id(pid: int | None = None) -> str:
    """``host:pid:start-time`` of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


def owner_gone(owner: str) -> bool:
    """True only when ``owner`` names a process on this host that no longer exists."""
    host, _, rest = owner.strip().partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's, or not ours to judge
    return owner_id(int(pid)) != f"{host}:{pid}:{start}"


def reap_local_dirs(root: str | os.PathLike[str] = "/tmp") -> int:
    """Remove ``stare-*`` sandbox directories under ``root`` whose owner is gone; return how many."""
    removed = 0
    for path in Path(root).glob("stare-*"):
        try:
            owner = (path / OWNER_FILE).read_text()
        except OSError:
            continue  # not a local sandbox dir (or not ours to read)
        if owner_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        logger.warning("removed %d sandbox dir(s) left behind by processes that no longer exist", removed)
    return removed


def _start_ticks(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after the comm field
