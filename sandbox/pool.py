"""A pool of warm sandboxes leased one per episode.

Starting a sandbox (a container plus a kernel) takes seconds; resetting a warm one takes
milliseconds. ``SandboxPool`` starts ``size`` sandboxes at construction (in parallel), hands one out
per episode and, when the episode gives it back, re-arms it on a background thread: a reset, or a
replacement when the sandbox died, lost its state to a timeout, was marked broken, or failed to
reset. Only clean, health-checked sandboxes are ever handed out.

The reset is the backend's: a Docker sandbox gets a fresh kernel process from its container's
warden, which the episode's code cannot subvert (``sandbox/warden.py``, ``docs/sandbox.md``); the
local backend resets inside the kernel's own interpreter, which code can subvert (see its
warning). The backend is resolved once, at construction: ``"auto"`` never turns into a local
sandbox later because Docker failed once.

>>> from stare_sandbox.pool import SandboxPool
>>> with SandboxPool(2, backend="local") as pool:  # doctest: +SKIP
...     with pool.lease() as sb:
...         sb.run("x = 1").ok
True
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from stare_sandbox.backends import resolve_backend
from stare_sandbox.base import Sandbox
from stare_sandbox.config import Backend, SandboxConfig
from stare_sandbox.errors import PoolExhausted, SandboxClosed
from stare_sandbox.result import ExecResult
from stare_sandbox.shutdown import exit_on_sigterm

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TIMEOUT_S = 60.0
"""How long ``acquire`` waits for a free sandbox unless told otherwise."""

Rearm = Literal["reset", "replace", "retire", "start"]
"""What a background thread does with a sandbox that comes back (see ``SandboxPool._rearm``)."""

CLOSE_JOIN_TIMEOUT_S = 30.0
"""How long ``close`` waits for in-flight resets and replacements before closing anyway."""


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool.

    Attributes:
        size: Number of sandboxes the pool keeps.
        idle: Clean sandboxes ready to lease.
        leased: Sandboxes held by callers.
        rearming: Sandboxes being reset or replaced (or started) in the background.
        created: Sandboxes started since the pool was built (the initial ones included).
        replaced: Sandboxes closed and started anew (died, timed out with state loss, broken,
            reset failed, or failed the health check).
        resets: Successful resets of a returned sandbox.
    """

    size: int
    idle: int
    leased: int
    rearming: int
    created: int
    replaced: int
    resets: int


class Lessor(Protocol):
    """What a ``PooledSandbox`` gives itself back to: a ``SandboxPool``, or a fleet of sandboxes on
    other machines (``stare_sandbox.ray_fleet.RaySandboxFleet``)."""

    def release(self, sandbox: PooledSandbox, *, broken: bool = False) -> None: ...


class PooledSandbox(Sandbox):
    """A sandbox on lease from a pool; valid until it is released.

    It behaves like the sandbox it wraps, except ``close()``: that gives it back to the pool (which
    resets it), so code that treats it as a plain sandbox never leaks it. After release every call
    raises ``SandboxClosed``. A ``run`` that lost the kernel's state (killed after a timeout, or
    the kernel died) or that was interrupted (e.g. by Ctrl-C) marks it for replacement instead of
    a reset.
    """

    def __init__(self, pool: Lessor, inner: Sandbox) -> None:
        super().__init__(inner.config)
        self.backend = inner.backend
        self._pool = pool
        self._inner: Sandbox | None = inner
        self.tainted = False

    @property
    def inner(self) -> Sandbox:
        """The leased backend sandbox; raises ``SandboxClosed`` after release."""
        if self._inner is None:
            raise SandboxClosed("this sandbox was given back to its pool: lease a new one with pool.lease()")
        return self._inner

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        inner = self.inner
        try:
            result = inner.run(code, timeout)
        except BaseException:
            self.tainted = True  # the kernel may still be busy with this code
            raise
        if result.state_lost:  # killed after a timeout, or died: start over in a fresh sandbox
            self.tainted = True
        return result

    def reset(self) -> None:
        self.inner.reset()

    def is_alive(self) -> bool:
        return self._inner is not None and self._inner.is_alive()

    def close(self) -> None:
        """Give the sandbox back to the pool. Idempotent."""
        if self._inner is not None:
            self._pool.release(self)

    def __repr__(self) -> str:
        state = "released" if self._inner is None else repr(self._inner)
        return f"PooledSandbox({state})"


