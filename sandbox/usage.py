"""CPU time and peak memory of a sandbox, read on the host from /proc and cgroupfs.

Nothing here talks to the kernel: each reading opens one or two small kernel files (a few
microseconds), so the driver can account every call without an extra round trip.

- ``CgroupUsage`` (Docker): the container's cgroup, found through ``/proc/<pid>/cgroup`` of any
  process inside it and ``/proc/self/mountinfo``, so both Docker cgroup drivers (cgroupfs,
  systemd) and both cgroup versions work. CPU is the whole container's (every process in it,
  nanosecond precision); memory is what the container is charged for (anonymous memory, tmpfs
  files such as ``/work``, page cache): the number its memory limit is checked against.
- ``ProcessUsage`` (local): one process and its reaped children. CPU is the process's CPU clock
  (nanoseconds, all threads) plus its reaped children's from ``/proc/<pid>/stat`` (clock ticks);
  memory is its peak resident set size (``VmHWM``).

Every reading returns None when the file cannot be read (a remote Docker daemon, no procfs, a
process that just died); callers treat that as "unknown", never as an error.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str | Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _write(path: str | Path, data: bytes) -> int:
    """Write ``data`` to a kernel file: 0, or the errno of the failure."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as exc:
        return exc.errno or errno.EIO
    try:
        os.write(fd, data)
        return 0
    except OSError as exc:
        return exc.errno or errno.EIO
    finally:
        os.close(fd)


def _permitted(error: int) -> bool:
    """False for errors that will not go away (not allowed here), True for success or transient ones."""
    return error not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EINVAL)


def _cgroup_mounts() -> list[tuple[str, Path, set[str]]]:
    """(root inside the hierarchy, mount point, controllers; empty for cgroup v2) of each mount."""
    mounts = []
    for line in (_read("/proc/self/mountinfo") or b"").decode(errors="replace").splitlines():
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if len(parts) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        controllers = set(tail[2].split(",")) if tail[0] == "cgroup" else set()
        mounts.append((parts[3], Path(parts[4]), controllers))
    return mounts


def cgroup_dir(pid: int, controller: str) -> Path | None:
    """Host directory of the cgroup of ``pid`` for a v1 ``controller`` ("memory", "cpuacct"),
    or its v2 directory (where every controller lives); None when it cannot be found."""
    text = _read(f"/proc/{pid}/cgroup")
    if text is None:
        return None
    mounts = _cgroup_mounts()
    for line in text.decode(errors="replace").splitlines():
        hierarchy, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        v2 = hierarchy == "0" and names == ""
        if not v2 and controller not in names.split(","):
            continue
        for root, mount_point, controllers in mounts:
            if (controllers == set()) != v2 or (not v2 and controller not in controllers):
                continue
            if path == root or path.startswith(root.rstrip("/") + "/"):
                folder = mount_point / path[len(root) :].lstrip("/")
                if folder.is_dir():
                    return folder
    return None


