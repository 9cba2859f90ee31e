"""The local backend: the same IPython kernel as a subprocess under resource limits.

For machines without Docker. Its isolation is much weaker than a container's, and it says so once
per process (``WARNING``). What it enforces:

- its own user, when the host runs as root: each sandbox's kernel runs as an unprivileged uid of
  its own (``SANDBOX_UIDS``, ``stare_sandbox.uids``), so it cannot read the trainer's memory or environment, signal it,
  write root's files, or re-enter the host's network namespace (``setns`` needs a capability);
- its own cgroup, when the host may make one (root, cgroup v1 or a delegated v2): memory
  (``memory_mb``, shared memory and ``/dev/shm`` files included) and processes (``pids_limit``),
  and ``close()`` kills every process in it;
- a supervisor process between the trainer and the kernel: a child subreaper (a ``setsid``
  double fork still comes back to it, so ``close()`` finds and kills it), started from one
  long-lived thread with a parent-death signal (killing the trainer, even with SIGKILL, kills
  the supervisor, which kills the kernel), with the scrubbed environment as its own;
- a non-dumpable trainer, when it is not root: code of the same uid can then neither ptrace it
  nor read its ``/proc/<pid>/environ`` or memory (the trainer can no longer be attached to with
  a debugger or py-spy without root, and writes no core dumps);
- memory: ``RLIMIT_DATA`` = ``memory_mb`` (allocations beyond it raise ``MemoryError``);
- file size: ``RLIMIT_FSIZE`` = ``tmpfs_mb`` per file (not a disk quota);
- CPU: ``RLIMIT_CPU`` as a lifetime backstop of ``CPU_BACKSTOP_S`` per kernel process (per-call
  timeouts are the driver's interrupt/restart);
- processes: ``RLIMIT_NPROC`` (for its own uid as root; on top of the user's processes that
  already exist otherwise);
- network: its own empty network namespace when the OS lets this process ``unshare`` one
  (as root; checked once, see ``network_isolated``); otherwise none;
- environment: a scrubbed one (never the host's variables), cwd and HOME a fresh temp work dir.

What remains (see ``WARNING``): it reads every host file its user may read and writes where that
user may write; without root it runs as the trainer's user, with the host's network, and a
``mmap(MAP_SHARED)`` or ``/dev/shm`` file is not counted by ``RLIMIT_DATA``; ``/dev/shm``, ``/tmp``
and SysV IPC are the host's; its reset between episodes runs inside the kernel's own interpreter
(a monkeypatch or a thread survives it: ``reset(hard=True)`` starts a fresh process). Limits are
set by a tiny bootstrap in the child (``-c``) rather than ``preexec_fn``, which is unsafe in
threaded hosts such as a pool.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil
from jupyter_client.connect import write_connection_file
from jupyter_client.launcher import launch_kernel

from stare_sandbox.config import HASH_SEED, SANDBOX_UIDS, SandboxConfig
from stare_sandbox.kernel import KERNEL_ARGS, KernelDriver, KernelSandbox, reset_code
from stare_sandbox.owner import OWNER_FILE, TEMP_PREFIX, TEMP_ROOT, owner_id, reap_local_dirs
from stare_sandbox.uids import claim_uid
from stare_sandbox.usage import ProcessUsage, cgroup_dir

logger = logging.getLogger(__name__)

T = TypeVar("T")
PR_SET_DUMPABLE = 4

CPU_BACKSTOP_S = 3600
"""RLIMIT_CPU of a local kernel process over its lifetime (it dies with SIGXCPU beyond it)."""

WARNING = (
    "LocalSandbox runs model code as a local process, far less isolated than the Docker backend: "
    "it can read every file its user can read and write where that user can write; {what}. Use it "
    "only for trusted code or development"
)
"""The one-time warning; ``{what}`` says what this host adds or lacks (``_warn_once``)."""

_BOOTSTRAP = """
import ctypes, json, os, resource, runpy, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
plan = json.loads(sys.argv.pop(1))
report = int(sys.argv.pop(1))
for procs in plan["cgroups"]:  # before the rlimits and the uid change: joining needs root
    with open(procs, "w") as f:
        f.write(str(os.getpid()))
