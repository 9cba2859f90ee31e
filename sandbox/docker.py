"""The Docker backend: one hardened container per sandbox running an IPython kernel.

The container's main process, PID 1, is the warden (``sandbox/warden.py``, the container's
entrypoint in place of the image's ``tini``): it forks the kernel (``ipykernel_launcher``) and,
between episodes, kills every other process, empties the scratch dirs and IPC and forks a fresh
kernel on fresh listeners with a fresh connection key. The host reaches it with jupyter-client over the ``ipc`` transport:
a host temp dir bind-mounted at ``/conn`` holds the connection file and the unix sockets, so the
container needs no network at all (``network_mode="none"``: only ``lo``).

Hardening (every limit comes from ``SandboxConfig``): no network, a uid of its own on the host
(``stare_sandbox.uids``: no per-user kernel quota is shared with another sandbox; never the host
user's uid: a kernel with it would own ``/conn``), read-only root filesystem, size-limited
tmpfs ``/work`` (and a small ``/tmp``; both root's, mode 1777, so code can fill them but not
mark their roots), ``cap_drop=ALL``, ``no-new-privileges``, the sandbox's own seccomp profile
(``sandbox/seccomp.py``), memory limit == memory+swap limit, pids limit, CPU quota, rlimits (no
core files, ``NOFILE`` open files, no file larger than ``/work``), BLAS/OpenMP thread pools sized
to the CPU quota, the host's boot id masked, container log capped at 1 MB and written by the
warden alone (a kernel's standard streams are ``/dev/null``), never privileged, never the Docker
socket, never the host's environment, never an image pulled from a registry (``create``, not
``run``). An image without setuid/setgid files (``image/build.sh``).

The connection dir ``/conn`` (host: ``DockerSandbox.dir``): owned by the host user, its group
is one the kernel belongs to (the kernel's own gid when the host runs as root; else the host
user's gid, added to the kernel with ``group_add``), and the kernel runs under ``umask 007``, so
its socket files are group-connectable whoever the host user is. The kernel may write there only
while it starts (mode 2770); once it has answered, the dir is locked (2750) until the next
kernel starts, which is when no process of the last episode is left. So code in the sandbox can neither create, delete nor replace (e.g. by a symlink to a
host socket) the files the host connects to: zmq reconnects by path, on its own, whenever a
connection drops, so checking the paths before connecting would not be enough. A restart (kill,
rewrite ``kernel.json``, unlock, start) happens only while no process of the old container is
left, and the new kernel runs no user code before the lock.

Resets: ``reset()`` gives the next episode a fresh kernel process from the warden, which never
runs model code (every process of the episode killed; ``/work``, ``/tmp``, ``/dev/shm``,
``/dev/mqueue`` and SysV IPC emptied; the warden's own rlimits, scheduling and integrity
checked; then, once the host has seen the warden alone in the container, a new connection key
written to the connection dir, the dir opened and SIGUSR2: fresh listeners, a fresh kernel, the
dir locked again before any code runs; tens of milliseconds). ``reset(hard=True)``, or a warden reset that cannot be confirmed, restarts the
container (fresh tmpfs mounts; about a second). The driver replaces a kernel stuck in C code the
same way as a reset (a fresh kernel from the warden), and a kernel that died (the warden then exits
with its status) by restarting the container.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import select
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from stare_sandbox.config import HASH_SEED, SandboxConfig
from stare_sandbox.errors import SandboxError, SandboxUnavailable
from stare_sandbox.kernel import KERNEL_ARGS, KERNEL_BOOT, KernelDriver, KernelSandbox
from stare_sandbox.owner import owner_gone, owner_id, remove_sandbox_dir
from stare_sandbox.seccomp import security_opt
from stare_sandbox.shutdown import exit_on_sigterm
from stare_sandbox.uids import UidClaim, claim_uid
from stare_sandbox.usage import CgroupUsage, cgroup_dir
from stare_sandbox.warden import BOOT_FAILED, KERNEL_EXITED, STOPPED_FROM_OUTSIDE

logger = logging.getLogger(__name__)

LABEL = "org.stare-agent.sandbox"
"""Label on every sandbox container (value "1"): ``docker ps -f label=org.stare-agent.sandbox``."""
OWNER_LABEL = "org.stare-agent.owner"
"""Owner id (``stare_sandbox.owner.owner_id``) of the process that made the container, so orphans can be
found and removed."""

CONN_DIR = "/conn"
WORK_DIR = "/work"
TMP_MB = 16
IPYTHON_DIR = "/tmp/.ipython"
CONN_OPEN = 0o2770
"""Mode of the connection dir while a kernel starts (setgid: its sockets get the dir's group)."""
CONN_LOCKED = 0o2750
"""Mode of the connection dir while user code can run: read-only for the kernel's group."""

KERNEL_COMMAND = ("python3", "-c", (Path(__file__).parent / "warden.py").read_text())
"""The container's entrypoint and PID 1: the warden (``sandbox/warden.py``), which binds the
host's sockets under ``umask 007`` (mode 0770, connectable through the group), forks each kernel
and wipes the container between episodes. Its arguments: the connection file, the code each
kernel runs before it serves (``KERNEL_BOOT``), the modules to preload, then the kernel's."""

MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/proc/sys/kernel/random/boot_id",
    "/sys/fs/cgroup",
    # host-wide counters: what every sandbox on the host moves and reads (a channel between
    # concurrent sandboxes, and a view of the host)
    "/proc/loadavg",
    "/proc/stat",
    "/proc/uptime",
    "/proc/vmstat",
    "/proc/diskstats",
    "/proc/swaps",
    "/proc/interrupts",
    "/proc/softirqs",
    "/proc/zoneinfo",
    "/proc/buddyinfo",
    "/proc/pagetypeinfo",
    "/proc/pressure",
    "/proc/locks",
    "/proc/sys/fs",
    "/proc/sys/kernel/pty",
    # pseudo-terminals: the host's pty count is global (one sandbox took 3,071 of them); a notebook
    # needs none
    "/dev/pts",
    "/dev/ptmx",
)
"""Paths the container sees as empty: Docker's own list (which these replace), the host's boot id
(which would identify the host and its boots), the container's cgroups, whose counters (CPU
time, peak memory, failures) outlive an episode and code could set for the next to read (the
host reads them from its side), the host-wide counters of /proc, and the pseudo-terminals.
``/proc/meminfo`` is replaced instead (``MEMINFO``): programs size themselves from it."""

