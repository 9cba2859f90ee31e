"""Hostile code on the Docker backend: each attack is contained, comes back as a clear ExecResult,
and leaves the host and a second sandbox unaffected. Never aims at any non-loopback address."""

from __future__ import annotations

import os
import shutil
import socket
import time

import pytest

from stare_sandbox import DockerSandbox, SandboxConfig

pytestmark = pytest.mark.docker

SECRET = "STARE_HOSTILE_TEST_SECRET"
CONFIG = SandboxConfig(memory_mb=512, tmpfs_mb=64, pids_limit=64, max_output_chars=2000)


@pytest.fixture(scope="module")
def pair(docker_ready):
    """(attacked sandbox, bystander sandbox); the host's secret is set before they start."""
    os.environ[SECRET] = "hunter2"
    try:
        with DockerSandbox(CONFIG) as attacked, DockerSandbox(CONFIG) as bystander:
            bystander.run("canary = 7")
            yield attacked, bystander
    finally:
        del os.environ[SECRET]


@pytest.fixture
def sb(pair):
    attacked, bystander = pair
    yield attacked
    assert bystander.run("canary").stdout == "7\n", "the second sandbox was affected"
    assert attacked.run("6 * 7").stdout == "42\n", "the attacked sandbox did not recover"


def test_network_only_loopback_and_host_listener_unreachable(sb: DockerSandbox) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        assert sb.run("import os\nsorted(os.listdir('/sys/class/net'))").stdout == "['lo']\n"
        # Without a network the seccomp profile refuses IPv4/IPv6 sockets altogether
        # (sandbox/seccomp.py: the loopback's state would outlive the episode).
        result = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.error.type == "PermissionError"
        with pytest.raises(BlockingIOError):
            listener.accept()
    # A refused connection alone only rules out the host's own loopback (network=host); the
    # namespace itself must be another one than the host's (and than any other container's).
    inside = sb.run("import os\nos.readlink('/proc/self/ns/net')").stdout.strip().strip("'")
    sb.container.reload()
    kernel_side = os.readlink(f"/proc/{sb.container.attrs['State']['Pid']}/ns/net")
    assert inside.startswith("net:[") and inside == kernel_side != os.readlink("/proc/self/ns/net")


def test_fork_bomb_stops_at_pids_limit(sb: DockerSandbox) -> None:
    code = (
        "import os, time\nn = 0\ntry:\n    for _ in range(10000):\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print('blocked', type(e).__name__)\nn"
    )
    result = sb.run(code, timeout=20)
    assert result.stdout.startswith("blocked") and int(result.stdout.split()[-1]) < CONFIG.pids_limit
    sb.reset()
    # the warden (PID 1) and the kernel
    assert sb.run("import os\nsum(p.isdigit() for p in os.listdir('/proc'))").stdout == "2\n"


def test_memory_bomb_is_killed_and_reported(sb: DockerSandbox) -> None:
    result = sb.run("b = bytearray(2 * 1024**3)")
    assert result.error.type in ("KernelDied", "MemoryError") and result.state_lost == (
        result.error.type == "KernelDied"
    )
    if result.error.type == "KernelDied":
        assert "512 MB memory limit" in result.error.message


def test_disk_fill_hits_tmpfs_limit_not_host(sb: DockerSandbox) -> None:
    free_before = shutil.disk_usage("/tmp").free
    code = (
        "n = 0\ntry:\n    with open('/work/fill', 'wb') as f:\n        while True:\n"
        "            f.write(b'x' * 2**20); f.flush(); n += 1\nexcept OSError as e:\n    print(e.errno, n)"
    )
    result = sb.run(code, timeout=20)
    assert result.ok, result
    errno_, megabytes = map(int, result.stdout.split())
    assert errno_ in (27, 28) and megabytes <= CONFIG.tmpfs_mb  # EFBIG (RLIMIT_FSIZE) or ENOSPC
    assert free_before - shutil.disk_usage("/tmp").free < 32 * 2**20
    sb.reset()


def test_huge_output_is_capped(sb: DockerSandbox) -> None:
    result = sb.run("print('x' * 10**7)\nimport sys\nsys.stderr.write('y' * 10**6)")
    assert result.truncated and len(result.stdout) < 2100 and len(result.stderr) < 2100
    assert "characters truncated" in result.stdout


def test_host_files_and_environment_are_invisible(sb: DockerSandbox, tmp_path) -> None:
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text("top secret")
    result = sb.run(f"open({str(secret_file)!r}).read()")
    assert result.error.type == "FileNotFoundError"
    assert sb.run(f"import os\nprint(os.environ.get({SECRET!r}))").stdout == "None\n"


def test_writing_outside_work_dir_fails(sb: DockerSandbox) -> None:
    for path in ("/etc/evil", "/usr/lib/python3/evil.py", "/evil"):
        result = sb.run(f"open({path!r}, 'w').write('x')")
        assert result.error.type in ("OSError", "PermissionError"), path
        assert "Read-only file system" in result.error.message or "Permission denied" in result.error.message


