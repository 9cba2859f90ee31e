"""SandboxPool: leasing, re-arming, health checks, bounded waits, thread safety, no leaks.

The contract tests use a small in-process sandbox (``FakeSandbox``) so that timings and failures
can be controlled exactly; the end-to-end tests below run the same pool on the real local and
Docker backends, including a process killed with SIGINT mid-lease.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest

from stare_sandbox.base import Sandbox
from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import PoolExhausted, SandboxClosed, SandboxUnavailable
from stare_sandbox.pool import PooledSandbox, PoolStats, SandboxPool
from stare_sandbox.result import ExecError, ExecResult

# ---------------------------------------------------------------------------- a controllable fake


class FakeSandbox(Sandbox):
    """Runs code with ``exec`` in a dict; ``"hang"`` times out with state loss like a real kernel."""

    backend = "fake"

    def __init__(self, *, reset_delay_s: float = 0.0, fail_reset: bool = False) -> None:
        super().__init__()
        self.namespace: dict = {}
        self.alive = True
        self.closed = False
        self.resets = 0
        self.reset_delay_s = reset_delay_s
        self.fail_reset = fail_reset

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        if self.closed:
            raise SandboxClosed("fake closed")
        if code == "hang":
            self.namespace.clear()
            return ExecResult(timed_out=True, state_lost=True)
        try:
            try:
                value = eval(code, self.namespace)  # noqa: S307 - trusted test code
                return ExecResult(stdout=repr(value))
            except SyntaxError:
                exec(code, self.namespace)  # noqa: S102
                return ExecResult()
        except Exception as exc:  # noqa: BLE001
            return ExecResult(error=ExecError(type(exc).__name__, str(exc)))

    def reset(self) -> None:
        time.sleep(self.reset_delay_s)
        if self.fail_reset or not self.alive:
            raise RuntimeError("fake reset failed")
        self.namespace.clear()
        self.resets += 1

    def close(self) -> None:
        self.closed = True
        self.alive = False

    def is_alive(self) -> bool:
        return self.alive and not self.closed


class Factory:
    """Makes FakeSandboxes, remembers them, and can be told to be slow or to fail."""

    def __init__(self, *, start_delay_s: float = 0.0, **fake_kwargs) -> None:
        self.start_delay_s = start_delay_s
        self.fake_kwargs = fake_kwargs
        self.made: list[FakeSandbox] = []
        self.fail: Exception | None = None
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> FakeSandbox:
        with self._lock:
            self.calls += 1
        time.sleep(self.start_delay_s)
        if self.fail is not None:
            raise self.fail
        sandbox = FakeSandbox(**self.fake_kwargs)
        with self._lock:
            self.made.append(sandbox)
        return sandbox


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def settled(pool: SandboxPool) -> PoolStats:
    """Stats once every background reset/replacement has finished."""
    wait_until(lambda: pool.stats().rearming == 0)
    return pool.stats()


# ---------------------------------------------------------------------------- construction


def test_copies_are_the_pool_itself_so_gymnasium_make_can_take_it():
    import gymnasium

    import stare_envs  # noqa: F401 - registers stare/CodeInterpreter-v0

    with SandboxPool(1, factory=Factory()) as pool:
        assert copy.copy(pool) is pool and copy.deepcopy({"pool": pool})["pool"] is pool
        env = gymnasium.make("stare/CodeInterpreter-v0", pool=pool)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # Gymnasium warns when it cannot copy the spec
                assert env.spec is not None and env.spec.kwargs["pool"] is pool
            assert env.unwrapped.pool is pool
        finally:
            env.close()
        assert not pool.closed and pool.stats().idle == 1  # the env does not close a pool it was given


def test_starts_size_sandboxes_in_parallel():
    factory = Factory(start_delay_s=0.3)
    t0 = time.monotonic()
    with SandboxPool(4, factory=factory) as pool:
        elapsed = time.monotonic() - t0
        assert len(factory.made) == 4
        # Sequential starts would take 4 x 0.3 = 1.2 s.
        assert elapsed < 0.9
        assert pool.stats() == PoolStats(
            size=4, idle=4, leased=0, rearming=0, created=4, replaced=0, resets=0
        )


def test_constructor_raises_the_backends_error_and_closes_what_started():
    made_ok: list[FakeSandbox] = []
    calls = iter(range(100))  # next() on a range iterator is atomic under the GIL

    def flaky() -> FakeSandbox:
        if next(calls) >= 2:
            raise SandboxUnavailable("Docker daemon not reachable: start dockerd")
        sandbox = FakeSandbox()
        made_ok.append(sandbox)
        return sandbox

    with pytest.raises(SandboxUnavailable, match="start dockerd"):
        SandboxPool(4, factory=flaky)
    assert len(made_ok) == 2
    assert all(s.closed for s in made_ok)


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_rejects_bad_size(size):
    with pytest.raises(ValueError, match="pool size must be an int >= 1"):
        SandboxPool(size, factory=Factory())


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown sandbox backend 'podman': use 'auto', 'docker' or 'local'"):
        SandboxPool(1, backend="podman")


def test_factory_and_backend_are_exclusive():
    with pytest.raises(ValueError, match="either factory or backend/config"):
        SandboxPool(1, backend="local", factory=Factory())


# ---------------------------------------------------------------------------- leasing and re-arming


def test_lease_hands_out_a_clean_sandbox_and_resets_it_on_release():
    factory = Factory()
    with SandboxPool(1, factory=factory) as pool:
        with pool.lease() as sb:
            assert isinstance(sb, PooledSandbox)
            assert sb.run("x = 41").ok
            assert sb.run("x + 1").stdout == "42"
            assert pool.stats().leased == 1
        with pool.lease() as sb:
            # Same sandbox (pool of one), but its state is gone.
            assert sb.inner is factory.made[0]
            assert sb.run("x").error.type == "NameError"
        stats = settled(pool)
    assert (stats.created, stats.replaced, stats.resets) == (1, 0, 2)


def test_release_returns_at_once_and_the_next_lease_waits_for_the_reset():
    factory = Factory(reset_delay_s=1.0)
    with SandboxPool(1, factory=factory) as pool:
        sb = pool.acquire()
        sb.run("x = 1")
        t0 = time.monotonic()
        pool.release(sb)
        assert time.monotonic() - t0 < 0.5  # the reset runs in the background
        assert pool.stats().rearming == 1
        t0 = time.monotonic()
        with pool.lease() as sb:
            assert time.monotonic() - t0 > 0.4  # waited for the reset, not handed a dirty sandbox
            assert sb.run("x").error.type == "NameError"


def test_released_sandbox_cannot_be_used_and_release_is_idempotent():
    with SandboxPool(1, factory=Factory()) as pool:
        sb = pool.acquire()
        pool.release(sb)
        pool.release(sb)
        sb.close()
        with pytest.raises(SandboxClosed, match="given back to its pool"):
            sb.run("1")
        assert not sb.is_alive()
        assert settled(pool).resets == 1


def test_close_on_a_leased_sandbox_gives_it_back():
    with SandboxPool(1, factory=Factory()) as pool:
        with pool.acquire() as sb:  # Sandbox's own context manager: close() on exit
            sb.run("y = 2")
        stats = settled(pool)
        assert (stats.idle, stats.leased, stats.resets) == (1, 0, 1)


def test_release_rejects_a_sandbox_from_elsewhere():
    with SandboxPool(1, factory=Factory()) as pool, SandboxPool(1, factory=Factory()) as other:
        sb = other.acquire()
        with pytest.raises(ValueError, match="not leased from this pool"):
            pool.release(sb)
        with pytest.raises(ValueError, match="not leased from this pool"):
            pool.release(FakeSandbox())
        other.release(sb)


def die(pool: SandboxPool, sb: PooledSandbox) -> None:
    assert isinstance(sb.inner, FakeSandbox)
    sb.inner.alive = False
    pool.release(sb)


def time_out_losing_state(pool: SandboxPool, sb: PooledSandbox) -> None:
    assert sb.run("hang").state_lost
    pool.release(sb)


def mark_broken(pool: SandboxPool, sb: PooledSandbox) -> None:
    pool.release(sb, broken=True)


def fail_the_reset(pool: SandboxPool, sb: PooledSandbox) -> None:
    assert isinstance(sb.inner, FakeSandbox)
    sb.inner.fail_reset = True
    pool.release(sb)


@pytest.mark.parametrize("spoil", [die, time_out_losing_state, mark_broken, fail_the_reset])
def test_spoiled_sandbox_is_replaced(spoil):
    factory = Factory()
    with SandboxPool(1, factory=factory) as pool:
        sb = pool.acquire()
        first = sb.inner
        spoil(pool, sb)
        stats = settled(pool)
        assert first.closed
        assert (stats.created, stats.replaced, stats.idle) == (2, 1, 1)
        with pool.lease() as sb:
            assert sb.inner is factory.made[1]
            assert sb.run("1 + 1").stdout == "2"


def test_timeout_without_state_loss_is_reset_not_replaced():
    class Interruptible(FakeSandbox):
        def run(self, code, timeout=None):
            return (
                ExecResult(timed_out=True, state_lost=False) if code == "loop" else super().run(code, timeout)
            )

    with SandboxPool(1, factory=Interruptible) as pool:
        with pool.lease() as sb:
            sb.run("loop")
        stats = settled(pool)
    assert (stats.created, stats.replaced, stats.resets) == (1, 0, 1)


class Exploding(FakeSandbox):
    """Its ``run`` is interrupted by Ctrl-C."""

    def run(self, code, timeout=None):
        raise KeyboardInterrupt


def test_interrupted_run_marks_the_sandbox_for_replacement():
    with SandboxPool(1, factory=Exploding) as pool:
        sb = pool.acquire()
        with pytest.raises(KeyboardInterrupt):
            sb.run("x = 1")
        pool.release(sb)
        stats = settled(pool)
    assert (stats.created, stats.replaced, stats.leased) == (2, 1, 0)


def test_ctrl_c_in_a_lease_closes_the_sandbox_and_the_next_lease_refills_the_slot():
    factory = Factory()
    with SandboxPool(2, factory=factory) as pool:
        with pytest.raises(KeyboardInterrupt), pool.lease() as sb:
            first = sb.inner
            raise KeyboardInterrupt
        stats = settled(pool)
        assert first.closed
        # Retired, not replaced: nothing new starts while the program is being interrupted.
        assert (stats.created, stats.replaced, stats.idle, stats.leased) == (2, 0, 1, 0)
        with pool.lease() as a, pool.lease() as b:
            # the survivor of the first two (started in parallel, in either order) and one new one
            assert len(factory.made) == 3
            assert {a.inner, b.inner} == set(factory.made) - {first}
        assert settled(pool).created == 3


def test_an_ordinary_exception_in_a_lease_resets_the_sandbox():
    with SandboxPool(1, factory=Factory()) as pool:
        with pytest.raises(ValueError), pool.lease() as sb:
            sb.run("x = 1")
            raise ValueError("the caller's own bug")
        stats = settled(pool)
    assert (stats.created, stats.replaced, stats.resets) == (1, 0, 1)


def test_health_check_skips_a_sandbox_that_died_while_idle():
    factory = Factory()
    with SandboxPool(2, factory=factory) as pool:
        settled(pool)
        dead = factory.made[0]
        dead.alive = False
        # Holding two leases at once makes the pool pass the dead one whatever its idle order
        # (which sandbox finished starting first depends on the machine's load).
        with pool.lease() as a, pool.lease() as b:
            assert dead not in (a.inner, b.inner) and a.inner is not b.inner
            assert a.inner.alive and b.inner.alive
        stats = settled(pool)
        assert (stats.created, stats.replaced, stats.idle) == (3, 1, 2)
        assert dead.closed


# ---------------------------------------------------------------------------- bounded waiting


def test_exhausted_pool_raises_after_the_lease_timeout_with_cause_and_fix():
    with SandboxPool(1, factory=Factory(), lease_timeout=0.3) as pool:
        held = pool.acquire()
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted) as info:
            pool.acquire()
        assert 0.25 < time.monotonic() - t0 < 1.5
        message = str(info.value)
        assert "\n" not in message
        assert "no sandbox free after 0.3 s (pool of 1: 1 leased, 0 re-arming)" in message
        assert "release leases" in message and "raise the pool size or the lease timeout" in message
        with pytest.raises(PoolExhausted, match="after 0.1 s"):
            pool.acquire(timeout=0.1)
        pool.release(held)
        with pool.lease(timeout=2) as sb:
            assert sb.is_alive()


def test_waiter_gets_a_sandbox_as_soon_as_one_is_released():
    with SandboxPool(1, factory=Factory()) as pool:
        held = pool.acquire()
        threading.Timer(0.2, pool.release, args=(held,)).start()
        t0 = time.monotonic()
        with pool.lease(timeout=5):
            assert 0.15 < time.monotonic() - t0 < 2


def test_failed_replacement_fails_fast_and_recovers_when_the_backend_does():
    factory = Factory()
    with SandboxPool(1, factory=factory, lease_timeout=30) as pool:
        lease = pool.acquire()
        # Failing before the release: set after it, a replacement made in between (a loaded
        # machine descheduling this thread) would succeed and nothing would raise.
        factory.fail = SandboxUnavailable("sandbox image missing: run `stare-agent sandbox build`")
        pool.release(lease, broken=True)
        settled(pool)
        t0 = time.monotonic()
        with pytest.raises(PoolExhausted, match=r"could not start a sandbox \(sandbox image missing"):
            pool.acquire()
        assert time.monotonic() - t0 < 2  # not the 30 s lease timeout
        factory.fail = None
        with pool.lease() as sb:  # the lost slot is refilled on the next lease
            assert sb.run("2 * 3").stdout == "6"
        assert settled(pool).created == 2


# ---------------------------------------------------------------------------- concurrency


def test_many_threads_never_share_a_sandbox_and_always_get_a_clean_one():
    factory = Factory(reset_delay_s=0.002)
    n_threads, n_episodes = 12, 15
    in_use: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def episodes(pool: SandboxPool) -> None:
        for i in range(n_episodes):
            with pool.lease(timeout=10) as sb:
                with guard:
                    if id(sb.inner) in in_use:
                        errors.append("a sandbox was leased twice at once")
                    in_use.add(id(sb.inner))
                if sb.run("marker").error is None:
                    errors.append("a leased sandbox still held the previous episode's state")
                sb.run("marker = 1")
                if i % 5 == 4:
                    sb.run("hang")  # some episodes end with a lost kernel: replaced
                time.sleep(0.001)
                with guard:
                    in_use.discard(id(sb.inner))

    with SandboxPool(3, factory=factory) as pool:
        threads = [threading.Thread(target=episodes, args=(pool,)) for _ in range(n_threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        stats = settled(pool)
    assert errors == []
    total = n_threads * n_episodes
    replaced = n_threads * (n_episodes // 5)
    assert stats.replaced == replaced
    assert stats.resets == total - replaced
    assert stats.created == 3 + replaced == len(factory.made)
    assert (stats.idle, stats.leased) == (3, 0)
    assert all(s.closed for s in factory.made)


# ---------------------------------------------------------------------------- closing


def test_close_closes_idle_leased_and_rearming_sandboxes():
    factory = Factory(reset_delay_s=0.3)
    pool = SandboxPool(3, factory=factory)
    leased = pool.acquire()
    pool.release(pool.acquire())  # now resetting in the background
    pool.close()
    assert all(s.closed for s in factory.made) and len(factory.made) == 3
    with pytest.raises(SandboxClosed, match="given back to its pool"):
        leased.run("1")
    with pytest.raises(SandboxClosed, match="pool is closed"):
        pool.acquire()
    pool.release(leased)  # harmless after close
    pool.close()
    assert pool.closed


def test_close_while_a_replacement_starts_closes_the_new_one_too():
    factory = Factory()
    pool = SandboxPool(1, factory=factory)
    factory.start_delay_s = 0.3
    pool.release(pool.acquire(), broken=True)
    wait_until(lambda: factory.calls == 2)  # the replacement is starting
    pool.close()
    assert pool.stats().rearming == 0
    assert len(factory.made) == 2 and all(s.closed for s in factory.made)


def test_waiters_are_woken_by_close():
    pool = SandboxPool(1, factory=Factory())
    pool.acquire()
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(timeout=30)
        except Exception as exc:  # noqa: BLE001
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    pool.close()
    waiter.join(5)
    assert not waiter.is_alive()
    assert isinstance(outcome[0], SandboxClosed)


# ---------------------------------------------------------------------------- real backends

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["local", pytest.param("docker", marks=pytest.mark.docker)]


@pytest.fixture
def backend(request) -> str:
    if request.param == "docker":
        request.getfixturevalue("docker_ready")
    return request.param


def processes_with(token: str) -> list[int]:
    """PIDs whose environment holds ``token`` (kernels, local or in containers: the host sees both)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def containers_with(token: str) -> list[str]:
    """Sandbox containers (running or not) whose environment holds ``token``; a Docker error fails
    the test (it must not read as "no containers")."""
    import docker  # type: ignore[import-untyped]

    client = docker.from_env(timeout=10)
    try:
        containers = client.containers.list(all=True, filters={"label": "org.stare-agent.sandbox=1"})
        return [c.short_id for c in containers if any(token in e for e in c.attrs["Config"].get("Env") or [])]
    finally:
        client.close()


