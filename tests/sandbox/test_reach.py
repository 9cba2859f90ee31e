"""Nothing in a Docker sandbox that outlives an episode is within the reach of its code.

Each test is an attack by model-written code on something the container keeps across episodes:
its PID 1 (which starts every kernel), the listening sockets the host reaches kernels through,
the scratch roots, the container's log, syscalls a notebook never makes, the host's identity.
Where two episodes are involved, a pool of one makes the second lease the same container.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from stare_sandbox import DockerSandbox, SandboxConfig, SandboxPool
from tests.conftest import host_problem, require
from tests.sandbox.helpers import next_episode, two_episodes

pytestmark = pytest.mark.docker

CONFIG = SandboxConfig(timeout_s=20)


@pytest.fixture(scope="module")
def pool(docker_ready) -> Iterator[SandboxPool]:
    with SandboxPool(1, backend="docker", config=CONFIG) as pool:
        yield pool


@pytest.fixture(scope="module")
def sb(docker_ready) -> Iterator[DockerSandbox]:
    with DockerSandbox(CONFIG) as sandbox:
        yield sandbox


def test_pid_1_can_be_neither_read_written_nor_traced(sb: DockerSandbox) -> None:
    # PID 1 starts every kernel: its memory would be a mailbox across episodes, and code injected
    # there would outlive the episode.
    probe = """
import ctypes, errno, json
out = {}
for name, mode in (("mem", "r+b"), ("environ", "rb"), ("fd/1", "wb"), ("fd/2", "wb")):
    try:
        with open(f"/proc/1/{name}", mode, buffering=0) as f:
            f.read(1) if "r" in mode else f.write(b"x")
        out[name] = "open"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
libc = ctypes.CDLL(None, use_errno=True)
out["ptrace attach"] = (libc.ptrace(16, 1, None, None), errno.errorcode.get(ctypes.get_errno()))
print(json.dumps(out, sort_keys=True))
"""
    result = sb.run(probe)
    assert json.loads(result.stdout) == {
        "environ": "EACCES",
        "fd/1": "EACCES",
        "fd/2": "EACCES",
        "mem": "EACCES",
        "ptrace attach": [-1, "EPERM"],
    }, result


def test_signals_from_the_sandbox_do_not_reach_pid_1(sb: DockerSandbox) -> None:
    # Stopping PID 1 would leave later kernels without the host's interrupt; terminating it
    # would end the episode's kernel as if it had crashed.
    assert sb.run("kept = 42").ok
    sent = sb.run(
        "import fcntl, os, signal, time\n"
        "for s in (signal.SIGSTOP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT):\n"
        "    os.kill(1, s)\n"
        # a signal the kernel sends on the sandbox's behalf: I/O on a pipe whose owner is PID 1
        "r, w = os.pipe()\n"
        "fcntl.fcntl(r, 8, 1)\n"  # F_SETOWN: PID 1
        "fcntl.fcntl(r, 10, signal.SIGTERM)\n"  # F_SETSIG
        "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)\n"
        "os.write(w, b'x')\n"
        "time.sleep(0.3)\n"
        "print('sent')"
    )
    assert sent.stdout == "sent\n", sent
    assert sb.run("kept").stdout == "42\n"  # the kernel and its state are untouched
    assert sb.run("import time\ntime.sleep(5)", timeout=0.5).timed_out  # the interrupt still arrives
    assert sb.run("kept").stdout == "42\n"
    sb.reset()
    assert sb.run("'kept' in dir()").stdout == "False\n"


def test_listener_queues_carry_nothing_to_the_next_episode(pool: SandboxPool) -> None:
    # A connection left in a listener's queue would be accepted in the next episode: with a file
    # descriptor in it (SCM_RIGHTS), a mailbox, and a memfd's memory charged to the next episode.
    plant = """
import array, glob, os, socket
fd = os.memfd_create("mail")
os.write(fd, b"x" * (400 << 20))
listeners = [int(n) for n in os.listdir("/proc/self/fd") if n.isdigit()]
paths = set(glob.glob("/conn/*"))
for n in listeners:
    try:
        s = socket.socket(fileno=os.dup(n))
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            name = s.getsockname()
            if isinstance(name, str) and name:
                paths.add(name)
        s.detach()
    except OSError:
        pass
