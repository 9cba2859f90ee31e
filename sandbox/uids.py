"""One uid per live sandbox on a host.

The kernel keeps several quotas per user, not per process or container: pipe buffer pages
(``fs.pipe-user-pages-soft``), pending signals (``RLIMIT_SIGPENDING``), epoll watches
(``fs.epoll.max_user_watches``), processes (``RLIMIT_NPROC``). Sandboxes that shared a uid would
share each of them: one could exhaust a quota for all the others, and fill and drain it as a channel
between concurrent rollouts. So every sandbox, Docker or local, claims a uid of ``SANDBOX_UIDS`` that
nothing else on the host uses, and gives it back when it is gone.

A claim is an exclusive ``flock`` on ``CLAIM_DIR/<uid>``, so it holds across processes (several
trainers, a Ray host) and ends by itself when the process that holds it dies; a uid that any visible
process still runs as (a container whose owner was killed) is skipped as well.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import threading
from pathlib import Path

from stare_sandbox.config import SANDBOX_UIDS
from stare_sandbox.errors import SandboxError

CLAIM_DIR = Path("/tmp/.stare-sandbox-uids")
"""Where claims are held: shared by every user of the host (mode 1777), not a ``stare-*`` temp dir."""

CLAIM_OWNER = SANDBOX_UIDS.start - 1
"""Owner of the claim folder and files a root host makes (0400): not uid 0, because the local backend's
kernel runs as uid 0 without capabilities, and an owner-only file of uid 0, or a sticky folder of uid
0 (whose owner may remove any file in it), would be its own."""

_lock = threading.Lock()
_held: dict[int, int] = {}  # uid -> fd holding its flock, in this process
_swept: set[Path] = set()  # claim folders this process has swept (see _sweep)


class UidClaim:
    """A uid held for one sandbox until ``release``; its gid is the same number."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the uid back (idempotent). Call it once no process of the sandbox is left."""
        with _lock:
            if self._fd is None:
                return
            _held.pop(self.uid, None)
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # for a forked child holding a copy of the fd too
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        return f"UidClaim({self.uid}{'' if self._fd is not None else ', released'})"


def _uids_in_use() -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                pass  # exited meanwhile
    return found


def _claim_dir() -> Path:
    try:
        CLAIM_DIR.mkdir(mode=0o1777)
        CLAIM_DIR.chmod(0o1777)  # past the umask: every host user's sandboxes claim here
    except FileExistsError:
        pass
    info = CLAIM_DIR.lstat()
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid not in (0, CLAIM_OWNER, os.geteuid())
        and info.st_mode & 0o1777 != 0o1777
    ):
        raise SandboxError(
            f"{CLAIM_DIR} is not a directory this user may claim sandbox uids in: remove it "
            "(it is recreated with mode 1777)"
        )
    if os.geteuid() == 0 and info.st_uid != CLAIM_OWNER:
        os.chown(CLAIM_DIR, CLAIM_OWNER, CLAIM_OWNER, follow_symlinks=False)
    if CLAIM_DIR not in _swept:
        _sweep(CLAIM_DIR)
        _swept.add(CLAIM_DIR)
    return CLAIM_DIR


def _planted(owner: int) -> bool:
    """Whether a claim file of ``owner`` was made by model code, never by a host: one of a sandbox
    uid; for a root host, also one of uid 0 (a local kernel's; a root host's own are ``CLAIM_OWNER``'s)."""
    return owner in SANDBOX_UIDS or (os.geteuid() == 0 and owner != CLAIM_OWNER)


def _sweep(folder: Path) -> None:
    """Once a process: claim files made by model code removed (root may; a claim file an earlier
    version made, readable to all, goes too: it is made again when claimed), this user's own made
    owner-only."""
    for entry in os.scandir(folder):
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                continue
            if _planted(info.st_uid):
                os.unlink(entry.path)
            elif info.st_uid == os.geteuid() and info.st_mode & 0o077:
                os.chmod(entry.path, 0o400, follow_symlinks=False)
        except OSError:
            pass  # gone meanwhile, or not ours to change


def _open_claim(path: Path) -> int:
    # Not O_CREAT on an existing file: fs.protected_regular refuses that for another user's file
    # in a sticky directory, while opening it to read is enough to lock it. Owner-only (0400): a
    # sandbox's uid cannot open a host's claim to lock it (one that could held all 1,000 of them).
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            pass
        else:
            info = os.fstat(fd)
            if info.st_uid == os.geteuid() and info.st_mode & 0o077:
                os.fchmod(fd, 0o400)  # made readable to all by an earlier version
            return fd
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o400)
        except FileExistsError:
            continue  # another process made it meanwhile
        if os.geteuid() == 0:
            os.fchown(fd, CLAIM_OWNER, CLAIM_OWNER)
        return fd


def _names_a_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def claim_uid() -> UidClaim:
    """Claim a uid of ``SANDBOX_UIDS`` that no other sandbox holds, no process runs as and no host
    user has (a local kernel of that uid would own that user's files)."""
    unusable: _Unusable | None = None
    try:
        folder = _claim_dir()
        with _lock:
            in_use = _uids_in_use()
            for uid in SANDBOX_UIDS:
                if uid in in_use or uid in _held or _names_a_user(uid):
                    continue
                try:
                    claim = _try_claim(uid, folder)
                except _Unusable as exc:  # e.g. a symlink planted in its place: never followed
                    unusable = exc
                    continue
                if claim is not None:
                    return claim
    except OSError as exc:
        raise SandboxError(
            f"cannot claim a sandbox uid in {CLAIM_DIR} ({exc}): make /tmp writable, or remove {CLAIM_DIR}"
        ) from exc
    if unusable is not None:
        raise SandboxError(
            f"no sandbox uid could be claimed in {CLAIM_DIR}, some not at all ({unusable}): "
            f"remove what is not a plain file there"
        )
    raise SandboxError(
        f"all {len(SANDBOX_UIDS)} sandbox uids ({SANDBOX_UIDS.start}-{SANDBOX_UIDS.stop - 1}) are in use on "
        "this host: close some sandboxes, or look for leftover processes running as those uids"
    )


class _Unusable(SandboxError):
    """This uid's claim file cannot be used (not a plain file, or another user's we cannot open)."""


def _try_claim(uid: int, folder: Path) -> UidClaim | None:
    """The claim of ``uid``, or None when another process holds it. A claim file model code planted
    (:func:`_planted`; the folder is writable by every host user, 1777) is removed and made again, so
    the lock its planter holds is on a file no one looks at any more."""
    path = folder / str(uid)
    for _ in range(2):
        try:
            fd = _open_claim(path)
        except OSError as exc:
            raise _Unusable(str(exc)) from exc
        if _planted(os.fstat(fd).st_uid):
            os.close(fd)
            try:
                path.unlink()
            except OSError as exc:  # not ours to remove (a host user who is not root): leave it
                raise _Unusable(f"{path} was planted by a sandbox uid") from exc
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None  # another process's sandbox holds it
            raise
        _held[uid] = fd
        return UidClaim(uid, fd)
    raise _Unusable(f"{path} was planted again by a sandbox uid")
