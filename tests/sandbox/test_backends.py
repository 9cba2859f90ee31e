"""The contract both backends keep, one body per check, run on a local and on a Docker sandbox.

What only one backend does (its hardening, resets, preloads, cleanup) is tested in test_local.py and
test_docker.py.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from stare_sandbox import DockerSandbox, LocalSandbox, SandboxConfig
from stare_sandbox.config import PRELOAD_MATH
from stare_sandbox.kernel import KernelSandbox
from tests.conftest import require

BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


def open_sandbox(backend: str, config: SandboxConfig | None = None) -> KernelSandbox:
    """A new sandbox of ``backend`` ("local" or "docker")."""
    return (DockerSandbox if backend == "docker" else LocalSandbox)(config or SandboxConfig())


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_ready")
    return request.param


@pytest.fixture(scope="module")
def sb(backend: str):
    with open_sandbox(backend, SandboxConfig(max_output_chars=1000, memory_mb=1024)) as sandbox:
        yield sandbox


def test_state_persists_and_trailing_expression_is_shown(sb: KernelSandbox) -> None:
    assert sb.run("x = 20").ok
    result = sb.run("print('hi')\nx * 2 + 2")
    assert result.stdout == "hi\n42\n"
    assert 0 < result.cpu_s < 1 and result.peak_memory_bytes > 10 * 2**20 and result.duration_s > 0


@pytest.mark.parametrize(
    ("line", "error"),
    [("raise KeyError('k')", ("KeyError", "'k'")), ("1/0", ("ZeroDivisionError", "division by zero"))],
)
def test_stderr_and_error_fields(sb: KernelSandbox, line: str, error: tuple[str, str]) -> None:
    result = sb.run(f"import sys\nprint('warn', file=sys.stderr)\n{line}")
    assert result.stderr == "warn\n"
    assert (result.error.type, result.error.message) == error
    assert "\x1b[" not in result.error.traceback and line in result.error.traceback
    assert not result.ok and not result.timed_out


def skip_unless_the_container_can_reset_its_peak(sb: DockerSandbox) -> None:
    """The peak is reset before each call wherever the kernel allows it: cgroup v1 with a root host
    (memory.max_usage_in_bytes), cgroup v2 on Linux 6.12+ (memory.peak, per descriptor)."""
    usage = sb._driver.host.usage
    v2 = usage.peak_file.name == "memory.peak"
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    possible = (release >= (6, 12) and os.access(usage.peak_file, os.W_OK)) if v2 else os.geteuid() == 0
    assert usage.peak_resettable == possible
    why = f"this host cannot reset the peak ({'v2 before Linux 6.12' if v2 else 'v1 without root'})"
    require("host", None if possible else why)


def test_cpu_and_peak_memory_are_measured_per_call(sb: KernelSandbox, backend: str) -> None:
    busy = sb.run("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass")
    assert busy.cpu_s >= 0.29 and busy.cpu_s < busy.duration_s + 0.1  # one busy thread: CPU <= wall
    big = sb.run("b = b'x' * (200 * 2**20)\ndel b")  # touches 200 MiB, then frees it
    after = sb.run("1")  # the high-water mark was reset before this call
    assert big.peak_memory_bytes > 200 * 2**20
    if backend == "docker":
        skip_unless_the_container_can_reset_its_peak(sb)
    assert big.peak_memory_bytes - after.peak_memory_bytes > 150 * 2**20


def test_output_cap_has_marker(sb: KernelSandbox) -> None:
    result = sb.run("print('a' * 5000)")
    assert result.truncated and len(result.stdout) < 1100
    assert "[4001 characters truncated]" in result.stdout  # 5000 a's + newline - 1000 kept


def test_python_loop_timeout_keeps_state(sb: KernelSandbox) -> None:
    sb.run("kept = 'yes'")
    result = sb.run("print('before')\nwhile True: pass", timeout=1)
    assert result.timed_out and not result.state_lost and result.stdout == "before\n"
    assert result.error.type == "TimeoutError"
    assert sb.run("kept").stdout == "'yes'\n"


def test_c_loop_timeout_restarts_the_kernel_within_timeout_plus_2s(sb: KernelSandbox) -> None:
    sb.run("kept = 1")
    start = time.monotonic()
    result = sb.run("sum(range(10**12))", timeout=1)
    assert time.monotonic() - start < 1 + 2 + 0.5
    assert result.timed_out and result.state_lost
    assert sb.run("kept").error.type == "NameError"
    assert sb.run("1 + 1").stdout == "2\n"


def test_string_hashes_and_set_order_are_the_same_in_every_sandbox(sb: KernelSandbox, backend: str) -> None:
    code = "print(hash('stare'), list({'apple', 'banana', 'cherry', 'damson', 'elder', 'fig'}))"
    with open_sandbox(backend) as other:
        assert sb.run(code).stdout == other.run(code).stdout != ""


def test_random_draws_the_same_in_every_sandbox_and_after_every_reset(
    sb: KernelSandbox, backend: str
) -> None:
    code = "import random\nprint(random.random(), random.randint(0, 10**9))"
    first = sb.run(code).stdout
    with open_sandbox(backend) as other:
        assert other.run(code).stdout == first != ""
    assert sb.run(code).stdout != first  # the stream goes on within an episode
    sb.reset()  # local: in place, the same interpreter reseeded; Docker: a fresh kernel
    assert sb.run(code).stdout == first  # and starts over in the next


NUMPY_DRAW = "import numpy\nprint(numpy.random.rand(), numpy.random.randint(0, 10**9))"


def test_numpy_random_draws_the_same_in_every_sandbox_and_after_every_reset(backend: str) -> None:
    config = SandboxConfig(preload=list(PRELOAD_MATH))
    with open_sandbox(backend, config) as sb, open_sandbox(backend, config) as other:
        first = sb.run(NUMPY_DRAW).stdout
        assert other.run(NUMPY_DRAW).stdout == first != ""
        assert sb.run(NUMPY_DRAW).stdout != first  # the stream goes on within an episode
        sb.reset()  # local: numpy reseeded in place; Docker: a fresh fork of the warden
        assert sb.run(NUMPY_DRAW).stdout == first  # and starts over in the next


@pytest.fixture(scope="module")
def wide(backend: str):
    """A sandbox that keeps 300,000 characters of output: pipe-fulls of it, uncut."""
    with open_sandbox(backend, SandboxConfig(max_output_chars=300_000)) as sandbox:
        yield sandbox


def test_what_children_os_write_and_c_code_print_is_in_its_own_cell_in_order(sb: KernelSandbox) -> None:
    code = """
