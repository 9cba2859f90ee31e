"""The local backend and the shared kernel driver, on a real local kernel: what only the local backend
does; the contract it shares with the Docker backend is checked in test_backends.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stare_sandbox import LocalSandbox, SandboxClosed, SandboxConfig, SandboxError, make_sandbox
from stare_sandbox.config import PRELOAD_MATH
from stare_sandbox.output import OutputBuffer
from stare_sandbox.result import truncate_text
from tests.conftest import host_problem, require

SECRET = "STARE_LOCAL_TEST_SECRET"


@given(st.lists(st.text(max_size=40), max_size=30), st.integers(min_value=1, max_value=50))
def test_output_buffer_keeps_what_truncate_text_keeps(chunks: list[str], limit: int) -> None:
    buf = OutputBuffer(limit)
    for chunk in chunks:
        buf.write(chunk)
    assert buf.text() == truncate_text("".join(chunks), limit)


def test_output_buffer_memory_is_bounded() -> None:
    buf = OutputBuffer(100)
    for _ in range(10_000):
        buf.write("y" * 1000)
    assert buf._head_len == 100 and buf._tail_len <= 100 + 1000
    text, cut = buf.text()
    assert cut and f"[{10_000_000 - 100} characters truncated]" in text


@pytest.fixture(scope="module")
def sb():
    os.environ[SECRET] = "hunter2"
    try:
        with LocalSandbox(SandboxConfig(max_output_chars=1000, memory_mb=1024)) as sandbox:
            yield sandbox
    finally:
        del os.environ[SECRET]


def test_cpu_timeout_interrupts_busy_code_and_spares_waiting_code() -> None:
    with LocalSandbox(SandboxConfig(cpu_timeout_s=1.0, timeout_s=30.0)) as sb:
        slept = sb.run("import time\ntime.sleep(1.5)\nprint('slept')")
        assert slept.ok and slept.stdout == "slept\n"
        start = time.monotonic()
        looped = sb.run("while True: pass")
        assert looped.timed_out and not looped.state_lost and time.monotonic() - start < 5.0
        assert looped.error.message.startswith("the code timed out after 1 s of CPU time;")


PRELOADED = "import sys\nprint(sorted(name for name in ('numpy', 'sympy') if name in sys.modules))"


def test_preloaded_modules_are_imported_at_the_local_kernels_start() -> None:
    with LocalSandbox(SandboxConfig(preload=list(PRELOAD_MATH))) as sb:
        assert sb.run(PRELOADED).stdout == "['numpy', 'sympy']\n"
    with LocalSandbox(SandboxConfig(preload=["json"])) as other:
        assert other.run("import sys\n'json' in sys.modules").stdout == "True\n"


def test_a_preload_module_the_local_python_lacks_stops_the_start_with_the_fix() -> None:
    with pytest.raises(
        SandboxError,
        match=r"could not import stare_sandbox.preload \['no_such_module'\].*sandbox.limits.preload",
    ):
        LocalSandbox(SandboxConfig(preload=["no_such_module"]))


@pytest.mark.parametrize("code", ["import os; os.kill(os.getpid(), 9)", "import os; os._exit(1)"])
def test_killed_kernel_is_reported_and_replaced(sb: LocalSandbox, code: str) -> None:
    result = sb.run(code)
    assert result.error.type == "KernelDied" and result.state_lost
    assert sb.run("2 + 2").stdout == "4\n"


def test_reset_clears_namespace_files_env_and_children(sb: LocalSandbox) -> None:
    sb.run("import os, subprocess\nv = 1\nopen('f.txt', 'w').write('x')\nos.environ['E'] = '1'")
    pid = int(sb.run("subprocess.Popen(['sleep', '300']).pid").stdout)
    sb.reset()
    assert sb.run("v").error.type == "NameError"
    assert sb.run("import os\nos.listdir('.'), os.environ.get('E')").stdout == "([], None)\n"
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    sb.run("v = 2")
    sb.reset(hard=True)
    assert sb.run("v").error.type == "NameError"


def test_host_environment_is_scrubbed(sb: LocalSandbox) -> None:
    assert sb.run(f"import os\nprint(os.environ.get({SECRET!r}))").stdout == "None\n"
    assert sb.run("os.getcwd()").stdout.strip("'\n") == str(sb.work_dir)


def test_memory_limit_raises_memory_error(sb: LocalSandbox) -> None:
    result = sb.run("b = bytearray(3 * 1024**3)")
    assert result.error.type == "MemoryError"
    assert sb.run("1").stdout == "1\n"


def test_network_namespace_has_only_loopback(sb: LocalSandbox) -> None:
    require("host", host_problem(unshare=True))
    # /sys/class/net shows the namespace sysfs was mounted in; if_nameindex asks the kernel.
    assert sb.run("import socket\n[name for _, name in socket.if_nameindex()]").stdout == "['lo']\n"


def test_close_removes_everything_and_is_idempotent() -> None:
    sandbox = make_sandbox("local")
    assert isinstance(sandbox, LocalSandbox) and sandbox.is_alive()
    pid, folder = sandbox._kernel.process.pid, sandbox.dir
    sandbox.close()
    sandbox.close()
    assert not folder.exists() and not Path(f"/proc/{pid}").exists()
    with pytest.raises(SandboxClosed):
        sandbox.run("1")


def test_start_warms_tracebacks_without_leaving_a_trace() -> None:
    with LocalSandbox() as fresh:  # its start ran one failing cell (stare_sandbox.kernel.WARM_TRACEBACKS)
        result = fresh.run("import sys\nhasattr(sys, 'last_value'), len(In), len(Out), _")
        assert result.stdout == "(False, 2, 0, '')\n"
        assert fresh.run("import sys\n'stack_data' in sys.modules").stdout == "True\n"


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="use 'auto', 'docker' or 'local'"):
        make_sandbox("podman")  # type: ignore[arg-type]


def test_dirs_of_a_killed_owner_are_reaped(tmp_path):
    """SIGKILL leaves no chance to clean up; the next process that starts a sandbox removes them."""
    import signal

    from stare_sandbox.owner import reap_local_dirs
    from tests.sandbox.helpers_processes import start_sandbox_owner

    child, sandbox_dir = start_sandbox_owner("LocalSandbox", "str(sb.dir)", tmp_path / "ready")
    reap_local_dirs()
    assert os.path.isdir(sandbox_dir)  # its owner is alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert reap_local_dirs() >= 1
    assert not os.path.exists(sandbox_dir)


# ---------------------------------------------------------------------------- what it contains


def processes_holding(token: str) -> list[int]:
    """PIDs whose command line holds ``token``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return found