class SandboxPool:
    """Keeps ``size`` sandboxes warm and leases them one per episode. Thread-safe.

    The constructor starts all sandboxes in parallel and returns when they are ready (it raises the
    backend's own error, e.g. ``SandboxUnavailable``, if one cannot start, after closing the rest).
    Released sandboxes are reset, or replaced, on a background thread, so ``release`` returns at
    once and the next ``acquire`` gets a clean sandbox. ``acquire`` health-checks (``is_alive``)
    before handing out and never waits longer than its timeout. ``close()`` (also run at
    interpreter exit, including after Ctrl-C) closes every sandbox, leased ones included.

    Args:
        size: Number of sandboxes to keep warm (>= 1).
        backend: ``"auto"``, ``"docker"`` or ``"local"``. ``"auto"`` is resolved once, here
            (``stare_sandbox.resolve_backend``): every sandbox of the pool, replacements included, uses
            that backend, and a later failure to start one is an error (with cause and fix),
            never a fallback to another backend.
        config: Limits for every sandbox of the pool.
        factory: Makes one started sandbox; replaces ``backend``/``config`` (pass one or the other).
        lease_timeout: Default seconds ``acquire`` waits before raising ``PoolExhausted``.
        wait: Return from the constructor once every sandbox has started (and raise if one could not);
            False: return at once while they start in the background (``acquire`` waits for one; a fleet
            host reports them as they come: :meth:`wait_started`).
    """

    def __init__(
        self,
        size: int,
        backend: Backend = "auto",
        config: SandboxConfig | None = None,
        *,
        factory: Callable[[], Sandbox] | None = None,
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT_S,
        wait: bool = True,
    ) -> None:
        if backend not in ("auto", "docker", "local"):  # "ray" is a fleet: stare_sandbox.open_pool
            raise ValueError(f"unknown sandbox backend {backend!r}: use 'auto', 'docker' or 'local'")
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"pool size must be an int >= 1, got {size!r}")
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be > 0 seconds, got {lease_timeout!r}")
        if factory is not None and (backend != "auto" or config is not None):
            raise ValueError("pass either factory or backend/config to SandboxPool, not both")
        self.backend: str = "custom"
        """The backend every sandbox of this pool uses (``"custom"`` with a ``factory``)."""
        if factory is None:
            self.backend = resolve_backend(backend, config)
            factory = _backend_factory(self.backend, config)
        self.size = size
        self.lease_timeout = lease_timeout
        self._factory = factory
        self._cond = threading.Condition()
        self._idle: collections.deque[Sandbox] = collections.deque()
        self._leases: set[PooledSandbox] = set()
        self._rearming = 0
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._created = self._replaced = self._resets = 0
        self._failures = 0
        self._last_error: BaseException | None = None
        _LIVE_POOLS.add(self)
        exit_on_sigterm()  # SIGTERM closes the pool as Ctrl-C does
        try:
            self._start_all(wait)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ leasing

    def acquire(self, timeout: float | None = None) -> PooledSandbox:
        """Lease a clean, live sandbox; give it back with ``release`` (or use ``lease()``).

        Args:
            timeout: Seconds to wait for a free sandbox; defaults to the pool's ``lease_timeout``.

        Raises:
            PoolExhausted: None became free in time, or a replacement could not be started.
            SandboxClosed: The pool is closed.
        """
        wait_s = self.lease_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        failures_seen = self._failures
        while True:
            with self._cond:
                lease = PooledSandbox(self, self._wait_for_idle(deadline, wait_s, failures_seen))
                self._leases.add(lease)  # booked at once: close() finds it even if Ctrl-C strikes next
            inner = lease._inner
            if inner is not None and _healthy(inner):
                return lease
            with self._cond:
                inner, lease._inner = lease._inner, None
                self._leases.discard(lease)
                if inner is None:
                    continue  # close() took it; the loop raises SandboxClosed
                if self._closed:
                    _close_quietly(inner)
                    continue
                logger.warning("sandbox %r failed its health check; replacing it", inner)
                self._replaced += 1
                self._spawn(inner, "replace")

    def release(self, sandbox: PooledSandbox, *, broken: bool = False) -> None:
        """Give a leased sandbox back; it is reset (or replaced) in the background. Idempotent.

        Args:
            sandbox: A sandbox from this pool's ``acquire``/``lease``.
            broken: Replace it instead of resetting it (e.g. the caller saw it misbehave).
        """
        if not isinstance(sandbox, PooledSandbox) or sandbox._pool is not self:
            raise ValueError(
                f"{sandbox!r} was not leased from this pool: release it to the pool it came from"
            )
        self._give_back(sandbox, "replace" if broken or sandbox.tainted else "reset")

    @contextlib.contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[PooledSandbox]:
        """``acquire`` as a context manager that always gives the sandbox back.

        On a normal exit or an ordinary exception the sandbox is reset (or replaced, if tainted);
        on ``KeyboardInterrupt``/``SystemExit`` it is closed without starting a replacement, so an
        interrupted program shuts down promptly; the next ``acquire`` refills the slot.
        """
        sandbox = self.acquire(timeout)
        try:
            yield sandbox
        except BaseException as exc:
            # Ctrl-C or interpreter exit: close this sandbox without starting a replacement now (the
            # next acquire refills the slot). Any other exception: the usual reset or replacement.
            self._give_back(sandbox, "retire" if not isinstance(exc, Exception) else None)
            raise
        self._give_back(sandbox, None)

    def stats(self) -> PoolStats:
        """A consistent snapshot of the pool's counters."""
        with self._cond:
            return PoolStats(
                size=self.size,
                idle=len(self._idle),
                leased=len(self._leases),
                rearming=self._rearming,
                created=self._created,
                replaced=self._replaced,
                resets=self._resets,
            )

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close every sandbox (idle, leased, being re-armed) and wait for them. Idempotent."""
        with self._cond:
            already = self._closed
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
            leases, self._leases = list(self._leases), set()
            threads = list(self._threads)
            self._cond.notify_all()
        _LIVE_POOLS.discard(self)
        doomed = idle
        for lease in leases:
            inner, lease._inner = lease._inner, None
            if inner is not None:
                doomed.append(inner)
        # Re-arm threads see the closed flag and close their sandbox themselves; wait for them.
        deadline = time.monotonic() + CLOSE_JOIN_TIMEOUT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        _close_all_quietly(doomed)
        if not already:
            logger.debug("sandbox pool closed (%d sandboxes)", len(doomed))

    @property
    def closed(self) -> bool:
        return self._closed

    def __copy__(self) -> SandboxPool:
        """The pool itself: a pool is a shared resource, never duplicated (Gymnasium deep-copies
        ``make`` kwargs such as ``pool=`` when it reads ``env.spec``)."""
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> SandboxPool:
        """The pool itself (see ``__copy__``)."""
        return self

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"SandboxPool(size={s.size}, idle={s.idle}, leased={s.leased}, closed={self._closed})"

    # ------------------------------------------------------------------ internals

    def wait_started(self, count: int, timeout: float) -> int:
        """Wait until ``count`` sandboxes have started, or every start has ended, or ``timeout``: the
        number started (idle or leased). Raises the last start's error when none could start."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                started = len(self._idle) + len(self._leases)
                if started >= count or self._closed or not self._rearming or time.monotonic() >= deadline:
                    break
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            if not started and not self._rearming and self._last_error is not None:
                raise self._last_error
            return started

    def _start_all(self, wait: bool) -> None:
        with self._cond:
            for _ in range(self.size):
                self._spawn(None, "start")
            if not wait:
                return
            while self._rearming and not self._closed:
                self._cond.wait()
            if self._last_error is not None:
                raise self._last_error

    def _wait_for_idle(self, deadline: float, wait_s: float, failures_seen: int) -> Sandbox:
        """Pop an idle sandbox, starting one if the pool is short; call with the lock held."""
        while True:
            if self._closed:
                raise SandboxClosed("the sandbox pool is closed: build a new SandboxPool")
            if self._idle:
                return self._idle.popleft()
            start_failed = self._failures != failures_seen
            if start_failed and not self._leases and not self._rearming:
                raise PoolExhausted(
                    f"could not start a sandbox ({self._last_error}): fix the backend "
                    "(`stare-agent sandbox doctor`) and lease again"
                ) from self._last_error
            if not start_failed and len(self._leases) + self._rearming < self.size:
                self._spawn(None, "start")  # a slot was lost (failed start, retired): refill it once
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cause = f"; last start failed: {self._last_error}" if start_failed else ""
                raise PoolExhausted(
                    f"no sandbox free after {wait_s:g} s (pool of {self.size}: {len(self._leases)} leased, "
                    f"{self._rearming} re-arming{cause}): release leases (use `with pool.lease()`), "
                    "or raise the pool size or the lease timeout"
                )
            self._cond.wait(remaining)

    def _give_back(self, sandbox: PooledSandbox, action: Rearm | None) -> None:
        """End a lease and re-arm its sandbox (``None``: reset, or replace when tainted)."""
        with self._cond:
            inner, sandbox._inner = sandbox._inner, None
            if inner is None:
                return  # released before, or taken by close()
            self._leases.discard(sandbox)
            if not self._closed:
                if action is None:
                    action = "replace" if sandbox.tainted else "reset"
                if action == "replace":
                    self._replaced += 1
                self._spawn(inner, action)
                return
        _close_quietly(inner)

    def _spawn(self, inner: Sandbox | None, action: Rearm) -> None:
        """Run ``_rearm`` on a daemon thread; call with the lock held.

        Daemon threads never block interpreter exit; ``close`` joins them.
        """
        self._rearming += 1
        thread = threading.Thread(
            target=self._rearm, args=(inner, action), name="sandbox-pool-rearm", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _rearm(self, inner: Sandbox | None, action: Rearm) -> None:
        """Reset ``inner``, or close it and start a new one ("replace"), or only close it ("retire"),
        or only start a new one ("start", ``inner`` None). A ready sandbox joins the idle queue."""
        ready: Sandbox | None = None
        error: BaseException | None = None
        reset_ok = False
        try:
            if inner is not None and action == "reset" and not self._closed:
                ready = self._reset_or_none(inner)
                reset_ok = ready is not None
                if not reset_ok:
                    with self._cond:
                        self._replaced += 1
            if ready is None:
                if inner is not None:
                    _close_quietly(inner)
                if action != "retire" and not self._closed:
                    ready = self._factory()
                    with self._cond:
                        self._created += 1
        except BaseException as exc:  # noqa: BLE001 - reported to acquire/constructor, never lost
            error = exc
            logger.warning("starting a sandbox failed: %s", exc)
        finally:
            with self._cond:
                self._rearming -= 1
                self._threads.discard(threading.current_thread())
                if reset_ok:
                    self._resets += 1
                if error is not None:
                    self._failures += 1
                    self._last_error = error
                if ready is not None and not self._closed:
                    self._idle.append(ready)
                    ready = None
                self._cond.notify_all()
            if ready is not None:  # the pool closed meanwhile
                _close_quietly(ready)

    @staticmethod
    def _reset_or_none(inner: Sandbox) -> Sandbox | None:
        """``inner`` reset and alive, or None when it died or its reset failed (replace it then)."""
        if not _healthy(inner):
            logger.warning("sandbox %r died during its lease; replacing it", inner)
            return None
        try:
            inner.reset()
        except Exception as exc:  # noqa: BLE001 - any reset failure means: replace it
            logger.warning("resetting %r failed (%s); replacing it", inner, exc)
            return None
        return inner


def _backend_factory(backend: str, config: SandboxConfig | None) -> Callable[[], Sandbox]:
    """Starts sandboxes of one concrete backend, never another (no silent fallback)."""

    def make() -> Sandbox:
        from stare_sandbox.docker import DockerSandbox  # late: the docker SDK only when a pool starts one
        from stare_sandbox.local import LocalSandbox

        return DockerSandbox(config) if backend == "docker" else LocalSandbox(config)

    return make


def _healthy(sandbox: Sandbox) -> bool:
    try:
        return sandbox.is_alive()
    except Exception as exc:  # noqa: BLE001 - a health check that fails is a failed health check
        logger.warning("health check of %r raised %s", sandbox, exc)
        return False


def _close_quietly(sandbox: Sandbox) -> None:
    try:
        sandbox.close()
    except Exception as exc:  # noqa: BLE001 - closing is best effort; report, do not raise
        logger.warning("closing %r failed: %s", sandbox, exc)


def _close_all_quietly(sandboxes: list[Sandbox]) -> None:
    """Close sandboxes in parallel (stopping a container takes a while) and wait for all."""
    if len(sandboxes) <= 1:
        for sandbox in sandboxes:
            _close_quietly(sandbox)
        return
    threads = [threading.Thread(target=_close_quietly, args=(s,), daemon=True) for s in sandboxes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


_LIVE_POOLS: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    """Close pools still open at interpreter exit (also after an unhandled KeyboardInterrupt)."""
    for pool in list(_LIVE_POOLS):
        pool.close()