for name, value in plan["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if plan["unshare_net"] and libc.unshare(0x40000000) != 0:
    raise SystemExit("unshare(CLONE_NEWNET) failed")
if plan["uid"] is not None:
    os.setgroups([])
    os.setgid(plan["uid"])
    os.setuid(plan["uid"])
elif plan["drop_capabilities"]:  # root, but none of root's capabilities, now or after an exec
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise SystemExit("capset failed: cannot drop root's capabilities")
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG, after setuid (which clears it)
if os.getppid() != plan["parent"]:
    os._exit(1)  # the trainer is already gone
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the kernel's tree come back here
kernel = os.fork()
if kernel == 0:
    os.close(report)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
    os._exit(0)
os.write(report, str(kernel).encode())
os.close(report)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host interrupts the kernel through the group
while True:
    pid, status = os.wait()
    if pid == kernel:
        break
def children():
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found
left = children()
while left:  # the kernel is gone: so is everything it left behind (orphans come back here)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    left = children()
if os.WIFSIGNALED(status):  # end as the kernel ended, so the host reads the same cause
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
"""


@functools.cache
def _warn_once() -> None:
    """The one-time warning, with what this host adds (root: own user, cgroup) or lacks."""
    if os.geteuid() == 0:
        user = (
            "each kernel runs as its own unprivileged uid"
            if own_user_possible()
            else "kernels run as root without capabilities (root's files stay readable and writable)"
        )
        what = f"here (root) {user}" + (
            ", each in its own cgroup (memory, processes)"
            if kernel_cgroups_available()
            else "; no cgroup could be made, so shared memory and /dev/shm escape the memory limit"
        )
    else:
        what = (
            "here (not root) it runs as your user, with your network, and shared memory and "
            "/dev/shm escape its memory limit; this process was made non-dumpable so that it "
            "cannot read this process's memory or environment"
        )
    # On stderr whatever the logging setup: model code outside a container must never go unseen.
    print(f"[sandbox] {WARNING.format(what=what)}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the host's side


class _Launcher:
    """One long-lived thread that starts every local kernel. A parent-death signal fires when the
    *thread* that forked a process ends, and a pool starts sandboxes from short-lived threads:
    forking from this one ties the kernels to the life of the process instead."""

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="sandbox-local-launcher", daemon=True
                )
                self._thread.start()
        done: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, done = self._requests.get()
            try:
                done.put((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.put((False, exc))


_LAUNCHER = _Launcher()


@functools.cache
def _make_trainer_undumpable() -> None:
    """Code of the trainer's own uid may otherwise ptrace it and read /proc/<pid>/environ and mem."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        logger.warning("could not make this process non-dumpable: local kernels can read its memory")


@functools.cache
def own_user_possible() -> bool:
    """True when a kernel can run as a ``SANDBOX_UIDS`` uid here: root, and this interpreter (its
    standard library, ipykernel) readable by that uid; e.g. not a Python installed under /root."""
    if os.geteuid() != 0:
        return False
    uid = SANDBOX_UIDS[-1]
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import ipykernel"], user=uid, group=uid, extra_groups=[],
            cwd="/", env={}, capture_output=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    if probe.returncode != 0:
        logger.warning(
            "local kernels run as root without root's capabilities: uid %d cannot use %s (%s); "
            "install Python where every user can read it to give them their own unprivileged user",
            uid, sys.executable, probe.stderr.decode(errors="replace").strip().splitlines()[-1:],
        )  # fmt: skip
    return probe.returncode == 0


class _KernelCgroup:
    """Cgroups of one local kernel (v1: a memory and a pids hierarchy; v2: one directory), made
    below this process's own; None from ``make`` where this process may not make them."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    @classmethod
    def make(cls, name: str, memory_bytes: int, pids: int) -> _KernelCgroup | None:
        if os.geteuid() != 0:
            return None
        made: list[Path] = []
        try:
            for controller, limits in (
                ("memory", {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes,
                            "memory.max": memory_bytes, "memory.swap.max": 0}),
                ("pids", {"pids.max": pids}),
            ):  # fmt: skip
                parent = cgroup_dir(os.getpid(), controller)
                if parent is None:
                    raise OSError(f"no {controller} cgroup")
                folder = parent / name
                if folder not in made:
                    folder.mkdir()
                    made.append(folder)
                written = [key for key, value in limits.items() if _write_setting(folder / key, value)]
                if controller == "memory" and not {"memory.limit_in_bytes", "memory.max"} & set(written):
                    raise OSError("cannot set a memory limit")
                if controller == "pids" and not written:
                    raise OSError("cannot set a pids limit")
        except OSError as exc:
            logger.debug("no cgroup for local kernels here: %s", exc)
            cls(made).remove()
            return None
        return cls(made)

    def procs_files(self) -> list[str]:
        return [str(folder / "cgroup.procs") for folder in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files():
            try:
                found.update(int(line) for line in Path(procs).read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until none is left (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        for folder in self.dirs:
            try:
                folder.rmdir()
            except OSError as exc:
                logger.debug("could not remove cgroup %s: %s", folder, exc)


def reap_cgroups() -> int:
    """Remove the cgroups of local sandboxes whose directory is gone (their owner was killed and
    its directory reaped), killing what still runs in them; return how many."""
    removed = 0
    parents = {cgroup_dir(os.getpid(), controller) for controller in ("memory", "pids")} - {None}
    for parent in parents:
        for folder in parent.glob(f"{TEMP_PREFIX}*"):  # type: ignore[union-attr]
            if (TEMP_ROOT / folder.name).exists() or not folder.is_dir():
                continue
            group = _KernelCgroup([folder])
            group.kill_all()
            group.remove()
            removed += not folder.exists()
    return removed


def _write_setting(path: Path, value: int) -> bool:
    try:
        path.write_text(str(value))
    except OSError:
        return False
    return True


@functools.cache
def kernel_cgroups_available() -> bool:
    """True when this process can give each local kernel its own cgroup (checked once)."""
    probe = _KernelCgroup.make(f"stare-probe-{os.getpid()}", 2**30, 64)
    if probe is None:
        return False
    probe.remove()
    return True


@functools.cache
def network_isolated() -> bool:
    """True when this process may give a child its own network namespace (checked once)."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=30, env={}).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _user_process_count(uid: int) -> int:
    """Processes whose real uid is ``uid`` (what RLIMIT_NPROC counts)."""
    return sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)