import ctypes, os, subprocess, sys
print("print")
os.write(1, b"os.write\\n")
os.write(2, b"os.write 2\\n")
subprocess.run(["echo", "child"])
subprocess.run(["echo", "child on sys.stdout"], stdout=sys.stdout)
ctypes.CDLL(None).printf(b"printf\\n")
print("print again")
"""
    result = sb.run(code)
    # C stdio is block-buffered on a pipe: printf's line comes when the cell ends, last.
    assert result.stdout == "print\nos.write\nchild\nchild on sys.stdout\nprint again\nprintf\n"
    assert result.stderr == "os.write 2\n"
    assert sb.run("print('next')").stdout == "next\n"


PIPE_FULLS = """
import os
print("before")
n = os.write(1, b"".join(b"%05d\\n" % k for k in range(20000)))
print("after")
n"""


def test_pipe_fulls_written_to_a_descriptor_stay_whole_and_in_their_own_cell(wide: KernelSandbox) -> None:
    # 120,000 bytes, about two pipe-fulls: the cell's own print and its value come after the last
    # byte, and the next cell starts clean.
    want = "before\n" + "".join(f"{k:05d}\n" for k in range(20000)) + "after\n120000\n"
    for _ in range(5):
        assert wide.run(PIPE_FULLS).stdout == want
    assert wide.run("print('next')").stdout == "next\n"


def test_a_character_split_between_reads_neither_garbles_nor_stalls_the_output(wide: KernelSandbox) -> None:
    split = wide.run("import os\nn = os.write(1, ('a' + 'é' * 5000 + '\\n').encode())")
    assert split.stdout == "a" + "é" * 5000 + "\n"
    flood = wide.run("n = os.write(1, b'y' * 200_000)", timeout=10)  # more than a pipe holds
    assert flood.ok and flood.stdout == "y" * 200_000


def test_a_message_bigger_than_the_host_keeps_still_arrives_cut(sb: KernelSandbox) -> None:
    # 10^6 NULs are 6 MB of JSON (\u0000) in one message, over MAX_MESSAGE_BYTES: the kernel sends
    # it in chunks, each kept, and the host cuts the text.
    result = sb.run("print('\\x00' * 1_000_000)")
    assert result.skipped_messages == 0 and result.truncated
    assert result.stdout.startswith("\x00" * 500) and result.stdout.endswith("\x00" * 499 + "\n")


def test_an_episode_finds_no_output_or_cell_count_of_the_one_before(sb: KernelSandbox) -> None:
    sb.reset()
    first_error = sb.run("1/0").error.traceback
    sb.run("print('last episode')\n'its value'")
    sb.run("raise KeyError('its error')")
    sb.reset()  # local: in place; Docker: a fresh kernel
    assert sb.run("1/0").error.traceback == first_error  # "Cell In[1]" as in a fresh kernel
    history = sb.run("hm = get_ipython().history_manager\nprint(vars(hm))").stdout
    assert "last episode" not in history and "its value" not in history and "its error" not in history


def test_a_process_that_never_stops_writing_keeps_no_cell_from_ending(wide: KernelSandbox) -> None:
    start = wide.run(
        "import subprocess, sys\n"
        "writer = subprocess.Popen([sys.executable, '-c', 'import os\\nwhile True: os.write(1, b\"w\" * 65536)'])"
    )
    assert start.ok, start
    try:
        for _ in range(3):
            result = wide.run("kept = 'still here'", timeout=10)
            assert result.ok and result.duration_s < 5, result.error
    finally:
        wide.run("writer.kill(); writer.wait()")
    assert wide.run("print(kept)").stdout == "still here\n"  # what the writer left went with its cells


def test_a_flood_nobody_reads_between_calls_is_bounded_in_the_kernel(backend: str) -> None:
    """A grandchild that writes without end after its cell returned, while the host reads nothing (no
    call runs): the kernel keeps a bounded share of it (``KERNEL_OUTPUT_CHARS`` a stream and a cell),
    so it neither hits its data limit (local: RLIMIT_DATA 1 GiB) nor the container's memory (Docker),
    and the next calls run."""
    with open_sandbox(backend, SandboxConfig(max_output_chars=1000, memory_mb=1024)) as sandbox:
        start = sandbox.run(
            "import subprocess, sys\n"
            "writer = subprocess.Popen([sys.executable, '-c', "
            "'import os\\nwhile True: os.write(1, b\"\\\\x01\" * 65536)'])"
        )
        assert start.ok, start
        time.sleep(4)  # nobody reads the kernel's output: it used to pile up here
        status = sandbox.run(
            "import sys\nprint(open('/proc/self/status').read(), file=sys.stderr)", timeout=20
        )
        assert status.ok, status.error  # stderr: the flood fills this cell's stdout
        vm_data_kb = int(re.search(r"VmData:\s+(\d+) kB", status.stderr)[1])
        assert vm_data_kb < 400 * 1024, vm_data_kb
        assert sandbox.run("writer.kill(); writer.wait(); 'done'").ok


def test_a_cell_that_prints_until_its_timeout_times_out_and_keeps_its_kernel(backend: str) -> None:
    """A loop of prints (control characters: 6 bytes each in JSON) until the call's timeout: a timeout,
    the state kept, and the kernel's data bounded (IPython 9 recorded every write: a MemoryError within
    a second on the local backend, the kernel at its 1 GiB data limit after)."""
    with open_sandbox(backend, SandboxConfig(max_output_chars=1000, memory_mb=1024)) as sandbox:
        assert sandbox.run("kept = 5").ok
        flood = sandbox.run("while True: print('\\x01' * 100_000)", timeout=5)
        assert flood.error is not None and flood.error.type == "TimeoutError", flood.error
        assert flood.truncated and len(flood.stdout) < 1100
        status = sandbox.run("import sys\nprint(open('/proc/self/status').read(), file=sys.stderr)\nkept")
        assert status.ok and status.stdout == "5\n", status
        assert int(re.search(r"VmData:\s+(\d+) kB", status.stderr)[1]) < 400 * 1024


def test_a_kernel_whose_boot_fails_is_a_start_error_never_a_silent_one(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that could not run its boot (bounded messages, seeding, descriptor output per cell)
    would serve without them; it is a SandboxError at start naming the error instead. On Docker the
    failure is the warden's log line, written by the new kernel before it could serve."""
    import stare_sandbox.docker
    import stare_sandbox.kernel
    from stare_sandbox import SandboxError

    module = stare_sandbox.docker if backend == "docker" else stare_sandbox.kernel
    monkeypatch.setattr(
        module, "KERNEL_BOOT", module.KERNEL_BOOT + "\nraise RuntimeError('boot broke on purpose')"
    )
    with pytest.raises(SandboxError, match=r"boot code failed.*RuntimeError: boot broke on purpose"):
        with open_sandbox(backend) as sandbox:
            sandbox.run("1")