def reap_leftovers() -> None:
    """What a killed owner left behind, as the next process that starts a sandbox removes it."""
    from stare_sandbox.local import reap_cgroups
    from stare_sandbox.owner import reap_local_dirs

    reap_local_dirs()
    reap_cgroups()


def wait_until_gone(token: str, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while processes_holding(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    return processes_holding(token)


STOWAWAY = (
    "import subprocess, sys\n"
    "code = 'import os, sys, time\\nif os.fork():\\n    os._exit(0)\\ntime.sleep(600)'\n"
    "subprocess.run(['setsid', sys.executable, '-c', code, {token!r}], check=True)"
)
"""Code that leaves a double-forked, setsid process behind (its command line holds the token)."""


def test_a_setsid_double_fork_does_not_outlive_close() -> None:
    token = f"stare-stowaway-{os.getpid()}-{time.monotonic_ns()}"
    sandbox = LocalSandbox()
    try:
        assert sandbox.run(STOWAWAY.format(token=token)).ok
        assert processes_holding(token), "the test did not start its stowaway"
    finally:
        sandbox.close()
    assert wait_until_gone(token) == [], "a double-forked process outlived close()"


def test_the_kernel_dies_with_its_owner(tmp_path) -> None:
    """An owner killed with SIGKILL runs no cleanup: its kernel must not run on, orphaned."""
    import signal

    from tests.sandbox.helpers_processes import start_sandbox_owner

    token = f"stare-orphan-{os.getpid()}-{time.monotonic_ns()}"
    child, kernel_pid = start_sandbox_owner(
        "LocalSandbox",
        f"str(sb.run('import os; os.getpid()', timeout=30).stdout.strip()) or {token!r}",
        tmp_path / "ready",
    )
    kernel_pid = int(kernel_pid)
    assert Path(f"/proc/{kernel_pid}").exists()
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{kernel_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    status = Path(f"/proc/{kernel_pid}/status").read_text() if Path(f"/proc/{kernel_pid}").exists() else ""
    reap_leftovers()
    assert "State:\tZ" in status or not status, "the kernel outlived its owner"


PEEK = """
import os
seen = []
pid = os.getpid()
while pid > 1:  # every ancestor's environment that can be read, the trainer's included
    try:
        seen.append(open(f"/proc/{pid}/environ", "rb").read())
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        break
print(b"hunter2" in b"".join(seen))
"""


def test_the_trainers_environment_is_not_readable_through_proc(tmp_path, monkeypatch) -> None:
    """The trainer's environment (API keys, tokens) as the kernel could read it from /proc: the
    environment a process started with, so the trainer is a child started with a secret."""
    from tests.sandbox.helpers_processes import start_sandbox_owner

    monkeypatch.setenv("STARE_TRAINER_SECRET", "hunter2")
    child, seen = start_sandbox_owner(
        "LocalSandbox", f"sb.run({PEEK!r}, timeout=30).stdout or 'no output'", tmp_path / "ready"
    )
    child.kill()
    child.wait()
    reap_leftovers()
    assert seen == "False\n"


def test_a_root_host_runs_the_kernel_without_roots_privileges_or_the_host_network() -> None:
    """Its own unprivileged uid where the interpreter is readable by it, else root without any
    capability: either way it cannot re-enter the host's network namespace with setns."""
    require("host", host_problem())
    with LocalSandbox() as sandbox:
        code = """
import os
capabilities = int(next(l for l in open("/proc/self/status") if l.startswith("CapEff")).split()[1], 16)
os.geteuid() != 0 or (capabilities == 0 and open("/proc/self/status").read().count("CapBnd:\\t0000000000000000") == 1)
"""
        assert sandbox.run(code).stdout == "True\n"
        code = """
import ctypes, os
try:
    fd = os.open("/proc/1/ns/net", os.O_RDONLY)
    entered = ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) == 0
except OSError:
    entered = False
entered
"""
        assert sandbox.run(code).stdout == "False\n"


def test_shared_memory_counts_against_the_memory_limit_where_a_cgroup_can_be_made() -> None:
    require("host", host_problem(cgroups=True))
    with LocalSandbox(SandboxConfig(memory_mb=256, timeout_s=30)) as sandbox:
        code = """
import mmap
m = mmap.mmap(-1, 1024 * 2**20, flags=mmap.MAP_SHARED)
for offset in range(0, len(m), 4096):
    m[offset] = 1
"done"
"""
        result = sandbox.run(code)
    assert "done" not in result.stdout and (result.state_lost or result.error is not None), result


def test_cgroups_of_a_killed_owner_are_reaped(tmp_path) -> None:
    import signal

    from stare_sandbox.local import reap_cgroups
    from stare_sandbox.owner import reap_local_dirs
    from stare_sandbox.usage import cgroup_dir
    from tests.sandbox.helpers_processes import start_sandbox_owner

    require("host", host_problem(cgroups=True))
    child, sandbox_dir = start_sandbox_owner("LocalSandbox", "str(sb.dir)", tmp_path / "ready")
    name = Path(sandbox_dir).name
    parents = {cgroup_dir(os.getpid(), controller) for controller in ("memory", "pids")}
    made = [parent / name for parent in parents if parent is not None and (parent / name).is_dir()]
    assert made, "the sandbox has no cgroup"
    reap_cgroups()
    assert all(folder.is_dir() for folder in made)  # its owner is alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait()
    reap_local_dirs()
    assert reap_cgroups() >= 1
    assert not any(folder.exists() for folder in made)
