"""``stare_sandbox.usage`` on a cgroup-v2 host, played by a fake cgroup tree in a temp dir.

This machine has cgroup v1 (its tests of the real counters are in ``tests/sandbox/test_docker.py``), so
the v2 path of ``CgroupUsage`` would otherwise never run. The fake plays the kernel's part: the
container's cgroup is found through a fake ``/proc/<pid>/cgroup`` and ``/proc/self/mountinfo``,
and ``memory.peak`` is per descriptor the way Linux 6.12+ makes it (a write resets the value that
*that* descriptor reads; any other open reads the cgroup's all-time peak). The fake gets this by
swapping the file's inode after the reset: the descriptor the reset wrote to keeps the old inode
(the per-descriptor value), a fresh open finds the new one (the all-time peak).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stare_sandbox import usage as usage_module
from stare_sandbox.usage import CgroupUsage, cgroup_dir

PID = 4242
CONTAINER = "/system.slice/docker-0123abcd.scope"


@pytest.fixture
def v2_host(tmp_path, monkeypatch) -> Path:
    """A cgroup2 mount at ``tmp_path/cgroup`` holding the container's cgroup; returns its dir."""
    mount = tmp_path / "cgroup"
    folder = mount / CONTAINER.lstrip("/")
    folder.mkdir(parents=True)
    (folder / "cgroup.procs").write_text(f"{PID}\n4243\n")
    (folder / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    (folder / "memory.current").write_text("2000\n")
    (folder / "memory.peak").write_text("9000\n")
    fake_proc = {
        f"/proc/{PID}/cgroup": f"0::{CONTAINER}\n".encode(),
        "/proc/self/mountinfo": (
            "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
            f"31 23 0:28 / {mount} rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
            "rw,nsdelegate,memory_recursiveprot\n"
        ).encode(),
    }
    real_read = usage_module._read
    monkeypatch.setattr(usage_module, "_read", lambda path: fake_proc.get(str(path)) or real_read(path))
    return folder


def descriptors_on(path: Path) -> list[int]:
    """This process's open descriptors on ``path``'s current inode or on a replaced one."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.removesuffix(" (deleted)") == str(path):
            found.append(int(fd))
    return found


def kernel_sets(path: Path, per_descriptor: int, all_time: int) -> int:
    """Play the kernel after a reset: the inode the reset wrote to gets the per-descriptor peak,
    and the path gets a fresh inode with the all-time peak. Returns a descriptor on the old inode
    (closed by the caller) and checks that the reset really wrote there."""
    old = os.open(path, os.O_RDWR)
    written = os.pread(old, 64, 0)
    assert written.startswith(b"reset"), f"no reset was written to memory.peak: {written!r}"
    os.ftruncate(old, 0)
    os.pwrite(old, f"{per_descriptor}\n".encode(), 0)
    fresh = path.with_name("memory.peak.new")
    fresh.write_text(f"{all_time}\n")
    os.replace(fresh, path)
    return old


def test_the_v2_cgroup_is_found_and_cpu_is_read_from_cpu_stat(v2_host: Path) -> None:
    assert cgroup_dir(PID, "memory") == cgroup_dir(PID, "cpuacct") == cgroup_dir(PID, "pids") == v2_host
    usage = CgroupUsage(PID)
    assert (usage.cpu_file, usage.cpu_v2) == (v2_host / "cpu.stat", True)
    assert usage.cpu_seconds() == 1.5
    assert usage.peak_file == v2_host / "memory.peak" and usage.peak_resettable
    assert usage.peak_bytes() == 9000  # never reset: the all-time peak


def test_the_v2_peak_is_reset_and_read_through_one_held_descriptor(v2_host: Path) -> None:
    peak = v2_host / "memory.peak"
    usage = CgroupUsage(PID)
    assert usage.reset_peak()
    assert len(descriptors_on(peak)) == 1  # held for the next reads and resets
    old = kernel_sets(peak, per_descriptor=3000, all_time=9000)
    try:
        assert usage.peak_bytes() == 3000  # through the reset descriptor, not a fresh open
        os.ftruncate(old, 0)
        assert usage.reset_peak()  # the same descriptor again: the write lands on the old inode
        assert os.pread(old, 64, 0).startswith(b"reset")
        assert peak.read_text() == "9000\n"
    finally:
        os.close(old)
    usage.forget()  # the container restarted: its cgroup is a new one
    assert descriptors_on(peak) == []
    assert usage.peak_bytes() == 9000
    assert usage.reset_peak()  # a new descriptor, on the cgroup's file as it is now
    assert peak.read_text().startswith("reset")
    usage.forget()


def test_a_v2_cgroup_that_went_away_is_not_fatal_and_is_found_again(v2_host: Path) -> None:
    usage = CgroupUsage(PID)
    assert usage.reset_peak()
    usage.forget()
    peak = v2_host / "memory.peak"
    peak.rename(v2_host / "gone")  # between the container's stop and its start
    assert not usage.reset_peak() and usage.peak_resettable  # a passing failure, tried again
    assert usage.peak_bytes() is None
    (v2_host / "gone").rename(peak)
    assert usage.reset_peak()
    usage.forget()