def assert_nothing_left(token: str, dirs: list[str], backend: str) -> None:
    deadline = time.monotonic() + 10  # the kernel processes' parent may still be reaping them
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(token) == [], "kernel processes outlived the pool"
    if backend == "docker":
        assert containers_with(token) == [], "containers outlived the pool"
    assert [d for d in dirs if Path(d).exists()] == [], "temp dirs outlived the pool"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_real_pool_hands_out_clean_sandboxes_replaces_dead_ones_and_leaves_nothing(backend):
    token = f"STARE_POOL_TEST_{uuid.uuid4().hex}"
    config = SandboxConfig(env={"STARE_POOL_PROBE": token}, timeout_s=30)
    pool = SandboxPool(2, backend=backend, config=config)
    dirs: list[str] = []
    try:
        with pool.lease() as a:
            dirs.append(str(a.inner.dir))
            assert a.run("x = 1\nopen('note.txt', 'w').write('hi')").ok
        with pool.lease() as a, pool.lease() as b:  # one of them is the sandbox just reset
            dirs += [str(a.inner.dir), str(b.inner.dir)]
            for sb in (a, b):
                assert sb.run("x").error.type == "NameError"
                assert sb.run("import os\nos.path.exists('note.txt')").stdout == "False\n"
            dead = a.inner
            a.run("import os\nos._exit(1)")  # the kernel dies: the pool starts over with a new one
        stats = settled(pool)
        assert dead.is_alive() is False
        assert (stats.created, stats.replaced, stats.idle) == (3, 1, 2)
        with pool.lease() as a, pool.lease() as b:
            dirs += [str(a.inner.dir), str(b.inner.dir)]
            assert {a.run("1 + 1").stdout, b.run("2 + 2").stdout} == {"2\n", "4\n"}
        assert processes_with(token) != []
    finally:
        pool.close()
    assert_nothing_left(token, dirs, backend)


