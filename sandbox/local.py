"""The local backend: the same IPython kernel as a subprocess under resource limits.

For machines without Docker. Its isolation is much weaker than a container's, and it says so once
per process. What it enforces:

- memory: ``RLIMIT_DATA`` = ``memory_mb`` (allocations beyond it raise ``MemoryError``);
- file size: ``RLIMIT_FSIZE`` = ``tmpfs_mb`` per file (not a disk quota);
- CPU: ``RLIMIT_CPU`` as a lifetime backstop of ``CPU_BACKSTOP_S`` per kernel process (per-call
  timeouts are the driver's interrupt/restart);
- processes: ``RLIMIT_NPROC`` when not root (root ignores it), counted on top of the user's
  processes that already exist;
- network: its own empty network namespace when the OS lets this process ``unshare`` one
  (as root; checked once, see ``network_isolated``); otherwise none;
- environment: a scrubbed one (never the host's variables), cwd and HOME a fresh temp work dir.

It cannot stop reads of host files the user can read, writes outside the work dir, fork bombs
when running as root, or disk filling with many files. Limits are set by a tiny bootstrap in the
child (``-c``) rather than ``preexec_fn``, which is unsafe in threaded hosts such as a pool.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from jupyter_client.connect import write_connection_file
from jupyter_client.launcher import launch_kernel

from sandbox.config import SandboxConfig
from sandbox.kernel import KERNEL_ARGS, KernelDriver, KernelSandbox, reset_code
from sandbox.owner import OWNER_FILE, owner_id, reap_local_dirs
from sandbox.usage import ProcessUsage

logger = logging.getLogger(__name__)

CPU_BACKSTOP_S = 3600
"""RLIMIT_CPU of a local kernel process over its lifetime (it dies with SIGXCPU beyond it)."""

WARNING = (
    "LocalSandbox runs model code as a local process with rlimits only: it can read your files and "
    "is far less isolated than the Docker backend; use it only for trusted code or development"
)

_BOOTSTRAP = """
import ctypes, json, os, resource, runpy, sys
limits = json.loads(sys.argv.pop(1))
for name, value in limits["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if limits["unshare_net"]:
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:
        raise SystemExit("unshare(CLONE_NEWNET) failed")
runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
"""


@functools.cache
def _warn_once() -> None:
    logger.warning(WARNING)


@functools.cache
def network_isolated() -> bool:
    """True when this process may give a child its own network namespace (checked once)."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=30, env={}).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _user_process_count(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


def _descendants(root: int) -> list[int]:
    """PIDs of every process below ``root`` (from /proc parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += frontier
    return found


class _LocalKernel:
    """A kernel subprocess (``KernelHost``): launch, interrupt, kill with its descendants."""

    def __init__(self, sandbox_dir: Path, work_dir: Path, config: SandboxConfig) -> None:
        self.connection_file = sandbox_dir / "kernel.json"
        self.log_file = sandbox_dir / "kernel.log"
        self.work_dir = work_dir
        self.connection_info = self._write_connection_file(sandbox_dir)
        rlimits = {"RLIMIT_DATA": config.memory_mb * 2**20, "RLIMIT_FSIZE": config.tmpfs_mb * 2**20}
        rlimits["RLIMIT_CPU"] = CPU_BACKSTOP_S
        if os.geteuid() != 0:
            rlimits["RLIMIT_NPROC"] = _user_process_count(os.geteuid()) + config.pids_limit
        self.limits = {"rlimits": rlimits, "unshare_net": network_isolated()}
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(work_dir),
            "TMPDIR": str(work_dir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "MPLCONFIGDIR": str(work_dir / ".mpl"),
            "IPYTHONDIR": str(sandbox_dir / "ipython"),
            **config.env,
        }
        self.process: subprocess.Popen | None = None
        self.usage: ProcessUsage | None = None
        self.launch()

    def _write_connection_file(self, sandbox_dir: Path) -> dict:
        fname, info = write_connection_file(
            str(self.connection_file),
            ip=str(sandbox_dir / "k"),
            transport="ipc",
            shell_port=1,
            iopub_port=2,
            stdin_port=3,
            control_port=4,
            hb_port=5,
            key=uuid.uuid4().hex.encode(),
        )
        return dict(info)

    def launch(self) -> None:
        cmd = [
            sys.executable,
            "-c",
            _BOOTSTRAP,
            json.dumps(self.limits),
            "-f",
            str(self.connection_file),
            *KERNEL_ARGS,
        ]
        with open(self.log_file, "ab") as log:
            self.process = launch_kernel(
                cmd, stdout=log.fileno(), stderr=subprocess.STDOUT, env=dict(self.env), cwd=str(self.work_dir)
            )
        self.usage = ProcessUsage(self.process.pid)

    def meter(self) -> ProcessUsage | None:
        return self.usage

    def interrupt(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
            except OSError:
                pass

    def kill(self) -> None:
        if self.process is None:
            return
        pid = self.process.pid
        for victim in [pid, *_descendants(pid)]:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("local kernel %d did not exit after SIGKILL", pid)

    def restart(self) -> None:
        self.kill()
        self.launch()

    def ready(self) -> None:
        pass

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def death_cause(self) -> str:
        code = self.process.poll() if self.process is not None else None
        if code is None:
            return "still running"
        if code < 0:
            name = signal.Signals(-code).name
            hint = {"SIGXCPU": f", the {CPU_BACKSTOP_S} s CPU backstop"}.get(name, "")
            return f"killed by {name}{hint}"
        return f"exit code {code}"


_reaped = False


class LocalSandbox(KernelSandbox):
    """A kernel subprocess in a fresh temp work dir under rlimits (see the module docstring).

    Args:
        config: Limits; ``image``, ``network``, ``user`` and ``cpus`` do not apply here.
        start_timeout: Seconds to wait for a new kernel to answer.

    Raises:
        SandboxError: the kernel does not start.
    """

    backend = "local"

    def __init__(self, config: SandboxConfig | None = None, *, start_timeout: float = 60.0) -> None:
        super().__init__(config)
        _warn_once()
        self.start_timeout = start_timeout
        self.network_isolated = network_isolated()
        # Short path under /tmp: unix socket paths must stay under ~100 characters.
        global _reaped
        if not _reaped:  # once per process: dirs of killed owners (SIGKILL runs no cleanup)
            _reaped = True
            reap_local_dirs("/tmp")
        self.dir = Path(tempfile.mkdtemp(prefix="stare-", dir="/tmp"))
        (self.dir / OWNER_FILE).write_text(owner_id())
        self.work_dir = self.dir / "work"
        self.work_dir.mkdir()
        self._closed = False
        self._kernel: _LocalKernel | None = None
        self._driver: KernelDriver | None = None
        try:
            self._kernel = _LocalKernel(self.dir, self.work_dir, self.config)
            self._driver = KernelDriver(
                self._kernel.connection_info,
                self._kernel,
                max_output_chars=self.config.max_output_chars,
                restart_grace_s=self.config.restart_grace_s,
            )
            self._driver.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def reset(self, *, hard: bool = False) -> None:
        """Forget all state. Soft (default, milliseconds): clear the namespace, env, work dir and
        child processes in place (see ``sandbox.kernel.reset_code``). Hard, or when the soft reset
        fails: a fresh kernel process."""
        driver = self._live_driver()
        if not hard and driver.ready and self._kernel is not None and self._kernel.is_alive():
            if driver.run_quiet(reset_code([str(self.work_dir)], kill_all=False), timeout=5.0):
                return
        driver.restart()
        driver.wait_ready(self.start_timeout)

    def is_alive(self) -> bool:
        return not self._closed and self._kernel is not None and self._kernel.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._driver is not None:
            self._driver.close()
        if self._kernel is not None:
            self._kernel.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