WARDEN_SIGNALLED = (
    "import os, signal\nfor s in (signal.SIGTERM, signal.SIGKILL):\n    try:\n        os.kill(1, s)\n"
    "    except OSError:\n        pass\nos.kill(os.getpid(), signal.SIGKILL)"
)


@pytest.mark.parametrize(
    "code",
    [
        "import os; os.kill(os.getpid(), 9)",
        "import os; os._exit(1)",
        "import os; os._exit(0)",  # exit code 0, as `docker stop` gives
        "import os; os.killpg(0, 9)",  # its process group, the warden in it
        WARDEN_SIGNALLED,  # what `docker stop` and `docker kill` send, sent from inside, then a crash
    ],
)
def test_killing_the_kernel(sb: DockerSandbox, code: str) -> None:
    """However the code ends its kernel, it is the code's crash (a KernelDied result), never an end from
    outside (``SandboxKilled``, which would count against the infrastructure)."""
    result = sb.run(code)
    assert result.error.type == "KernelDied" and result.state_lost
    assert "warden: the kernel exited with status" in result.error.message


def test_ignoring_sigint_is_ended_by_restart(sb: DockerSandbox) -> None:
    start = time.monotonic()
    result = sb.run(
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass", timeout=1
    )
    assert time.monotonic() - start < 1 + 2 + 0.5
    assert result.timed_out and result.state_lost


def test_background_process_is_killed_on_reset(sb: DockerSandbox) -> None:
    sb.run("import subprocess\np = subprocess.Popen(['sleep', '1000'])")
    assert sb.run("p.poll() is None").stdout == "True\n"  # it outlives the call...
    sb.reset()  # ...but not the episode
    result = sb.run(
        "import os\n[open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()]"
    )
    assert r"sleep\x001000" not in result.stdout and "python3" in result.stdout


def test_connection_sockets_cannot_be_replaced(sb: DockerSandbox) -> None:
    # A symlink in place of a socket would send the host's (re)connection to a host socket.
    result = sb.run("import os\nos.unlink('/conn/k-1')\nos.symlink('/var/run/docker.sock', '/conn/k-1')")
    assert result.error.type == "PermissionError"
    assert sb.run("import os\nos.rename('/conn/k-2', '/conn/x')").error.type == "PermissionError"
    assert sb.run("open('/conn/k-9', 'w')").error.type == "PermissionError"
    assert sb.run("import os; os._exit(1)").error.type == "KernelDied"  # restart: unlock, start, lock
    assert sb.run("import os\nos.unlink('/conn/k-1')").error.type == "PermissionError"


def test_sleeping_past_the_timeout_is_interrupted(sb: DockerSandbox) -> None:
    sb.run("kept = 1")
    result = sb.run("import time\nprint('zz')\ntime.sleep(100)", timeout=1)
    assert result.timed_out and not result.state_lost and result.stdout == "zz\n"
    assert sb.run("kept").stdout == "1\n"


FLOOD = r"""
import os, stat, threading, time
def flood(delay):
    time.sleep(delay)  # 1 s: after this cell's reply, so that the next call finds the flood waiting
    frames = PATTERN * 32768
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.append(int(name))
        except OSError:  # listdir's own descriptor, closed by now
            pass
    while True:  # raw ZMTP frames into every connection of the kernel, shell and iopub alike
        for fd in fds:
            try:
                os.write(fd, frames)
            except OSError:
                pass
threading.Thread(target=flood, args=(DELAY,), daemon=True).start()
time.sleep(SLEEP)
"""


@pytest.mark.parametrize("pattern", [b"\x00\x00", b"\x01\x00"], ids=["empty-messages", "one-endless-message"])
def test_raw_frames_written_into_the_kernels_own_connections_cannot_hang_a_call(
    sb: DockerSandbox, pattern
) -> None:
    """Code writes zero-length ZMTP frames into its end of the host's connections (issue 41 item 1): a
    call that finds them waiting, and a call during which they come, each returns an ExecResult within
    its timeout, the kernel restarted for the protocol error, at a small cost of host CPU."""
    import resource

    def host_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    between = FLOOD.replace("PATTERN", repr(pattern)).replace("DELAY", "1.0").replace("SLEEP", "0")
    assert sb.run(between, timeout=5).error is None
    time.sleep(2)  # the flood is on, between two calls
    started, cpu = time.monotonic(), host_cpu()
    found = sb.run("6 * 7", timeout=5)
    assert time.monotonic() - started < 5 + sb.config.restart_grace_s, "the call did not come back"
    assert found.state_lost and found.error is not None and found.error.type == "KernelProtocolError"
    during = FLOOD.replace("PATTERN", repr(pattern)).replace("DELAY", "0.2").replace("SLEEP", "5")
    started = time.monotonic()
    hit = sb.run(during, timeout=10)
    assert time.monotonic() - started < 10, "the call waited out the flood"
    assert hit.state_lost and hit.error is not None and hit.error.type == "KernelProtocolError"
    assert host_cpu() - cpu < 2.0, "the flood cost the host more than 2 CPU seconds"