class CgroupUsage:
    """CPU and peak memory of a Docker container from its cgroup (v1 or v2).

    The cgroup path of a container stays the same across ``docker restart``, but its counters
    start again from zero.

    Args:
        pid: Host pid of any process in the container (``State.Pid``).
    """

    def __init__(self, pid: int) -> None:
        self.cpu_file: Path | None = None
        self.cpu_v2 = False
        self.peak_file: Path | None = None
        self.peak_resettable = False
        self._peak_fd: int | None = None  # v2: the descriptor a reset applies to
        cpuacct, memory = cgroup_dir(pid, "cpuacct"), cgroup_dir(pid, "memory")
        if cpuacct is not None and (cpuacct / "cpuacct.usage").exists():
            self.cpu_file = cpuacct / "cpuacct.usage"
        elif cpuacct is not None and (cpuacct / "cpu.stat").exists():
            self.cpu_file, self.cpu_v2 = cpuacct / "cpu.stat", True
        if memory is not None and (memory / "memory.max_usage_in_bytes").exists():
            self.peak_file = memory / "memory.max_usage_in_bytes"
            # v1: writing 0 resets the high-water mark to the current usage (root only).
            self.peak_resettable = os.access(self.peak_file, os.W_OK)
        elif memory is not None and (memory / "memory.peak").exists():
            # v2: a write resets memory.peak for the writing file descriptor only (Linux 6.12+),
            # so the peak is written and read through one descriptor, held until the container
            # restarts (its cgroup is then a new one: ``forget``).
            self.peak_file = memory / "memory.peak"
            self.peak_resettable = os.access(self.peak_file, os.W_OK)

    def cpu_seconds(self) -> float | None:
        """CPU seconds of every process in the container since it (re)started."""
        text = _read(self.cpu_file) if self.cpu_file is not None else None
        if text is None:
            return None
        try:
            if not self.cpu_v2:
                return int(text) / 1e9
            for line in text.split(b"\n"):
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
        except ValueError:
            pass
        return None

    def peak_bytes(self) -> int | None:
        """High-water mark of the container's memory charge since the last ``reset_peak``, or
        since the container (re)started when it cannot be reset."""
        if self._peak_fd is not None:
            try:
                text: bytes | None = os.pread(self._peak_fd, 64, 0)
            except OSError:
                text = None
        else:
            text = _read(self.peak_file) if self.peak_file is not None else None
        try:
            return int(text) if text is not None else None
        except ValueError:
            return None

    def reset_peak(self) -> bool:
        """Restart the high-water mark from the current usage; False when not possible here."""
        if not self.peak_resettable or self.peak_file is None:
            return False
        if self.peak_file.name != "memory.peak":  # v1: resets the file for every reader
            error = _write(self.peak_file, b"0")
        else:
            error = self._reset_v2(self.peak_file)
        self.peak_resettable = _permitted(error)
        return error == 0

    def _reset_v2(self, peak_file: Path) -> int:
        try:
            if self._peak_fd is None:
                self._peak_fd = os.open(peak_file, os.O_RDWR | os.O_CLOEXEC)
            # At offset 0, like every read: a cgroup file ignores the offset, but a plain
            # write would move it on each reset.
            os.pwrite(self._peak_fd, b"reset\n", 0)
        except OSError as exc:
            self.forget()
            return exc.errno or errno.EIO
        return 0

    def forget(self) -> None:
        """Close the v2 peak descriptor (the container restarted: its cgroup is a new one)."""
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None

    def __del__(self) -> None:
        self.forget()


class ProcessUsage:
    """CPU and peak resident memory of one local process (its reaped children's CPU included).

    Args:
        pid: The process; readings become None once it has exited.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.clock_id = _cpu_clock_id(pid)
        self.peak_resettable = True

    def cpu_seconds(self) -> float | None:
        """CPU seconds of the process (all threads) and of its reaped children since it started."""
        stat = _read(f"/proc/{self.pid}/stat")
        if stat is None:
            return None
        try:
            fields = stat.rsplit(b")", 1)[1].split()
            utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        except (IndexError, ValueError):
            return None
        children = (cutime + cstime) / CLOCK_TICKS
        if self.clock_id is not None:
            try:
                return time.clock_gettime(self.clock_id) + children
            except OSError:
                pass
        return (utime + stime) / CLOCK_TICKS + children

    def peak_bytes(self) -> int | None:
        """Peak resident set size (``VmHWM``) since the last ``reset_peak``, or since start."""
        status = _read(f"/proc/{self.pid}/status")
        if status is None:
            return None
        for line in status.split(b"\n"):
            if line.startswith(b"VmHWM:"):
                try:
                    return int(line.split()[1]) * 1024
                except (IndexError, ValueError):
                    return None
        return None

    def reset_peak(self) -> bool:
        """Restart ``VmHWM`` from the current RSS (``clear_refs`` 5, Linux 4.0+; same user)."""
        if not self.peak_resettable:
            return False
        error = _write(f"/proc/{self.pid}/clear_refs", b"5")
        self.peak_resettable = _permitted(error)
        return error == 0


def _cpu_clock_id(pid: int) -> int | None:
    """The CPU-time clock of process ``pid`` (``clock_getcpuclockid(3)``), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        clock_id = ctypes.c_int()
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock_id)) != 0:
            return None
        time.clock_gettime(clock_id.value)
    except (AttributeError, OSError):
        return None
    return clock_id.value