MEMINFO = """MemTotal: {kb} kB
MemFree: {kb} kB
MemAvailable: {kb} kB
Buffers: 0 kB
Cached: 0 kB
SwapTotal: 0 kB
SwapFree: 0 kB
"""
"""The container's ``/proc/meminfo``: its memory limit as total, free and available, nothing of the
host's (a fixed text, bound read-only)."""

CONTAINER_KEYS = ("command", "entrypoint", "environment", "user", "working_dir", "labels")
"""The options of ``container_options`` that describe the container; the rest are its host config."""

RENEW_TIMEOUT_S = 5.0
"""How long ``reset()`` waits for the processes of an episode to be gone before it restarts the
container instead."""
RESTART_RENEW_TIMEOUT_S = 1.0
"""The same wait when a kernel must be replaced within a call's grace time (a stuck kernel)."""

THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)
"""Thread-pool sizes of BLAS/OpenMP libraries, set to the CPU quota (they would size themselves by
the host's cores and oversubscribe the quota)."""

NOFILE = 1024
"""Open files per process in the sandbox: with ``pids_limit`` 128, at most 131,072 descriptors, about
5 % of a host's ``fs.file-max`` of 2.4 million (the share one sandbox can hold; 21 % at 4,096)."""


def docker_client(timeout: float = 30.0) -> Any:
    """A connected Docker SDK client.

    Raises:
        SandboxUnavailable: the SDK is missing or the daemon does not answer.
    """
    try:
        import docker  # type: ignore[import-untyped]  # no stubs without types-docker
    except ImportError as exc:
        raise SandboxUnavailable("the docker SDK is not installed: pip install docker") from exc
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - every failure here means "no daemon"
        raise SandboxUnavailable(
            f"Docker daemon not reachable ({exc.__class__.__name__}: {exc}): start dockerd, "
            "or pass backend='local'"
        ) from exc
    return client


