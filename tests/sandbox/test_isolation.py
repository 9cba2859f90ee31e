"""One episode cannot reach the next on the same pooled Docker sandbox.

Each test plants something in one episode, gives the sandbox back (the pool's default reset runs)
and leases it again: the next episode must find a fresh interpreter and empty scratch space. A
pool of one makes the second lease the same container as the first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stare_sandbox import SandboxConfig, SandboxPool
from tests.sandbox.helpers import two_episodes

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def pool(docker_ready) -> Iterator[SandboxPool]:
    with SandboxPool(1, backend="docker", config=SandboxConfig(timeout_s=20)) as pool:
        yield pool


def test_running_threads_do_not_survive(pool):
    plant = """
import threading, time
def stowaway():
    while True:
        time.sleep(0.01)
threading.Thread(target=stowaway, name="stowaway", daemon=True).start()
"""
    probe = "import threading\nsorted(t.name for t in threading.enumerate() if t.name == 'stowaway')"
    assert two_episodes(pool, plant, probe) == "[]\n"


def test_monkeypatches_and_ipython_hooks_do_not_survive(pool):
    plant = """
import builtins, statistics
statistics.mean = lambda data: "poisoned"
builtins.pow = lambda *args: "poisoned"
ip = get_ipython()
ip.events.register("pre_run_cell", lambda *args: print("HOOKED"))
ip.input_transformers_post.append(lambda lines: ["answer = 'tampered'\\n", *lines])
"""
    probe = "import statistics\nprint(statistics.mean([1, 3]), pow(2, 3), 'answer' in dir())"
    assert two_episodes(pool, plant, probe) == "2 8 False\n"


def test_what_the_warden_prepared_for_every_kernel_is_pristine_in_the_next(pool):
    # The warden builds the shell, loads its extensions and warms tokenize, input transformers,
    # tracebacks and the kernel's message code once, and forks every kernel from that: an episode
    # changes only its own copy of them.
    plant = """
import tokenize, traceback
from jupyter_client import jsonutil
ip = get_ipython()
ip.magics_manager.magics["line"]["store"] = lambda line: print("poisoned store")
ip.extension_manager.loaded.add("planted")
tokenize.PseudoToken = "poisoned"
tokenize._compile.cache_clear()
jsonutil.extract_dates = lambda obj: "poisoned"
ip.InteractiveTB.structured_traceback = lambda *args, **kwargs: ["poisoned traceback"]
"""
    probe = """
import tokenize
from jupyter_client import jsonutil
ip = get_ipython()
print(ip.magics_manager.magics["line"]["store"].__self__.__class__.__name__,
      sorted(ip.extension_manager.loaded), tokenize.PseudoToken != "poisoned",
      jsonutil.extract_dates({"a": 1}), ip.InteractiveTB.structured_traceback.__name__)
"""
    out = two_episodes(pool, plant, probe)
    assert out == "StoreMagics ['IPython.extensions.storemagic'] True {'a': 1} structured_traceback\n"


def test_names_hidden_in_user_ns_hidden_do_not_survive(pool):
    plant = "secret = 'from the last episode'\nget_ipython().user_ns_hidden['secret'] = secret"
    assert two_episodes(pool, plant, "'secret' in dir()") == "False\n"


def test_interval_timers_do_not_survive(pool):
    plant = """
import signal
signal.signal(signal.SIGVTALRM, signal.SIG_IGN)
signal.signal(signal.SIGPROF, signal.SIG_IGN)
signal.setitimer(signal.ITIMER_VIRTUAL, 30, 30)
signal.setitimer(signal.ITIMER_PROF, 30, 30)
signal.setitimer(signal.ITIMER_REAL, 30, 30)
"""
    probe = "import signal\n[signal.getitimer(t) for t in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)]"
    assert two_episodes(pool, plant, probe) == "[(0.0, 0.0), (0.0, 0.0), (0.0, 0.0)]\n"


def test_lowered_rlimits_do_not_survive(pool):
    probe = "import resource\n[resource.getrlimit(getattr(resource, n)) for n in ('RLIMIT_NOFILE', 'RLIMIT_STACK', 'RLIMIT_NPROC', 'RLIMIT_AS')]"
    with pool.lease() as sb:
        fresh = sb.run(probe).stdout
    plant = """
import os, resource
for name, value in (("RLIMIT_NOFILE", 64), ("RLIMIT_STACK", 2**20), ("RLIMIT_NPROC", 3), ("RLIMIT_AS", 2**31)):
    resource.setrlimit(getattr(resource, name), (value, value))
    for pid in (os.getppid(), 1):  # the process that starts the next kernel, and init
        try:
            resource.prlimit(pid, getattr(resource, name), (value, value))
        except OSError:
            pass