CHILD = """
import json, signal, sys, time, traceback
from stare_sandbox.config import SandboxConfig
from stare_sandbox.pool import SandboxPool

# Ctrl-C as in a program run from a terminal, however the test suite was started: a shell's
# background job (`cmd &` without job control) starts with SIGINT ignored, and Python then installs
# no KeyboardInterrupt handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
backend, token, mode = sys.argv[1:]
pool = SandboxPool(2, backend=backend, config=SandboxConfig(env={"STARE_POOL_PROBE": token}, timeout_s=120))
with pool.lease() as a, pool.lease() as b:
    dirs = [str(a.inner.dir), str(b.inner.dir)]
sb = pool.acquire()  # held, never released: only the pool's exit handling can clean up
print(json.dumps(dirs), flush=True)
sys.stdin.readline()  # until the test has seen the kernels: an exit must not race its check
if mode != "exit":
    with pool.lease() as other:
        print("running", flush=True)
        try:
            other.run("import time\\ntime.sleep(120)")  # Ctrl-C or SIGTERM arrives here
        except BaseException:
            traceback.print_exc()  # where it landed (SystemExit alone prints nothing)
            raise
"""


@pytest.mark.parametrize("mode", ["sigint", "sigterm", "exit"])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_ctrl_c_or_exit_while_leased_leaks_nothing(backend, mode, tmp_path):
    token = f"STARE_POOL_TEST_{uuid.uuid4().hex}"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, str(script), backend, token, mode],
        cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        dirs = json.loads(child.stdout.readline() or "null")
        assert dirs, f"child failed to start: {child.stderr.read()}"
        assert len(processes_with(token)) >= 2
        assert child.stdin is not None
        child.stdin.write("go\n")  # the child goes on: exits, or leases and runs until the signal
        child.stdin.flush()
        if mode != "exit":
            assert child.stdout.readline() == "running\n"
            time.sleep(0.5)  # run() has started (it lasts 120 s); the traceback below proves it
            child.send_signal(signal.SIGINT if mode == "sigint" else signal.SIGTERM)
        _, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    if mode == "exit":
        assert child.returncode == 0, stderr
    else:
        assert f"sandbox{os.sep}kernel.py" in stderr and ", in execute" in stderr, stderr  # inside run()
        assert ("KeyboardInterrupt" if mode == "sigint" else "SystemExit: 143") in stderr, stderr
        assert child.returncode == (-signal.SIGINT if mode == "sigint" else 143), stderr
    assert_nothing_left(token, dirs, backend)