def container_options(
    config: SandboxConfig, conn_dir: Path, user: str, conn_group: int | None = None
) -> dict[str, Any]:
    """Options of one hardened sandbox container (``CONTAINER_KEYS``, and the keyword arguments
    of ``APIClient.create_host_config``): the kernel runs as ``user`` (``"uid:gid"``), with
    ``conn_group`` as a supplementary group (the host user's, when the host is not root)."""
    from docker.types import Ulimit  # type: ignore[import-untyped]

    threads = str(max(1, math.ceil(config.cpus)))
    env = {
        **dict.fromkeys(THREAD_VARIABLES, threads),
        "HOME": WORK_DIR,
        "IPYTHONDIR": IPYTHON_DIR,
        "MPLCONFIGDIR": f"{WORK_DIR}/.mpl",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": HASH_SEED,
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        **config.env,
    }
    memory = f"{config.memory_mb}m"
    file_bytes = config.tmpfs_mb * 2**20  # no file in the sandbox can be larger than /work
    options = {
        "entrypoint": list(KERNEL_COMMAND),
        "command": [
            f"{CONN_DIR}/kernel.json",
            KERNEL_BOOT,
            json.dumps(list(config.preload)),
            *KERNEL_ARGS,
        ],
        "group_add": [str(conn_group)] if conn_group is not None else [],
        "environment": env,
        "user": user,
        "working_dir": WORK_DIR,
        "network_mode": config.network,
        "read_only": True,
        "tmpfs": {
            WORK_DIR: f"rw,nosuid,nodev,size={config.tmpfs_mb}m,mode=1777",
            "/tmp": f"rw,nosuid,nodev,size={TMP_MB}m,mode=1777",
        },
        "binds": {
            str(conn_dir): {"bind": CONN_DIR, "mode": "rw"},
            str(conn_dir / "meminfo"): {"bind": "/proc/meminfo", "mode": "ro"},
            str(conn_dir / "passwd"): {"bind": "/etc/passwd", "mode": "ro"},
            str(conn_dir / "group"): {"bind": "/etc/group", "mode": "ro"},
        },
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges", security_opt(inet=config.network != "none")],
        "mem_limit": memory,
        "memswap_limit": memory,
        "pids_limit": config.pids_limit,
        "nano_cpus": int(config.cpus * 1e9),
        "ulimits": [
            Ulimit(name="core", soft=0, hard=0),
            Ulimit(name="nofile", soft=NOFILE, hard=NOFILE),
            Ulimit(name="fsize", soft=file_bytes, hard=file_bytes),
        ],
        "init": False,  # the warden is PID 1
        "privileged": False,
        "ipc_mode": "private",
        "log_config": {"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}},
        "labels": {LABEL: "1", OWNER_LABEL: owner_id()},
    }
    if config.runtime is not None:
        options["runtime"] = config.runtime
    return options


def create_container(client: Any, image: str, options: dict[str, Any]) -> Any:
    """Create (never pull, never start) a container from ``container_options``, with
    ``MASKED_PATHS`` (which the SDK's ``containers.create`` cannot set)."""
    api = client.api
    host_config = api.create_host_config(**{k: v for k, v in options.items() if k not in CONTAINER_KEYS})
    host_config["MaskedPaths"] = list(MASKED_PATHS)
    created = api.create_container(
        image, host_config=host_config, **{k: options[k] for k in CONTAINER_KEYS if k in options}
    )
    return client.containers.get(created["Id"])


def reap_orphans(client: Any = None) -> int:
    """Remove sandbox containers (and their connection dirs) whose owner process is certainly gone
    (``stare_sandbox.owner.owner_gone``), e.g. after the owner was killed with SIGKILL and could not
    clean up. Returns how many."""
    client = client or docker_client()
    removed = 0
    # The list endpoint's own fields (labels, mounts), no inspection per container: other owners
    # create and remove their containers meanwhile, and one gone between the list and its
    # inspection would fail this whole start.
    for entry in client.api.containers(all=True, filters={"label": OWNER_LABEL}):
        if not owner_gone((entry.get("Labels") or {}).get(OWNER_LABEL, "")):
            continue  # another host's, or its owner is alive
        dirs = [m["Source"] for m in entry.get("Mounts") or [] if m.get("Destination") == CONN_DIR]
        try:
            client.api.remove_container(entry["Id"], force=True)
        except Exception as exc:  # noqa: BLE001 - already gone or being removed: nothing to do
            logger.debug("could not remove orphan %s: %s", entry["Id"][:12], exc)
            continue
        for path in dirs:
            remove_sandbox_dir(path)  # only the project's own temp dirs, whatever the mount says
        removed += 1
    if removed:
        logger.warning(
            "removed %d sandbox container(s) left behind by processes that no longer exist", removed
        )
    return removed


_reaped = False


def _connection_info() -> dict[str, Any]:
    """A new kernel's connection info, with container paths."""
    return {
        "transport": "ipc",
        "ip": f"{CONN_DIR}/k",
        "shell_port": 1,
        "iopub_port": 2,
        "stdin_port": 3,
        "control_port": 4,
        "hb_port": 5,
        "key": uuid.uuid4().hex,
        "signature_scheme": "hmac-sha256",
        "kernel_name": "python3",
    }


def _identity_files(uid: int, gid: int) -> dict[str, str]:
    """``/etc/passwd`` and ``/etc/group`` of a container whose kernel runs as ``uid:gid``, so that
    ``getpass.getuser()``, ``pwd`` and ``id`` name it ("sandbox", home ``/work``) whichever uid it got."""
    return {
        "passwd": (
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"sandbox:x:{uid}:{gid}:sandbox:{WORK_DIR}:/usr/sbin/nologin\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ),
        "group": f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n",
    }


def _write_connection_file(conn_dir: Path, info: dict[str, Any], group: int) -> None:
    """(Re)write ``kernel.json``, readable by the owner and ``group`` only. The kernel rewrites
    it as its own at start, so the old file is removed first."""
    path = conn_dir / "kernel.json"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info))
    os.chown(path, -1, group)
    path.chmod(0o640)


