"""The setup scripts under a busy package manager: apt's lock is waited for, with a bound and a message."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, require

HOLD = """
import fcntl, sys, time
with open(sys.argv[1], "a") as lock:
    fcntl.lockf(lock, fcntl.LOCK_EX)  # as dpkg and apt take it
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.mark.slow  # 15-25 s: apt waits for a lock held 13 s (longer than its own 10 s wait)
def test_apt_waits_for_another_package_manager_and_says_so():
    """Before: the setup's apt-get failed at once on the held lock, and `make quickstart` fell back to
    the local backend. Now it waits (APT_LOCK_WAIT_S), saying so, and goes on."""
    lock = "/var/lib/dpkg/lock-frontend"
    problem = None
    if os.geteuid() != 0 or shutil.which("apt-get") is None or not os.path.exists(lock):
        problem = "needs root and apt-get (a Debian host), as `make setup` does"
    require("host", problem)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, lock, "13"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        # an installed package: apt takes dpkg's lock and changes nothing
        done = subprocess.run(
            ["bash", "-c", ". scripts/apt_wait.sh && apt_wait install -y -qq debootstrap"],
            cwd=REPO,
            env={**os.environ, "APT_LOCK_WAIT_S": "120"},
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "another package manager holds the apt lock: waiting for it" in done.stderr