@pytest.mark.docker
def test_auto_is_resolved_once_and_a_later_docker_failure_is_an_error_never_the_host(
    docker_ready, monkeypatch
):
    """A Docker hiccup in the middle of training must not start model code on the host."""
    with SandboxPool(1, backend="auto", config=SandboxConfig(timeout_s=30)) as pool:
        monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")  # the daemon "goes away"
        pool.release(pool.acquire(), broken=True)  # the pool must start a replacement
        with pytest.raises(PoolExhausted, match=r"Docker daemon not reachable .*start dockerd"):
            with pool.lease(timeout=30) as sb:
                pytest.fail(f"got a {sb.backend} sandbox while Docker was unreachable")
        assert pool.backend == "docker"


def test_auto_never_becomes_the_local_backend_and_local_says_so_on_stderr(tmp_path):
    """Where Docker is not usable, ``auto`` (the default of the pool, ToolEnv and the config) is an error
    naming the fix, never a local process running model code under the host's uid; the local backend,
    asked for by name, says on stderr that its isolation is weaker, whatever the logging setup."""
    script = tmp_path / "no_docker.py"
    script.write_text(
        textwrap.dedent(
            """
            import gymnasium, stare_envs
            from stare_sandbox import SandboxPool, SandboxUnavailable, resolve_backend
            for make in (lambda: resolve_backend("auto"), lambda: SandboxPool(1),
                         lambda: gymnasium.make("stare/AIME2024-v0")):
                try:
                    make()
                    print("RAN LOCALLY")
                except SandboxUnavailable as exc:
                    print("refused:", str(exc).splitlines()[0])
            with SandboxPool(1, backend="local") as pool, pool.lease() as sb:
                print("local ran", sb.run("1 + 1").stdout.strip())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "local ran 2" and "RAN LOCALLY" not in done.stdout, done.stdout
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 3, done.stdout
    for line in refused:
        assert (
            "Docker is not usable here (no Docker daemon answers" in line and "sandbox.backend=local" in line
        )
    assert done.stderr.count("[sandbox] LocalSandbox runs model code as a local process") == 1, done.stderr