def _descendants(root: int) -> list[int]:
    """PIDs of every process below ``root``."""
    try:
        return [child.pid for child in psutil.Process(root).children(recursive=True)]
    except psutil.Error:  # gone already, or not ours to see
        return []


class _LocalKernel:
    """A kernel subprocess (``KernelHost``) under its supervisor: launch, interrupt, kill with
    everything it started (see the module docstring)."""

    def __init__(self, sandbox_dir: Path, work_dir: Path, config: SandboxConfig) -> None:
        root = os.geteuid() == 0
        self._uid = claim_uid() if own_user_possible() else None
        self.uid = None if self._uid is None else self._uid.uid
        # The kernel's own files (connection file, sockets, IPython dir) in a dir it owns.
        kernel_dir = sandbox_dir / "kernel"
        kernel_dir.mkdir(mode=0o700)
        if self.uid is not None:
            sandbox_dir.chmod(0o711)  # the kernel may pass through, not list or write
            for folder in (kernel_dir, work_dir):
                os.chown(folder, self.uid, self.uid)
        self.connection_file = kernel_dir / "kernel.json"
        self.log_file = sandbox_dir / "kernel.log"
        self.work_dir = work_dir
        self.connection_info = self._write_connection_file(kernel_dir)
        if self.uid is not None:
            os.chown(self.connection_file, self.uid, self.uid)
        self.cgroup = _KernelCgroup.make(sandbox_dir.name, config.memory_mb * 2**20, config.pids_limit)
        rlimits = {"RLIMIT_DATA": config.memory_mb * 2**20, "RLIMIT_FSIZE": config.tmpfs_mb * 2**20}
        rlimits["RLIMIT_CPU"] = CPU_BACKSTOP_S
        if root:
            rlimits["RLIMIT_NPROC"] = config.pids_limit  # counted for its own uid
        else:
            rlimits["RLIMIT_NPROC"] = _user_process_count(os.geteuid()) + config.pids_limit
        self.plan = {
            "rlimits": rlimits,
            "unshare_net": network_isolated(),
            "uid": self.uid,
            "drop_capabilities": root and self.uid is None,
            "parent": os.getpid(),
            "cgroups": self.cgroup.procs_files() if self.cgroup is not None else [],
        }
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(work_dir),
            "TMPDIR": str(work_dir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": HASH_SEED,
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            "MPLCONFIGDIR": str(work_dir / ".mpl"),
            "IPYTHONDIR": str(kernel_dir / "ipython"),
            **config.env,
        }
        self.process: subprocess.Popen | None = None
        self.kernel_pid: int | None = None
        self.usage: ProcessUsage | None = None
        self.launch()

    def _write_connection_file(self, kernel_dir: Path) -> dict:
        fname, info = write_connection_file(
            str(self.connection_file),
            ip=str(kernel_dir / "k"),
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
        """Start the supervisor (from the launcher thread) and learn its kernel's pid."""
        report_r, report_w = os.pipe()
        cmd = [
            sys.executable,
            "-c",
            _BOOTSTRAP,
            json.dumps(self.plan),
            str(report_w),
            "-f",
            str(self.connection_file),
            *KERNEL_ARGS,
        ]

        def start() -> subprocess.Popen:
            with open(self.log_file, "ab") as log:
                return launch_kernel(
                    cmd,
                    stdout=log.fileno(),
                    stderr=subprocess.STDOUT,
                    env=dict(self.env),
                    cwd=str(self.work_dir),
                    pass_fds=(report_w,),
                )

        try:
            self.process = _LAUNCHER.run(start)
        finally:
            os.close(report_w)
        try:  # the supervisor writes the kernel's pid once it forked it (EOF: it died first)
            text = os.read(report_r, 32).decode() if select.select([report_r], [], [], 60)[0] else ""
        finally:
            os.close(report_r)
        self.kernel_pid = int(text) if text.isdigit() else None
        self.usage = ProcessUsage(self.kernel_pid) if self.kernel_pid is not None else None

    def meter(self) -> ProcessUsage | None:
        return self.usage

    def interrupt(self) -> None:
        """SIGINT to the process group: the supervisor ignores it, the kernel raises."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL the supervisor, the kernel and everything they started: the supervisor's
        descendants (a double fork comes back to it as a subreaper), its process group and,
        where there is one, every process in the sandbox's cgroup."""
        if self.process is None:
            return
        pid = self.process.pid
        for victim in [*_descendants(pid), pid]:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if self.cgroup is not None:
            self.cgroup.kill_all()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("local kernel %d did not exit after SIGKILL", pid)

    def close(self) -> None:
        """Kill everything and give back the cgroup and the uid."""
        self.kill()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self._uid is not None:
            self._uid.release()

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

    def killed_from_outside(self) -> bool:
        """Always False: the kernel is a process of this user, which the code it runs can end in
        every way something outside could (a signal, an exit), so its end is never evidence of an
        outside cause."""
        return False


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
        if not own_user_possible():  # the kernel has this process's uid
            _make_trainer_undumpable()
        self.start_timeout = start_timeout
        self.network_isolated = network_isolated()
        # Short path under /tmp: unix socket paths must stay under ~100 characters.
        global _reaped
        if not _reaped:  # once per process: dirs of killed owners (SIGKILL runs no cleanup)
            _reaped = True
            reap_local_dirs(TEMP_ROOT)
            reap_cgroups()
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
                preload=self.config.preload,
            )
            self._driver.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def reset(self, *, hard: bool = False) -> None:
        """Forget all state. Soft (default, milliseconds): clear the namespace, env, work dir and
        child processes in place (see ``stare_sandbox.kernel.reset_code``). Hard, or when the soft reset
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
            self._kernel.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