sent = 0
for path in sorted(paths):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect(path)
        c.sendmsg([b"MAIL"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        sent += 1
    except OSError:
        c.close()
os.close(fd)
print(sent)
"""
    probe = """
import os, select, socket
queued = []
for n in [int(n) for n in os.listdir("/proc/self/fd") if n.isdigit()]:
    try:
        s = socket.socket(fileno=os.dup(n))
    except OSError:
        continue
    try:
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and select.select([s], [], [], 0.1)[0]:
            queued.append(s.getsockname())
    except OSError:
        pass
    finally:
        s.close()
print(queued)
"""
    result = next_episode(pool, plant, probe)
    assert result.stdout == "[]\n"
    if result.peak_memory_bytes is not None:  # the memfd's 400 MB would be charged to this episode
        assert result.peak_memory_bytes < 300 * 2**20, result


def test_the_work_dir_root_keeps_no_metadata_of_the_last_episode(pool: SandboxPool) -> None:
    plant = """
import os
try:
    os.setxattr("/work", "user.mail", b"hello")
except OSError:
    pass
try:
    os.utime("/work", (1234567, 1234567))
except OSError:
    pass
os.utime("/tmp")
"""
    probe = """
import os
print(os.listxattr("/work"), int(os.stat("/work").st_mtime) != 1234567, oct(os.stat("/work").st_mode))
"""
    listed, moved, mode = two_episodes(pool, plant, probe).split(" ")
    assert (listed, moved) == ("[]", "True")
    assert mode.strip() == "0o41777"  # the kernel does not own the root it works in


def test_code_cannot_write_to_the_container_log(sb: DockerSandbox) -> None:
    # The container's log is written by dockerd, outside the sandbox's CPU quota and disk limit.
    mark = "STARE-LOG-FLOOD-MARK"
    code = f"""
import os, stat, sys
reached = []
for path in ("/proc/1/fd/1", "/proc/1/fd/2", "/proc/self/fd/1", "/proc/self/fd/2"):
    try:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b"{mark}\\n")
        os.close(fd)
    except OSError:
        pass
for n in [int(n) for n in os.listdir("/proc/self/fd") if n.isdigit()]:
    try:
        mode = os.fstat(n).st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
            os.write(n, b"{mark}\\n")
    except OSError:
        pass
sys.__stdout__.write("{mark}\\n"); sys.__stdout__.flush()
sys.__stderr__.write("{mark}\\n"); sys.__stderr__.flush()
print("done")
"""
    assert "done" in sb.run(code).stdout
    assert mark.encode() not in sb.container.logs(stdout=True, stderr=True)


SYSCALLS_X86_64 = {
    # name: (number, arguments that succeed, or fail otherwise than EPERM, where it is allowed)
    "ptrace": (101, (0, 0, 0, 0)),  # PTRACE_TRACEME
    "process_vm_readv": (310, ("pid", 0, 0, 0, 0, 0)),
    "process_vm_writev": (311, ("pid", 0, 0, 0, 0, 0)),
    "io_uring_setup": (425, (1, "params")),
    "io_uring_enter": (426, (-1, 0, 0, 0, 0, 0)),
    "io_uring_register": (427, (-1, 0, 0, 0)),
    "bpf": (321, (0, 0, 0)),
    "perf_event_open": (298, (0, 0, -1, -1, 0)),
    "userfaultfd": (323, (0,)),
    "keyctl": (250, (0, -3, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": (248, (0, 0, 0, 0, 0)),
    "request_key": (249, (0, 0, 0, 0)),
    "mount": (165, (0, 0, 0, 0, 0)),
    "unshare": (272, (0x10000000,)),  # CLONE_NEWUSER
    "setns": (308, (-1, 0)),
    "kcmp": (312, ("pid", "pid", 0, 0, 0)),
    "pidfd_getfd": (438, (-1, 0, 0)),
    "open_by_handle_at": (304, (-1, 0, 0)),
    "personality": (135, (0xFFFFFFFF,)),
    "syslog": (103, (10, 0, 0)),
    "chroot": (161, ("root",)),
    "process_madvise": (440, (-1, 0, 0, 0, 0)),
    # host-wide or per-uid pools every sandbox shares (issue 41 item 2)
    "io_setup": (206, (1, "params")),
    "inotify_init1": (294, (0,)),
    "mq_open": (240, ("root", 0x40 | 2, 0o600, 0)),
    # the scheduling, priorities and rlimits of PID 1, which every later kernel inherits (item 3)
    "sched_setattr pid 1": (314, (1, "params", 0)),
    "sched_setaffinity pid 1": (203, (1, 8, "params")),
    "setpriority pid 1": (141, (0, 1, 10)),
    "setpriority user": (141, (2, 0, 10)),
    "ioprio_set pid 1": (251, (1, 1, 0)),
    "prlimit64 pid 1": (302, (1, 7, "params", 0)),
    # huge pages: the host's reserved pool, outside the memory limit (the fourth pass's own attack)
    "mmap MAP_HUGETLB": (9, (0, 2**21, 3, 0x22 | 0x40000, -1, 0)),
    "memfd_create MFD_HUGETLB": (319, ("root", 4)),
    "shmget SHM_HUGETLB": (29, (0, 2**21, 0o1000 | 0x800)),
}


def test_syscalls_a_notebook_never_makes_are_refused(sb: DockerSandbox) -> None:
    require("host", host_problem())  # x86_64 syscall numbers
    code = f"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)
root = ctypes.c_char_p(b"/")
out = {{}}
for name, (number, args) in {SYSCALLS_X86_64!r}.items():
    values = [os.getpid() if a == "pid" else ctypes.addressof(params) if a == "params" else root if a == "root"
              else ctypes.c_long(a) for a in args]
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(number), *values)
    out[name] = errno.errorcode.get(ctypes.get_errno(), ret) if ret == -1 else ret
for family in (38, 40):  # AF_ALG (the kernel's crypto API), AF_VSOCK
    try:
        socket.socket(family, socket.SOCK_SEQPACKET).close()
        out[f"socket {{family}}"] = "open"
    except OSError as exc:
        out[f"socket {{family}}"] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""
    result = sb.run(code)
    assert result.ok, result
    refused = json.loads(result.stdout)
    assert {name: got for name, got in refused.items() if got != "EPERM"} == {}


IA32_SOCKETCALL = """
import ctypes, struct, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
page = libc.mmap(None, 4096, 7, 0x22 | 0x40, -1, 0)  # read, write, execute; MAP_32BIT
args = page + 2048
made = []
for family, kind in ((2, 1), (40, 5)):  # AF_INET stream, AF_VSOCK seqpacket
    # socketcall(SYS_SOCKET, args) through int 0x80: the 32-bit ABI's multiplexer, whose
    # arguments lie in memory where no seccomp rule reads them
    code = b"\\x53\\xb8\\x66\\0\\0\\0\\xbb\\x01\\0\\0\\0\\xb9" + struct.pack("<I", args) + b"\\xcd\\x80\\x5b\\xc3"
    ctypes.memmove(page, code, len(code))
    ctypes.memmove(args, struct.pack("<III", family, kind, 0), 12)
    out = []
    caller = threading.Thread(target=lambda: out.append(ctypes.CFUNCTYPE(ctypes.c_int)(page)()), daemon=True)
    caller.start()
    caller.join(5)
    made.append(out[0] if out else "no return")
print(made)
"""


def test_the_32_bit_abi_reaches_no_socket_family_the_filter_refuses(sb: DockerSandbox) -> None:
    # The compat ABI's socketcall and ipc pass their arguments in memory: a filter that allowed it
    # would let any family through (an IPv4 and an AF_VSOCK socket were made without a network).
    require("host", host_problem())  # x86-64 machine code
    result = sb.run(IA32_SOCKETCALL)
    assert result.ok, result
    made = eval(result.stdout)  # noqa: S307 - a list of ints and strings this test printed
    assert all(got == "no return" or got < 0 for got in made), made
    assert sb.run("1 + 1").stdout == "2\n"  # only the calling thread is gone


def test_what_a_notebook_does_still_works_under_the_syscall_filter(sb: DockerSandbox) -> None:
    code = """
import multiprocessing, subprocess, threading, os, socket, tempfile, mmap
import numpy, sympy, scipy.linalg
x = sympy.Symbol("x")
assert sympy.integrate(x**2, (x, 0, 3)) == 9
assert abs(numpy.linalg.det(scipy.linalg.hilbert(3)) - 1 / 2160) < 1e-9
with multiprocessing.Pool(2) as p:
    assert p.map(abs, [-1, -2]) == [1, 2]
assert subprocess.run(["python3", "-c", "print(7)"], capture_output=True, text=True).stdout == "7\\n"
t = threading.Thread(target=lambda: None); t.start(); t.join()
a, b = socket.socketpair(); a.send(b"x"); assert b.recv(1) == b"x"
with tempfile.TemporaryFile() as f:
    f.write(b"y" * 4096); f.flush(); assert mmap.mmap(f.fileno(), 4096)[:1] == b"y"
os.mkfifo("/work/fifo"); os.sched_getaffinity(0); os.nice(0)
os.close(os.memfd_create("m")); mmap.mmap(-1, 2**21)[0] = 1
print("ok")
"""
    result = sb.run(code, timeout=60)
    assert result.stdout == "ok\n", result


def test_the_hosts_boot_id_and_the_containers_cgroups_are_not_readable(sb: DockerSandbox) -> None:
    # The cgroups' counters (CPU time used, peak memory, failures) outlive an episode, and code
    # could set them for the next one to read; the host reads them from its own side.
    result = sb.run(
        "import os\nprint(repr(open('/proc/sys/kernel/random/boot_id').read()), os.listdir('/sys/fs/cgroup'))"
    )
    assert result.stdout == "'' []\n", result


def test_host_counters_and_pseudo_terminals_are_not_the_sandboxs_to_read_or_take(sb: DockerSandbox) -> None:
    """Host-wide counters read as empty, /proc/meminfo says the container's own limit, and no pty can be
    made (the host's count is global): issue 41 items 2 and 8."""
    code = """
import os
counters = ["loadavg", "stat", "uptime", "vmstat", "diskstats", "swaps", "interrupts", "softirqs"]
print([open(f"/proc/{name}").read() for name in counters],
      os.path.exists("/proc/sys/fs/file-nr"), os.path.exists("/proc/sys/fs/aio-nr"),
      os.path.exists("/proc/sys/kernel/pty/nr"), os.listdir("/proc/pressure") if os.path.isdir("/proc/pressure") else None)
print(open("/proc/meminfo").read().split()[:3])
try:
    os.openpty()
    print("pty")
except OSError as exc:
    print(exc.strerror)
"""
    lines = sb.run(code).stdout.splitlines()
    assert lines[0] == "['', '', '', '', '', '', '', ''] False False False []", lines
    assert lines[1] == f"['MemTotal:', '{sb.config.memory_mb * 1024}', 'kB']"
    assert lines[2] == "No such file or directory"


def test_the_loopback_keeps_nothing_of_the_last_episode(pool: SandboxPool) -> None:
    # Without a network there is nothing to reach but the container's own loopback, whose state
    # outlives the episode: connections in TIME_WAIT, the interface's and the TCP stack's counters.
    plant = """
import socket
try:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    for _ in range(3):
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        client.sendall(b"x" * 1000)
        accepted.recv(1000)
        client.close()  # the side that closes first waits in TIME_WAIT for a minute
        accepted.close()
except PermissionError:
    pass
"""
    probe = """
tcp = open("/proc/net/tcp").read().splitlines()[1:]
lo = [line.split() for line in open("/proc/net/dev") if line.strip().startswith("lo:")][0]
print(len(tcp), lo[1], lo[9])
"""
    assert two_episodes(pool, plant, probe) == "0 0 0\n"


def test_every_kernel_gets_a_connection_key_of_its_own(sb: DockerSandbox) -> None:
    read_key = "import json\nprint(json.load(open('/tmp/.kernel.json'))['key'])"
    first = sb.run(read_key).stdout.strip()
    sb.reset()
    second = sb.run(read_key).stdout.strip()
    assert first and second and first != second