class _ContainerKernel:
    """The container as a ``KernelHost``: the warden (PID 1) forwards SIGINT; a restart replaces
    the kernel. ``session`` (the driver's, once it exists) follows each new connection key."""

    def __init__(
        self, container: Any, memory_mb: int, conn_dir: Path, info: dict[str, Any], group: int
    ) -> None:
        self.container = container
        self.memory_mb = memory_mb
        self.conn_dir, self.info, self.group = conn_dir, info, group
        self.session: Any = None
        # The cgroup path survives restarts (the counters start again), so it is looked up once,
        # through the host pid of the container's init (``containers.run`` returns the container
        # as created, without it).
        container.reload()
        pid = container.attrs.get("State", {}).get("Pid") or 0
        self.usage = CgroupUsage(pid) if pid > 0 else None
        self.init_pid = pid
        self._init_fd: int | None = None
        self._track_init(pid)
        cgroup = cgroup_dir(pid, "pids") if pid > 0 else None
        self.procs_file = cgroup / "cgroup.procs" if cgroup is not None else None

    def _track_init(self, pid: int) -> None:
        """Hold a pidfd of the container's PID 1 (the warden), so liveness is a poll, not an API
        call, and signals reach it without one."""
        if self._init_fd is not None:
            os.close(self._init_fd)
            self._init_fd = None
        self.init_pid = pid
        if pid > 0:
            try:
                self._init_fd = os.pidfd_open(pid)
            except OSError:  # not visible from here (e.g. a remote daemon): ask the API instead
                pass

    def renew(self, timeout_s: float = RENEW_TIMEOUT_S) -> bool:
        """Ask the warden for a fresh kernel and wait until it has forked one.

        SIGUSR1: the warden kills every other process, wipes the scratch dirs and IPC and checks
        itself. Once every process of the episode is gone and the warden is alone in the
        container's cgroup, a new connection key goes into the connection dir (no process of the
        episode can have read it), the dir is opened (``ready`` locks it before any code runs) and
        SIGUSR2 tells the warden to bind fresh listeners and fork the next kernel with the key.

        False when that cannot be confirmed from here (no cgroup to read, a PID 1 that is traced
        or dumpable, a warden that does not act in time): the caller then restarts the container.
        """
        if self.procs_file is None:
            return False
        deadline = time.monotonic() + timeout_s
        before = _pids(self.procs_file)
        if self.init_pid not in before:  # restarted since: PID 1 has a new host pid
            self.container.reload()
            self._track_init(self.container.attrs.get("State", {}).get("Pid") or 0)
        if self.init_pid not in before or not _untouched(self.init_pid):
            return False
        doomed = {pid: _pidfd(pid) for pid in before - {self.init_pid}}
        if not self._signal(signal.SIGUSR1) or not _wait_gone(doomed, self.procs_file, deadline):
            return False
        if not self._wait(lambda pids: pids == {self.init_pid}, deadline):
            return False
        self.new_key()
        self.conn_dir.chmod(CONN_OPEN)
        if not self._signal(signal.SIGUSR2):
            return False
        return self._wait(lambda pids: self.init_pid in pids and len(pids) > 1, deadline)

    def new_key(self) -> None:
        """A fresh connection key in ``kernel.json`` (read by the warden for the next kernel) and
        in the driver's session."""
        self.info["key"] = uuid.uuid4().hex
        _write_connection_file(self.conn_dir, self.info, self.group)
        if self.session is not None:
            self.session.key = self.info["key"].encode()

    def _signal(self, signum: int) -> bool:
        """Send ``signum`` to the warden: through its pidfd, else through the daemon."""
        if self._init_fd is not None:
            try:
                signal.pidfd_send_signal(self._init_fd, signum)
                return True
            except OSError:  # not our process to signal (a non-root host)
                pass
        try:
            self.container.kill(signal=signum)
            return True
        except Exception as exc:  # noqa: BLE001 - the caller restarts the container
            logger.debug("signalling the warden failed: %s", exc)
            return False

    def _wait(self, done: Any, deadline: float) -> bool:
        """Poll the container's cgroup until ``done(pids)``; False at the deadline or when the
        warden exited (it found something it could not wipe)."""
        while not done(_pids(self.procs_file) if self.procs_file is not None else set()):
            if time.monotonic() > deadline or not self.is_alive():
                return False
            time.sleep(0.001)
        return True

    def meter(self) -> CgroupUsage | None:
        return self.usage

    def interrupt(self) -> None:
        self._signal(signal.SIGINT)  # a container that just died cannot be interrupted: no matter

    def restart(self) -> None:
        """A fresh kernel from the warden when it answers (milliseconds; e.g. after a kernel stuck
        in C code), else a restarted container (the kernel died, so the warden has exited)."""
        if self.is_alive() and self.renew(timeout_s=RESTART_RENEW_TIMEOUT_S):
            return
        self.restart_container()

    def restart_container(self) -> None:
        """Stop the container and start it again: new tmpfs mounts, a new warden, a new kernel."""
        self.container.stop(timeout=0)  # waits until every process of the container is gone
        if self.usage is not None:
            self.usage.forget()
        self.new_key()
        self.conn_dir.chmod(CONN_OPEN)
        self.container.start()

    def ready(self) -> None:
        self.conn_dir.chmod(CONN_LOCKED)
        # The kernel rewrote kernel.json as its own at start: it could still write to it (filling
        # the host's disk). The host keeps the connection info in memory and rewrites the file
        # for the next restart; the sockets, the only other entries, cannot be written to.
        (self.conn_dir / "kernel.json").unlink(missing_ok=True)

    def is_alive(self) -> bool:
        if self._init_fd is not None and not select.select([self._init_fd], [], [], 0)[0]:
            return True  # the warden, the container's PID 1, has not exited (a pidfd polls readable then)
        try:
            self.container.reload()
        except Exception:  # noqa: BLE001 - gone means dead
            return False
        running = self.container.status == "running"
        if running:  # restarted since the pidfd was taken
            self._track_init(self.container.attrs.get("State", {}).get("Pid") or 0)
        return running

    def close(self) -> None:
        if self._init_fd is not None:
            os.close(self._init_fd)
            self._init_fd = None

    def death_cause(self) -> str:
        ended = self._ended()
        if ended is None or _being_removed(ended[0]):
            return "container removed"
        state, said = ended
        if state.get("OOMKilled"):
            return f"killed for using more than the {self.memory_mb} MB memory limit"
        code = state.get("ExitCode")
        cause = f"exit code {code}" + (
            f" (signal {code - 128})" if isinstance(code, int) and code > 128 else ""
        )
        # the warden logs why it exited (e.g. a module sandbox.preload names is missing); a kernel
        # whose boot failed logs that before the warden logs its exit (only a boot can: the kernel
        # closes the log before it serves)
        said = [line for line in said if line.startswith(BOOT_FAILED)] or said
        return f"{cause}; warden: {said[-1]}" if said else cause

    def killed_from_outside(self) -> bool:
        """True only on evidence that the container ended from outside, not by its code: it is gone
        (or the daemon does not answer), or it stopped neither for its memory limit nor because its
        kernel exited (the warden logs that first: ``warden.KERNEL_EXITED``), and either the warden
        obeyed a SIGTERM from outside (``docker stop``, a daemon shutting down: it logs
        ``warden.STOPPED_FROM_OUTSIDE``) or it was killed by SIGKILL (exit code 137), which code in
        the container cannot send its PID 1 (``docker kill``, ``docker rm -f``, the node's OOM
        killer).

        Code in the sandbox cannot fake either: only the warden writes the container's log, and
        every way the code can end its container (exiting or killing its kernel, using up the memory
        limit) passes through a kernel that exited or through Docker's ``OOMKilled``. An end that
        cannot be read (a log or start time the daemon does not give) counts as the code's, as does
        a kill by the node's OOM killer that Docker reports as ``OOMKilled`` (a kernel it took is a
        kernel that exited).
        """
        ended = self._ended()
        if ended is None or _being_removed(ended[0]):
            return True  # removed, or no daemon: nothing in the sandbox does either
        state, said = ended
        if state.get("Running") or state.get("OOMKilled") or not _timestamp(state.get("StartedAt", "")):
            return False
        if any(line.startswith(KERNEL_EXITED) for line in said):
            return False
        return STOPPED_FROM_OUTSIDE in said or state.get("ExitCode") == 128 + signal.SIGKILL

    def _ended(self) -> tuple[dict[str, Any], list[str]] | None:
        """The container's ``State`` and the lines the warden logged since it last started (without
        their ``warden: `` prefix; the last 5 when the start time is unknown); None when the
        container or the daemon is gone."""
        try:
            self.container.reload()
        except Exception:  # noqa: BLE001 - gone means gone
            return None
        state = self.container.attrs.get("State", {})
        since = _timestamp(state.get("StartedAt", ""))
        try:  # this run's lines only: an earlier run's kernel may have exited before a restart
            text = self.container.logs(
                stdout=False, stderr=True, **({"since": since} if since else {"tail": 5})
            )
        except Exception:  # noqa: BLE001 - the cause is still the exit code
            text = b""
        lines = text.decode(errors="replace").splitlines()
        return state, [line.removeprefix("warden: ") for line in lines if line.startswith("warden: ")]


