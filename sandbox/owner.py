"""Which process owns a sandbox, so that what a killed process left behind can be found and removed.

A process killed with SIGKILL runs no cleanup: its Docker containers keep running and its local
sandbox directories stay in /tmp. Each is tagged with an owner id, and the next process that
starts a sandbox removes those whose owner is certainly gone.

An owner id is ``v2:<boot id>:<pid namespace>:<uid>:<pid>:<start time>``. A pid means something
only on one boot of one machine and inside one PID namespace, so "certainly gone" needs all of:

- the same boot id (``/proc/sys/kernel/random/boot_id``): another machine sharing the Docker
  daemon (``DOCKER_HOST``), or a reboot, is never judged;
- the same PID namespace (the inode of ``/proc/self/ns/pid``): a trainer in another container
  with the same hostname (host networking, Kubernetes ``hostNetwork``) is never judged;
- the same uid as the reaper, or a root reaper: ``/proc`` mounted with ``hidepid`` hides other
  users' processes, which would make a live owner look dead;
- and then no process with that pid and start time (clock ticks since boot: a reused pid is
  another process).

Anything else, including ids in an older format, is kept: a leftover costs memory until someone
removes it; removing a live owner's sandbox breaks its run.

Reaping removes only the project's own temp dirs: directories directly in ``TEMP_ROOT`` named
``stare-*``, not symlinks, owned by the reaping user (see ``is_sandbox_dir``), whatever a
container's labels or mounts claim.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

logger = logging.getLogger(__name__)

OWNER_FILE = "owner"
"""Name of the file in a local sandbox directory that holds its owner id."""

TEMP_ROOT = Path("/tmp")
"""Where sandboxes make their temp dirs (short paths: unix socket paths must stay under ~100
characters)."""

TEMP_PREFIX = "stare-"
"""Name prefix of every sandbox temp dir."""

_VERSION = "v2"


def owner_id(pid: int | None = None) -> str:
    """The owner id of a process (this one by default) as seen from this process."""
    pid = os.getpid() if pid is None else pid
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        uid = -1
    return f"{_VERSION}:{_boot_id()}:{_pid_namespace()}:{uid}:{pid}:{_start_ticks(pid)}"


def owner_gone(owner: str) -> bool:
    """True only when ``owner`` names a process that this process can prove no longer exists:
    same boot, same PID namespace, a uid whose processes it can see, and no process with that
    pid and start time. False for anything it cannot judge (see the module docstring)."""
    fields = owner.strip().split(":")
    if len(fields) != 6 or fields[0] != _VERSION:
        return False  # an older or foreign format: not ours to judge
    _, boot, pidns, uid, pid, start = fields
    if not boot or not pidns or boot != _boot_id() or pidns != _pid_namespace() or not pid.isdigit():
        return False  # another machine, boot or PID namespace: its pids mean nothing here
    if os.geteuid() != 0 and uid != str(os.geteuid()):
        return False  # hidepid may hide another user's live process from us
    return _start_ticks(int(pid)) != start


def is_sandbox_dir(path: str | os.PathLike[str]) -> bool:
    """True for a directory this project may remove: directly in ``TEMP_ROOT``, named
    ``stare-*``, a real directory (not a symlink) owned by this process's user."""
    path = Path(path)
    if path.parent != TEMP_ROOT or not path.name.startswith(TEMP_PREFIX):
        return False
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


def remove_sandbox_dir(path: str | os.PathLike[str]) -> bool:
    """Remove ``path`` if ``is_sandbox_dir`` allows it; True when it did."""
    if not is_sandbox_dir(path):
        logger.warning("not removing %s: not a sandbox temp dir of this user in %s", path, TEMP_ROOT)
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def reap_local_dirs(root: str | os.PathLike[str] = TEMP_ROOT) -> int:
    """Remove local sandbox directories under ``root`` whose owner is gone; return how many."""
    removed = 0
    for path in Path(root).glob(f"{TEMP_PREFIX}*"):
        if not is_sandbox_dir(path):
            continue
        try:
            owner = (path / OWNER_FILE).read_text()
        except OSError:
            continue  # not a local sandbox dir (a Docker one, or not ours to read)
        if owner_gone(owner) and remove_sandbox_dir(path):
            removed += 1
    if removed:
        logger.warning("removed %d sandbox dir(s) left behind by processes that no longer exist", removed)
    return removed


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat_line.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after the comm field
