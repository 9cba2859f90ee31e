"""The local backend's view of processes (psutil): the whole tree below a kernel, and the processes
of a uid that RLIMIT_NPROC counts."""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from stare_sandbox.local import _descendants, _user_process_count


def test_descendants_are_the_whole_tree_and_nothing_for_a_gone_process():
    # sh -> (sh -> sleep) and sleep: children and a grandchild
    tree = subprocess.Popen(["sh", "-c", "(sleep 30; true) & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(found := _descendants(tree.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        expected = {p.pid for p in psutil.Process(tree.pid).children(recursive=True)}
        assert set(found) == expected and len(found) == 3
        assert tree.pid not in found
    finally:
        for pid in [*_descendants(tree.pid), tree.pid]:
            os.kill(pid, 9)
        tree.wait()
    assert _descendants(tree.pid) == []


def test_user_process_count_counts_this_process():
    before = _user_process_count(os.getuid())
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _user_process_count(os.getuid()) >= before + 1 >= 2
    finally:
        child.kill()
        child.wait()