def _being_removed(state: dict[str, Any]) -> bool:
    """Whether a container's ``State`` is that of one being removed: ``docker rm -f`` marks it
    ``removing`` before it kills it, so between the kill and the removal it reads as exited with
    code 137; ``dead`` is one whose removal failed half way."""
    return state.get("Status") in ("removing", "dead") or bool(state.get("Dead"))


def _timestamp(rfc3339: str) -> float | None:
    """Seconds since the epoch of a time as Docker writes it (``2026-12-01T10:00:00.123456789Z``, UTC);
    None when there is none (Docker's zero time) or it cannot be read.

    >>> _timestamp("2026-12-01T10:00:00.5Z") - _timestamp("2026-12-01T10:00:00Z")
    0.5
    """
    whole, _, rest = rfc3339.partition(".")
    try:
        seconds = datetime.datetime.strptime(whole.removesuffix("Z"), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None
    fraction = float(f"0.{rest.removesuffix('Z')}") if rest.removesuffix("Z").isdigit() else 0.0
    value = seconds.replace(tzinfo=datetime.timezone.utc).timestamp() + fraction
    return value if value > 0 else None


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it has exited), or None when it is gone already or
    cannot be had here (then its cgroup is read instead)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _wait_gone(doomed: dict[int, int | None], procs_file: Path, deadline: float) -> bool:
    """Wait until no process of ``doomed`` ({pid: pidfd or None}) is left in the cgroup whose
    ``cgroup.procs`` is ``procs_file``; False at the deadline. Closes the pidfds.

    A pidfd polls readable once its process has exited, which is after it left its cgroup, so the
    wait sleeps in ``poll`` instead of reading the cgroup every millisecond; the cgroup is read
    once to confirm (and every millisecond for a process without a pidfd)."""
    fds = [fd for fd in doomed.values() if fd is not None]
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        pending = len(fds)
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(1, min(50, int((deadline - time.monotonic()) * 1000)))):
                poller.unregister(fd)
                pending -= 1
        while _pids(procs_file) & doomed.keys():  # at once when every pidfd said so
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def _pids(procs_file: Path) -> set[int]:
    """Host pids of the processes in a cgroup (empty when it cannot be read)."""
    try:
        return {int(line) for line in procs_file.read_text().split()}
    except (OSError, ValueError):
        return set()


