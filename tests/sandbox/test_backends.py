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