"""
    assert two_episodes(pool, plant, probe) == fresh


def test_shared_memory_message_queues_and_sysv_ipc_do_not_survive(pool):
    """SysV IPC is the container's own namespace, emptied between episodes; POSIX message queues count
    against a quota of the uid every sandbox shares, so they are refused (EPERM) outright."""
    plant = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
open("/dev/shm/note", "w").write("from the last episode")
assert libc.shmget(0x5741, 4096, 0o1600) >= 0  # IPC_CREAT | 0600
assert libc.msgget(0x5742, 0o1600) >= 0
assert libc.semget(0x5743, 1, 0o1600) >= 0
rt = ctypes.CDLL("librt.so.1", use_errno=True)
assert rt.mq_open(b"/note", os.O_CREAT | os.O_RDWR, 0o600, None) == -1 and ctypes.get_errno() == 1
"""
    probe = """
import os
rows = {kind: open(f"/proc/sysvipc/{kind}").read().splitlines()[1:] for kind in ("shm", "msg", "sem")}
print(os.listdir("/dev/shm"), os.listdir("/dev/mqueue"), rows)
"""
    assert two_episodes(pool, plant, probe) == "[] [] {'shm': [], 'msg': [], 'sem': []}\n"


def test_files_under_the_ipython_dir_and_work_dirs_do_not_survive(pool):
    plant = """
import os
startup = os.path.join(get_ipython().profile_dir.location, "startup")
os.makedirs(startup, exist_ok=True)
open(os.path.join(startup, "00-evil.py"), "w").write("evil = 'planted'\\n")
open(os.path.join(get_ipython().profile_dir.location, "ipython_kernel_config.py"), "w").write("c.InteractiveShellApp.exec_lines = ['evil2 = 1']\\n")
open("/work/json.py", "w").write("dumps = lambda *a, **k: 'shadowed'\\n")
os.makedirs("/tmp/locked/deeper")
open("/tmp/locked/deeper/note", "w").write("hidden")
os.chmod("/tmp/locked", 0)
"""
    probe = """
import os, json
planted = [os.path.join(d, f) for top in ("/work", "/tmp") for d, _, files in os.walk(top) for f in files
           if f in ("00-evil.py", "ipython_kernel_config.py", "json.py", "note")]
print(planted, os.path.exists("/tmp/locked"), json.dumps(1), "evil" in dir(), "evil2" in dir())
"""
    assert two_episodes(pool, plant, probe) == "[] False 1 False False\n"


def test_background_processes_and_double_forks_do_not_survive(pool):
    plant = """
import subprocess, time
stowaway = "import ctypes, os, time\\nif os.fork():\\n    os._exit(0)\\nctypes.CDLL(None).prctl(15, b'stowaway', 0, 0, 0)\\ntime.sleep(600)"
subprocess.run(["setsid", "python3", "-c", stowaway], check=True)
time.sleep(0.3)
"""
    probe = """
import os
names = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        names.append(open(f"/proc/{pid}/comm").read().strip())
    except OSError:
        pass
print("stowaway" in names)
"""
    assert two_episodes(pool, plant, probe) == "False\n"


def test_the_process_that_starts_kernels_cannot_be_inspected_or_tampered_with(pool):
    """Code in the sandbox runs as the same uid as the process that starts the next kernel (the
    warden, PID 1): that process must refuse ptrace-class access (memory, environment) from it
    (tests/sandbox/test_reach.py attacks it further)."""
    probe = """
import os
ppid = os.getppid()
denied = []
for name in ("mem", "environ"):
    try:
        open(f"/proc/{ppid}/{name}", "rb").read(1)
    except OSError as exc:
        denied.append(type(exc).__name__)
print(ppid, denied)
"""
    with pool.lease() as sb:
        result = sb.run(probe)
    assert result.stdout == "1 ['PermissionError', 'PermissionError']\n", result


def test_pid_1s_scheduling_and_shared_descriptors_do_not_carry_into_the_next_episode(pool):
    """Every kernel forks from PID 1, the warden: its scheduling state (the EEVDF slice of sched_setattr,
    the I/O priority, nice, affinity) would pass to every later kernel, and a descriptor it held open
    (/dev/null, from importing IPython) was one open file description shared by all of them, whose
    F_SETSIG value and status flags carried bits across episodes (issue 41 item 3)."""
    probe = """
import ctypes, fcntl, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
attr = ctypes.create_string_buffer(56)  # struct sched_attr, version 1
libc.syscall(315, 0, attr, 56, 0)  # sched_getattr of this kernel
slice_ns = int.from_bytes(attr.raw[48:56], "little")
nulls = [fd for fd in map(int, os.listdir("/proc/self/fd"))
         if fd > 2 and os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"]
print(os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)), libc.syscall(252, 1, 0), slice_ns,
      [(fcntl.fcntl(fd, fcntl.F_GETSIG), fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK) for fd in nulls])
"""
    with pool.lease() as sb:
        fresh = sb.run(probe).stdout
    plant = """
import ctypes, fcntl, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
attr = struct.pack("<IIQiIQQQ", 56, 0, 0, 0, 0, 3_000_000, 0, 0)  # SCHED_OTHER, runtime = the slice
# What the warden's own reset check does not read (it restarts the container when nice, the
# scheduler, affinity or rlimits changed): the EEVDF slice and the I/O priority.
for pid in (1, 0):
    libc.syscall(314, pid, attr, 0)  # sched_setattr
    libc.syscall(251, 1, pid, (3 << 13) | 7)  # ioprio_set: idle class
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, 10)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    except OSError:
        pass
"""
    assert two_episodes(pool, plant, probe) == fresh