def _untouched(pid: int) -> bool:
    """True while the container's PID 1 (host pid ``pid``) is untraced and non-dumpable (the
    files of its ``/proc`` dir are then root's, though it runs as the sandbox's uid)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        owner = os.stat(f"/proc/{pid}/environ").st_uid
    except OSError:
        return False
    return "\nTracerPid:\t0\n" in status and owner == 0


class DockerSandbox(KernelSandbox):
    """A hardened container running an IPython kernel (see the module docstring).

    Args:
        config: Limits and image.
        start_timeout: Seconds to wait for a new kernel to answer.

    Raises:
        SandboxUnavailable: no daemon or no image (the message says how to fix it).
        SandboxError: the container starts but its kernel does not answer.
    """

    backend = "docker"

    def __init__(self, config: SandboxConfig | None = None, *, start_timeout: float = 60.0) -> None:
        super().__init__(config)
        self.start_timeout = start_timeout
        self._closed = True  # nothing to close until the temp dir exists
        self.container: Any = None
        self._uid: UidClaim | None = None
        self._driver: KernelDriver | None = None
        self._host: _ContainerKernel | None = None
        exit_on_sigterm()
        self._client = docker_client()
        global _reaped
        if not _reaped:  # once per process: containers of killed owners hold memory and pids
            _reaped = True
            reap_orphans(self._client)
        # Short path under /tmp: unix socket paths must stay under ~100 characters.
        self.dir = Path(tempfile.mkdtemp(prefix="stare-", dir="/tmp"))
        self._closed = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import docker.errors  # type: ignore[import-untyped]

        # Root reaches any socket; the kernel's gid then suffices. A user reaches the sockets
        # through its own group, which the kernel is given.
        if self.config.user is None:
            self._uid = claim_uid()
            uid = gid = str(self._uid.uid)
        else:
            uid, _, gid = self.config.user.partition(":")
            gid = gid or uid
        root = os.geteuid() == 0
        if not root and int(uid) == os.geteuid():
            raise SandboxUnavailable(
                f"sandbox.user {self.config.user} has this host user's uid {uid}: the kernel would own "
                "its connection dir and could unlock it; leave sandbox.user unset (a uid of its own)"
            )
        if self.config.network != "none":
            logger.warning(
                "sandbox network is %r, not 'none': code in the sandbox can reach the network",
                self.config.network,
            )
        group = int(gid) if root else os.getegid()
        os.chown(self.dir, -1, group)
        self.dir.chmod(CONN_OPEN)
        info = _connection_info()
        _write_connection_file(self.dir, info, group)
        meminfo = self.dir / "meminfo"
        meminfo.write_text(MEMINFO.format(kb=self.config.memory_mb * 1024))
        meminfo.chmod(0o444)
        for name, text in _identity_files(int(uid), int(gid)).items():
            (self.dir / name).write_text(text)
            (self.dir / name).chmod(0o444)
        options = container_options(self.config, self.dir, f"{uid}:{gid}", None if root else group)
        # create + start, not containers.run: run pulls from a registry when the image is missing.
        # A container whose start fails is removed by close().
        try:
            self.container = create_container(self._client, self.config.image, options)
            self.container.start()
        except docker.errors.ImageNotFound as exc:
            raise SandboxUnavailable(
                f"sandbox image {self.config.image} not found: run `stare-agent sandbox build`"
            ) from exc
        except docker.errors.APIError as exc:
            raise SandboxError(
                f"could not start a sandbox container ({exc.explanation or exc}): run `stare-agent sandbox doctor`"
            ) from exc
        host = self._host = _ContainerKernel(self.container, self.config.memory_mb, self.dir, info, group)
        self._driver = KernelDriver(
            {**info, "ip": str(self.dir / "k")},
            host,
            max_output_chars=self.config.max_output_chars,
            restart_grace_s=self.config.restart_grace_s,
            warm_tracebacks=False,  # the warden did, once for all its kernels
            boot_in_kernel=True,  # each kernel runs KERNEL_BOOT before it serves (warden.run_boot)
        )
        host.session = self._driver.client.session  # each new kernel's key reaches it
        self._driver.wait_ready(self.start_timeout)

    def reset(self, *, hard: bool = False) -> None:
        """Forget all state, whatever the code of the episode did to its interpreter.

        Default: a fresh kernel process from the warden, after every process of the episode was
        killed and ``/work``, ``/tmp``, ``/dev/shm``, ``/dev/mqueue`` and SysV IPC were emptied
        (see ``sandbox/warden.py``; tens of milliseconds). ``hard``, or when the warden's reset
        cannot be confirmed: restart the container (fresh tmpfs mounts; about a second).
        """
        driver = self._live_driver()
        if not hard and driver.ready and self._host is not None and self._host.renew():
            driver.expect_new_kernel()
            try:
                driver.wait_ready(self.start_timeout)
                return
            except SandboxError as exc:  # e.g. the warden found something it could not wipe
                logger.warning("fresh kernel did not start (%s); restarting the container", exc)
        if self._host is None:
            driver.restart()
        else:
            driver.expect_new_kernel()
            self._host.restart_container()
        driver.wait_ready(self.start_timeout)

    def is_alive(self) -> bool:
        return not self._closed and self._driver is not None and self._driver.host.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._driver is not None:
            self._driver.close()
        if self._host is not None:
            self._host.close()
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception as exc:  # noqa: BLE001 - already gone is fine; anything else is logged
                if getattr(getattr(exc, "response", None), "status_code", None) != 404:
                    logger.warning("could not remove sandbox container %s: %s", self.container.short_id, exc)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._uid is not None:  # after the container: none of its processes is left
            self._uid.release()
        if getattr(self, "_client", None) is not None:
            self._client.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
