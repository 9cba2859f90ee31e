"""Sandboxes on the nodes of a Ray cluster: ``sandbox.backend: ray``.

A process that plays episodes (a trainer rank, a rollout worker, an evaluation, an adapter of
verl, TRL or verifiers) may run on a node without Docker. The fleet runs the sandboxes where
Docker is: one **host** actor on each node of the cluster that has the custom resource
``RayFleetConfig.node_resource`` (e.g. CPU nodes started with ``ray start --address ...
--resources '{"stare_sandbox": 1}'``), each keeping a warm :class:`~stare_sandbox.pool.SandboxPool` of
that node's Docker daemon, so the kernels' unix sockets never leave their node. One named
**coordinator** actor places leases on the host with the most free sandboxes, holds the
cluster-wide cap on live leases, and hands out the tokens of the creation-rate limit that every
host takes before it starts a container (a token bucket, as verl's rate limiter): a burst of
episodes cannot flood a daemon with container starts.

``RaySandboxFleet`` is the client: it has the pool's verbs (``acquire``, ``release``, ``lease``,
``stats``, ``close``), and what ``acquire`` returns is a :class:`~stare_sandbox.pool.PooledSandbox`
around a :class:`RaySandbox`, which implements :class:`~stare_sandbox.base.Sandbox`: an environment
uses it as it uses a local pool's sandbox (``run`` returns the host's ``ExecResult`` as is, with
the same limits and hardening, since the same backend runs it, and the host's pool resets or
replaces it between episodes). The lease is held for the episode and given back at its end.
Ray carries the leases, never a lease's calls: those go on a TCP connection of the lease's own
to its host, opened with a token the host issued for that lease (``stare_sandbox.fleet_wire``), which
costs a fraction of a Ray actor call.

Faults: a host lost mid-call (its actor killed, its node gone: its connection is closed, reset,
or silent past TCP keepalive) or a call that does not come back within its timeout plus
``call_margin_s`` raises :class:`SandboxLost`, a ``SandboxError``: the
env ends the episode with ``EpisodeInfrastructureError`` and the rollout plays it again, on a
healthy host (the coordinator drops the lost host; a node that is still alive gets a new one).
A node that joins the cluster later gets a host within ``refresh_s`` and takes new leases.

Ray is optional (``pip install 'stare-agent[ray]'``); this module imports it only when a fleet
is built, so ``import stare_sandbox`` never needs it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stare_sandbox.base import Sandbox
from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import PoolExhausted, SandboxClosed, SandboxError, SandboxUnavailable
from stare_sandbox.pool import PooledSandbox, SandboxPool
from stare_sandbox.result import ExecError, ExecResult

if TYPE_CHECKING:
    from stare_sandbox.fleet_wire import LeaseConnection

logger = logging.getLogger(__name__)

COORDINATOR_NAME = "stare-sandbox-fleet"
"""The coordinator's actor name in ``RayFleetConfig.namespace``: every process of a run that
builds a fleet with the same namespace shares it (the first one creates it)."""


class SandboxLost(SandboxError):
    """The host of a leased sandbox is gone (its actor died, its node left the cluster) or did not
    answer in time; the episode on it cannot go on."""


@dataclass
class RayFleetConfig:
    """Where the fleet's sandboxes run and how fast it may make them.

    Attributes:
        address: Ray cluster to join when this process has not joined one yet (``ray.init``):
            ``"auto"`` (the cluster this node runs, as ``ray start`` left it), ``"local"`` (a new
            one-node cluster in this process: development only) or ``"HOST:PORT"``.
        namespace: Ray namespace of the coordinator; processes of one run share it.
        node_resource: The custom Ray resource that marks a node with Docker and the sandbox image;
            each such node gets one host actor (it takes 0.001 of it).
        sandboxes_per_node: Warm sandboxes each host keeps (its pool's size).
        node_backend: The backend of each host's pool: ``docker`` (isolated: the reason for the
            fleet), or ``local`` (a kernel process per sandbox: development only, weak isolation).
        max_leases: Cluster-wide cap on live leases, or None for the fleet's total sandboxes.
        creations_per_s: Container starts per second, cluster-wide (the token bucket's rate).
        creation_burst: Container starts allowed at once (the bucket's size).
        lease_timeout_s: How long ``acquire`` waits for a free sandbox before ``PoolExhausted``.
        call_margin_s: Slack over a call's own deadline (``timeout`` + ``restart_grace_s``) before
            an unanswered call counts as a lost host.
        refresh_s: How often the coordinator looks for new and lost nodes and hosts.
        lease_idle_s: A lease without a call for this long is taken back and its sandbox replaced:
            its holder is taken for gone (a process that died without giving it back would otherwise
            keep its sandbox and its share of ``max_leases``). Above the longest model turn.
        start_timeout_s: How long building a fleet waits for its first ready host.
    """

    address: str = "auto"
    namespace: str = "stare-agent"
    node_resource: str = "stare_sandbox"
    sandboxes_per_node: int = 8
    node_backend: str = "docker"
    max_leases: int | None = None
    creations_per_s: float = 4.0
    creation_burst: int = 8
    lease_timeout_s: float = 60.0
    call_margin_s: float = 30.0
    refresh_s: float = 1.0
    lease_idle_s: float = 600.0
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("sandboxes_per_node", "creation_burst"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"sandbox.ray.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in (
            "creations_per_s",
            "lease_timeout_s",
            "call_margin_s",
            "refresh_s",
            "start_timeout_s",
            "lease_idle_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.ray.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_leases is not None and (not isinstance(self.max_leases, int) or self.max_leases < 1):
            raise ValueError(
                f"sandbox.ray.max_leases must be an int >= 1 or null (the fleet's size), got {self.max_leases!r}"
            )
        if self.node_backend not in ("docker", "local"):
            raise ValueError(
                f"sandbox.ray.node_backend must be 'docker' or 'local', got {self.node_backend!r}"
            )
        if not self.node_resource:
            raise ValueError("sandbox.ray.node_resource must name a Ray resource, e.g. 'stare_sandbox'")


@dataclass(frozen=True)
class HostStats:
    """One host as the coordinator sees it.

    Attributes:
        node_id: The Ray node it runs on.
        capacity: Its pool's size.
        leased: Its live leases.
        ready: Whether its pool has started (a host takes leases only then).
    """

    node_id: str
    capacity: int
    leased: int
    ready: bool


@dataclass(frozen=True)
class FleetStats:
    """A snapshot of the fleet.

    Attributes:
        hosts: Every host, ready or starting.
        leased: Live leases, cluster-wide.
        peak_leased: The most live leases at once since the coordinator started.
        max_leases: The cluster-wide cap in force (the ready hosts' capacity when not configured).
        leases: Leases granted since the coordinator started.
        hosts_lost: Hosts dropped because their actor or node was lost.
        creations: Creation tokens handed out (container starts), with their times
            (``time.monotonic`` of the coordinator's process).
        last_failure: Why the last host was dropped ("" when none was).
        coordinator_node: The Ray node the coordinator runs on (see :func:`coordinator_node`).
        clients: The ``RaySandboxFleet`` clients registered with it, in every process of the run.
        failures: ``(node_id, why)`` of each node whose last host was dropped and that has no ready
            host since (a host that could not start: Docker unreachable, the image missing).
    """

    hosts: tuple[HostStats, ...]
    leased: int
    peak_leased: int
    max_leases: int
    leases: int
    hosts_lost: int
    creations: tuple[float, ...] = field(default=())
    last_failure: str = ""
    coordinator_node: str = ""
    clients: int = 0
    failures: tuple[tuple[str, str], ...] = field(default=())

    @property
    def size(self) -> int:
        """Sandboxes of the ready hosts."""
        return sum(h.capacity for h in self.hosts if h.ready)


def import_ray() -> Any:
    """``ray``, or ``SandboxUnavailable`` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise SandboxUnavailable(
            "sandbox.backend=ray needs Ray, which is not installed: pip install 'stare-agent[ray]'"
        ) from exc
    return ray


# ---------------------------------------------------------------------------------------- host

_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(ExecResult))


def pack_result(result: ExecResult) -> tuple[Any, ...]:
    """``result`` as a tuple of plain values, the form a host sends it in (msgpack, on the lease's
    connection: ``stare_sandbox.fleet_wire``)."""
    values = [getattr(result, name) for name in _RESULT_FIELDS]
    error = result.error
    values[_RESULT_FIELDS.index("error")] = (
        None if error is None else (error.type, error.message, error.traceback)
    )
    return tuple(values)


def unpack_result(values: tuple[Any, ...]) -> ExecResult:
    """The ``ExecResult`` that :func:`pack_result` packed."""
    fields = dict(zip(_RESULT_FIELDS, values, strict=True))
    if fields["error"] is not None:
        fields["error"] = ExecError(*fields["error"])
    return ExecResult(**fields)


_ERRORS: dict[str, type[SandboxError]] = {
    cls.__name__: cls for cls in (SandboxError, SandboxUnavailable, SandboxClosed, PoolExhausted)
}


def _raised(exc: SandboxError | OSError) -> tuple[str, str, str]:
    """The answer that carries a host's sandbox's failure: its nearest class in ``_ERRORS``, or
    ``OSError``, and its message."""
    name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), "OSError")
    return ("raised", name, str(exc))


def raised_error(type_name: str, message: str) -> Exception:
    """The exception that :func:`_raised` sent, as a local pool would raise it."""
    return _ERRORS[type_name](message) if type_name in _ERRORS else OSError(message)


class SandboxHost:
    """The actor on one node: a warm ``SandboxPool`` of the node's daemon, leased by id.

    Run as a threaded Ray actor; Ray carries its leases (``acquire``, ``release``) and its health
    (``ready``, ``ping``). A lease's calls come on a TCP connection of their own
    (``stare_sandbox.fleet_wire``: ``acquire`` returns the address and the lease's token), served by a
    thread per connection, so calls on different leases run at once. Every container start takes a
    token of the coordinator's creation-rate limit first. A lease without a call for
    ``lease_idle_s`` is taken back (its holder is taken for gone) and its sandbox replaced.
    """

    def __init__(
        self, config: RayFleetConfig, sandbox_config: SandboxConfig, coordinator: Any, name: str
    ) -> None:
        ray = import_ray()
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.name = name
        self._leases: dict[str, PooledSandbox] = {}
        self._last_use: dict[str, float] = {}
        self._in_call: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._coordinator, self._idle_s = coordinator, config.lease_idle_s
        self._closed = False
        backend = config.node_backend

        def make() -> Sandbox:
            ray.get(coordinator.take_creation_token.remote(config.lease_timeout_s))
            from stare_sandbox.docker import DockerSandbox
            from stare_sandbox.local import LocalSandbox

            return DockerSandbox(sandbox_config) if backend == "docker" else LocalSandbox(sandbox_config)

        self._pool = SandboxPool(
            config.sandboxes_per_node, factory=make, lease_timeout=config.lease_timeout_s
        )
        from stare_sandbox.fleet_wire import LeaseServer

        self._server = LeaseServer(ray.util.get_node_ip_address(), self._answer)
        threading.Thread(target=self._reclaim_loop, name="lease-reclaim", daemon=True).start()

    def ready(self) -> tuple[str, int]:
        """The node id and the pool's size, once the pool has started."""
        return self.node_id, self._pool.size

    def ping(self) -> bool:
        return True

    def acquire(self, lease_id: str, timeout: float) -> tuple[str, int, bytes]:
        """Lease a sandbox as ``lease_id``: the address its calls go to and the lease's token."""
        lease = self._pool.acquire(timeout)
        with self._lock:
            self._leases[lease_id] = lease
            self._last_use[lease_id] = time.monotonic()
        return (*self._server.address, self._server.admit(lease_id))

    def run(self, lease_id: str, code: str, timeout: float | None) -> tuple[Any, ...]:
        """``ExecResult`` packed (:func:`pack_result`)."""
        with self._using(lease_id) as lease:
            return pack_result(lease.run(code, timeout))

    def reset(self, lease_id: str) -> None:
        with self._using(lease_id) as lease:
            lease.reset()

    def is_alive(self, lease_id: str) -> bool:
        try:
            with self._using(lease_id) as lease:
                return lease.is_alive()
        except SandboxClosed:
            return False

    def release(self, lease_id: str, broken: bool) -> None:
        """End a lease (once: the host, not its holder, tells the coordinator, so a lease taken back
        for idleness and then given back by a slow holder counts once)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            self._last_use.pop(lease_id, None)
        self._server.revoke(lease_id)
        if lease is not None:
            self._pool.release(lease, broken=broken)
            with contextlib.suppress(Exception):
                self._coordinator.returned.remote(self.node_id, self.name)

    def pool_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._pool.stats())

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self._pool.close()

    def _answer(self, lease_id: str, request: list[Any]) -> tuple[Any, ...]:
        """The answer to a request on ``lease_id``'s connection (``stare_sandbox.fleet_wire``)."""
        try:
            method, *args = request
            if method == "run":
                return ("ok", self.run(lease_id, *args))
            if method == "reset":
                self.reset(lease_id)
                return ("ok", None)
            if method == "is_alive":
                return ("ok", self.is_alive(lease_id))
            if method == "ping":  # no sandbox touched: the data path's own round trip
                return ("ok", True)
            return ("failed", f"unknown request {method!r}")
        except (SandboxError, OSError) as exc:  # the sandbox failed: as a local pool raises it
            return _raised(exc)
        except Exception as exc:  # noqa: BLE001 - the host failed: the client drops it
            return ("failed", f"{type(exc).__name__}: {exc}")

    @contextlib.contextmanager
    def _using(self, lease_id: str) -> Iterator[PooledSandbox]:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise SandboxClosed(
                    f"lease {lease_id} is not held on this host (given back, or taken back after "
                    f"{self._idle_s:g} s without a call): lease a new sandbox"
                )
            self._in_call[lease_id] += 1
        try:
            yield lease
        finally:
            with self._lock:
                self._in_call[lease_id] -= 1
                if not self._in_call[lease_id]:
                    del self._in_call[lease_id]
                self._last_use[lease_id] = time.monotonic()

    def _reclaim_loop(self) -> None:
        """Take back leases idle for ``lease_idle_s`` (not while a call runs) and tell the coordinator."""
        while not self._closed:
            time.sleep(min(10.0, self._idle_s / 4))
            now = time.monotonic()
            with self._lock:
                idle = [
                    lease_id
                    for lease_id, used in self._last_use.items()
                    if now - used > self._idle_s and not self._in_call[lease_id]
                ]
            for lease_id in idle:
                logger.warning(
                    "lease %s had no call for %g s: taken back (its holder is taken for gone)",
                    lease_id,
                    self._idle_s,
                )
                self.release(lease_id, broken=True)  # its state is unknown: a fresh sandbox


# --------------------------------------------------------------------------------- coordinator


def _one_line(exc: BaseException) -> str:
    """The line of ``exc`` that says why: a Ray error's last line is its cause's ``Type: message``
    (a host whose ``__init__`` raised, e.g. ``SandboxUnavailable: sandbox image ... not found: ...``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) < 2:
        return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    kind, sep, message = lines[-1].partition(": ")
    if sep and " " not in kind:  # module.Type: message
        return f"{kind.rsplit('.', 1)[-1]}: {message}"
    return lines[-1]


@dataclass
class _Host:
    handle: Any
    node_id: str
    name: str
    capacity: int = 0
    leased: int = 0
    ready: bool = False
    ready_ref: Any = None
    ping_ref: Any = None
    ping_sent: float = 0.0
    last_grant: float = 0.0


class FleetCoordinator:
    """The named actor that places leases, caps them and rate-limits container starts.

    Run as a threaded Ray actor; a thread of its own looks for new and lost nodes and hosts
    every ``refresh_s``.
    """

    PING_TIMEOUT_S = 30.0
    """A host that leaves a ping unanswered this long is dropped (and started anew)."""

    HOST_RETRY_S = 10.0
    """After a host failed to start on a node, how long before another is started there."""

    def __init__(self, config: RayFleetConfig, sandbox_config: SandboxConfig) -> None:
        self.config, self.sandbox_config = config, sandbox_config
        self._cond = threading.Condition()
        self._hosts: dict[str, _Host] = {}
        self._leased = self._peak = self._leases = self._lost = 0
        self._tokens = float(config.creation_burst)
        self._token_time = time.monotonic()
        self._creations: list[float] = []
        self._last_failure = ""
        self._retry_after: dict[str, float] = {}
        self._started = 0
        self._stopped = False
        self._clients: dict[str, Any] = {}  # client id -> an object its process owns (alive while it is)
        self._failures: dict[str, str] = {}  # node id -> why its last host was dropped, until one is ready
        self._refresh_lock = threading.Lock()
        self._thread = threading.Thread(target=self._refresh_loop, name="fleet-refresh", daemon=True)
        self._thread.start()

    # clients

    def register(self, client_id: str, anchor: list[Any]) -> bool:
        """A client joins: ``anchor`` holds an ``ObjectRef`` its process owns, which fails to resolve
        once that process is gone. False when the fleet is shutting down (build it again)."""
        with self._cond:
            if self._stopped:
                return False
            self._clients[client_id] = anchor[0]
            return True

    def unregister(self, client_id: str) -> int:
        """A client left (its ``close``); the clients that remain (at 0, the caller ends the fleet)."""
        with self._cond:
            self._clients.pop(client_id, None)
            return len(self._clients)

    # leases

    def grant(self, timeout: float, node_id: str | None = None) -> tuple[str, Any]:
        """A ready host with a free sandbox (on ``node_id`` when given), booked: ``(node_id, name)``
        (the host actor's name: a handle costs more to send than the rest of a lease). Waits up to
        ``timeout``.

        Raises:
            PoolExhausted: none in time (the message says how many are leased and what the cap is).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                host = self._pick(node_id)
                if host is not None:
                    host.leased += 1
                    host.last_grant = time.monotonic()
                    self._leased += 1
                    self._leases += 1
                    self._peak = max(self._peak, self._leased)
                    return host.node_id, host.name
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ready = [h for h in self._hosts.values() if h.ready]
                    if not ready:
                        raise PoolExhausted(
                            f"no sandbox host is ready after {timeout:g} s: no node of the Ray cluster has "
                            f"the resource {self.config.node_resource!r}, or its pool did not start; start "
                            f"sandbox nodes with `ray start --address ... --resources "
                            f"'{{\"{self.config.node_resource}\": 1}}'` on machines with Docker and the "
                            "sandbox image (`stare-agent sandbox doctor` there says what is missing)"
                        )
                    raise PoolExhausted(
                        f"no sandbox free after {timeout:g} s ({self._leased} leased of a cap of "
                        f"{self._cap()} on {len(ready)} hosts): give leases back at the end of each episode, "
                        "or add sandbox nodes, or raise sandbox.ray.sandboxes_per_node / max_leases"
                    )
                self._cond.wait(min(remaining, self.config.refresh_s))

    def returned(self, node_id: str, name: str) -> None:
        """A lease on the host ``name`` of ``node_id`` ended (one dropped since took its leases along)."""
        with self._cond:
            host = self._hosts.get(node_id)
            if host is not None and host.name == name and host.leased > 0:
                host.leased -= 1
                self._leased -= 1
                self._cond.notify_all()

    def host_failed(self, node_id: str, name: str, reason: str) -> None:
        """A client saw the host ``name`` fail: drop it (its leases with it); the next refresh starts a
        new host on the node if the node is still alive."""
        with self._cond:
            host = self._hosts.get(node_id)
            if host is None or host.name != name:
                return  # dropped before (another client saw it first)
            self._drop(host, reason)

    def take_creation_token(self, timeout: float) -> None:
        """Wait for a token of the creation-rate limit (a bucket of ``creation_burst`` tokens that
        fills at ``creations_per_s``).

        Raises:
            PoolExhausted: none in ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = time.monotonic()
                self._tokens = min(
                    float(self.config.creation_burst),
                    self._tokens + (now - self._token_time) * self.config.creations_per_s,
                )
                self._token_time = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    self._creations.append(now)
                    return
                wait = (1.0 - self._tokens) / self.config.creations_per_s
                if now + wait > deadline:
                    raise PoolExhausted(
                        f"no container-creation token within {timeout:g} s (sandbox.ray.creations_per_s="
                        f"{self.config.creations_per_s:g}): raise it, or the lease timeout"
                    )
                self._cond.wait(wait)

    def stats(self) -> FleetStats:
        with self._cond:
            return FleetStats(
                hosts=tuple(
                    HostStats(node_id=h.node_id, capacity=h.capacity, leased=h.leased, ready=h.ready)
                    for h in self._hosts.values()
                ),
                leased=self._leased,
                peak_leased=self._peak,
                max_leases=self._cap(),
                leases=self._leases,
                hosts_lost=self._lost,
                creations=tuple(self._creations),
                last_failure=self._last_failure,
                coordinator_node=import_ray().get_runtime_context().get_node_id(),
                clients=len(self._clients),
                failures=tuple(self._failures.items()),
            )

    def refresh(self) -> None:
        """Start hosts on new sandbox nodes, mark started ones ready, drop lost ones."""
        ray = import_ray()
        with self._refresh_lock:
            alive = {
                n["NodeID"]
                for n in ray.nodes()
                if n.get("Alive") and n.get("Resources", {}).get(self.config.node_resource, 0) > 0
            }
            with self._cond:
                if self._stopped:
                    return
                for node_id, host in list(self._hosts.items()):
                    if node_id not in alive:
                        self._drop(host, "its node left the cluster")
                now = time.monotonic()
                new = [n for n in alive if n not in self._hosts and self._retry_after.get(n, 0.0) <= now]
                for node_id in new:
                    self._hosts[node_id] = self._start_host(ray, node_id)
                hosts = list(self._hosts.values())
            for host in hosts:
                self._check(ray, host)

    def shutdown(self) -> None:
        """Close every host's pool (its containers) and end the host actors."""
        ray = import_ray()
        with self._cond:
            self._stopped = True
            hosts, self._hosts = list(self._hosts.values()), {}
            self._cond.notify_all()
        refs = [h.handle.close.remote() for h in hosts]
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=60)
        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.handle)

    # internals

    def _cap(self) -> int:
        capacity = sum(h.capacity for h in self._hosts.values() if h.ready)
        return capacity if self.config.max_leases is None else min(self.config.max_leases, capacity)

    def _pick(self, node_id: str | None = None) -> _Host | None:
        if self._leased >= self._cap():
            return None
        free = [
            h
            for h in self._hosts.values()
            if h.ready and h.leased < h.capacity and node_id in (None, h.node_id)
        ]
        # the most free sandboxes; among equals the host that was granted a lease longest ago
        return max(free, key=lambda h: (h.capacity - h.leased, -h.last_grant), default=None)

    def _drop(self, host: _Host, reason: str) -> None:
        """Forget ``host``; call with the lock held."""
        if self._hosts.get(host.node_id) is not host:
            return
        del self._hosts[host.node_id]
        self._leased -= host.leased
        self._lost += 1
        self._last_failure = f"node {host.node_id}: {reason}"
        self._failures[host.node_id] = reason
        if not host.ready:  # it never started: wait before starting another there
            self._retry_after[host.node_id] = time.monotonic() + self.HOST_RETRY_S
        logger.warning("sandbox host on node %s dropped: %s", host.node_id, reason)
        with contextlib.suppress(Exception):
            import_ray().kill(host.handle)
        self._cond.notify_all()

    def _start_host(self, ray: Any, node_id: str) -> _Host:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._started += 1
        name = f"stare-sandbox-host-{node_id[:16]}-{self._started}"
        actor = ray.remote(SandboxHost).options(
            name=name,
            namespace=self.config.namespace,
            num_cpus=0,
            resources={self.config.node_resource: 0.001},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_concurrency=2 * self.config.sandboxes_per_node + 16,
            max_restarts=0,
        )
        me = ray.get_runtime_context().current_actor
        handle = actor.remote(self.config, self.sandbox_config, me, name)
        logger.info("starting sandbox host %s", name)
        return _Host(handle=handle, node_id=node_id, name=name, ready_ref=handle.ready.remote())

    def _check(self, ray: Any, host: _Host) -> None:
        """Mark ``host`` ready once its pool is up; ping it; drop it when it failed."""
        try:
            if not host.ready:
                done, _ = ray.wait([host.ready_ref], timeout=0)
                if done:
                    _, capacity = ray.get(done[0])
                    with self._cond:
                        host.capacity, host.ready = capacity, True
                        self._failures.pop(host.node_id, None)
                        self._cond.notify_all()
                return
            if host.ping_ref is None:
                host.ping_ref, host.ping_sent = host.handle.ping.remote(), time.monotonic()
                return
            done, _ = ray.wait([host.ping_ref], timeout=0)
            if done:
                ray.get(done[0])
                host.ping_ref = None
            elif time.monotonic() - host.ping_sent > self.PING_TIMEOUT_S:
                raise TimeoutError(f"no answer to a ping in {self.PING_TIMEOUT_S:g} s")
        except Exception as exc:  # noqa: BLE001 - any failure of a host drops it
            with self._cond:
                self._drop(host, _one_line(exc))

    def _check_clients(self, ray: Any) -> None:
        """Forget clients whose process is gone without ``close``; when none is left, end the fleet
        (the coordinator is detached: nothing else would end it, its hosts or their containers)."""
        with self._cond:
            clients = list(self._clients.items())
        if not clients:
            return
        gone = []
        for client_id, anchor in clients:
            try:
                ray.get(anchor, timeout=5)
            except ray.exceptions.GetTimeoutError:
                continue  # a busy node: look again next round
            except ray.exceptions.RayError as exc:  # OwnerDiedError: its process exited
                logger.warning("sandbox fleet client %s is gone (%s)", client_id[:8], type(exc).__name__)
                gone.append(client_id)
        if not gone:
            return
        with self._cond:
            for client_id in gone:
                self._clients.pop(client_id, None)
            last = not self._clients
        if last:
            logger.warning("every client of the sandbox fleet is gone: ending it")
            self.shutdown()
            with contextlib.suppress(Exception):
                ray.kill(ray.get_runtime_context().current_actor)

    def _refresh_loop(self) -> None:
        ray = import_ray()
        while not self._stopped:
            try:
                self.refresh()
                self._check_clients(ray)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a failed round
                logger.warning("sandbox fleet refresh failed: %s", exc)
            time.sleep(self.config.refresh_s)


# -------------------------------------------------------------------------------------- client


class RaySandbox(Sandbox):
    """One leased sandbox on a host actor: ``Sandbox``'s verbs as requests on the lease's own
    connection to that host (``stare_sandbox.fleet_wire``), one at a time.

    Made by ``RaySandboxFleet.acquire`` (wrapped in a ``PooledSandbox``); ``close()`` gives the
    lease back. A host that is lost (its connection closed or reset: its actor or node died) or
    does not answer in time raises :class:`SandboxLost`, and so does every later call.
    """

    backend = "ray"

    def __init__(
        self,
        fleet: RaySandboxFleet,
        node_id: str,
        host_name: str,
        host: Any,
        lease_id: str,
        connection: LeaseConnection,
    ) -> None:
        super().__init__(fleet.sandbox_config)
        self.node_id, self.host_name, self.lease_id = node_id, host_name, lease_id
        self._fleet, self._host, self._connection = fleet, host, connection
        self._closed = False

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        limit = self.config.timeout_s if timeout is None else timeout
        return unpack_result(self._call("run", code, timeout, wait_s=limit + self.config.restart_grace_s))

    def reset(self) -> None:
        self._call("reset", wait_s=60.0)

    def is_alive(self) -> bool:
        if self._closed:
            return False
        try:
            return bool(self._call("is_alive", wait_s=10.0))
        except SandboxError:
            return False

    def close(self) -> None:
        """Give the lease back (the sandbox is reset on its host). Idempotent."""
        self._fleet._end_lease(self, broken=False)

    def _call(self, method: str, *args: Any, wait_s: float) -> Any:
        if self._closed:
            raise SandboxClosed("this sandbox's lease was given back: lease a new one from the fleet")
        wait_s += self._fleet.config.call_margin_s
        if self._connection.broken:
            raise SandboxLost(
                f"this lease's connection to the sandbox host on node {self.node_id} broke during an "
                "earlier call: the episode must be played again on a new lease"
            )
        try:
            answer = self._connection.call([method, *args], wait_s)
        except TimeoutError as exc:
            self._fleet._host_failed(self, f"no answer to {method} in {wait_s:g} s")
            raise SandboxLost(
                f"the sandbox host on node {self.node_id} did not answer {method} in {wait_s:g} s: it is "
                "dropped and the episode must be played again; if this repeats, look at that node's "
                "load and raise sandbox.ray.call_margin_s"
            ) from exc
        except (OSError, ValueError) as exc:  # closed or reset (its process died), or garbled
            self._fleet._host_failed(self, f"its connection failed: {type(exc).__name__}")
            raise SandboxLost(
                f"the sandbox host on node {self.node_id} was lost during {method} ({type(exc).__name__}: "
                f"{exc}): the episode must be played again on another host; if nodes keep leaving, "
                "check them with `ray status`"
            ) from exc
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "raised":  # the host's own sandbox failed: as a local pool would raise it
            raise raised_error(answer[1], answer[2])
        self._connection.close()
        self._fleet._host_failed(self, f"{method} failed on it: {answer[1]}")
        raise SandboxLost(
            f"the sandbox host on node {self.node_id} failed during {method} ({answer[1]}): it is "
            "dropped and the episode must be played again on another host"
        )

    def __repr__(self) -> str:
        return f"RaySandbox(node={self.node_id[:12]}, lease={self.lease_id[:8]})"


def coordinator_node(ray: Any, node_resource: str) -> str:
    """The node for a new coordinator: this process's node unless it is a sandbox node, else a node
    without sandboxes (the head first), else this process's node (every node has sandboxes).

    A sandbox node that dies, or misses its heartbeats under load, then costs its own leases only,
    never the coordinator and with it every episode of the fleet.
    """
    here = ray.get_runtime_context().get_node_id()
    plain = [n for n in ray.nodes() if n.get("Alive") and not n.get("Resources", {}).get(node_resource, 0)]
    if not plain or here in {n["NodeID"] for n in plain}:
        return str(here)
    heads = [n for n in plain if "node:__internal_head__" in n.get("Resources", {})]
    return str((heads or plain)[0]["NodeID"])


class RaySandboxFleet:
    """The client of a fleet of sandboxes on a Ray cluster, with a pool's verbs. Thread-safe.

    Building one joins the cluster (``config.address``) unless this process has joined one,
    finds or creates the named coordinator, and waits until at least one host is ready.

    Args:
        config: The fleet's settings.
        sandbox_config: Limits of every sandbox (the first process to create the coordinator sets
            them for the fleet).
        min_hosts: Ready hosts to wait for (up to ``config.start_timeout_s``).

    Raises:
        SandboxUnavailable: Ray is missing, or no host became ready in time (the message says why).
    """

    backend = "ray"

    def __init__(
        self,
        config: RayFleetConfig | None = None,
        sandbox_config: SandboxConfig | None = None,
        *,
        min_hosts: int = 1,
    ) -> None:
        self.config = config or RayFleetConfig()
        self.sandbox_config = sandbox_config or SandboxConfig()
        self.ray = ray = import_ray()
        self._joined = False
        if not ray.is_initialized():
            try:
                ray.init(
                    address=self.config.address, namespace=self.config.namespace, logging_level="WARNING"
                )
            except ConnectionError as exc:
                raise SandboxUnavailable(
                    f"no Ray cluster at sandbox.ray.address={self.config.address!r} ({exc}): start one "
                    "(`ray start --head` on this node, and `ray start --address ... --resources "
                    f"'{{\"{self.config.node_resource}\": 1}}'` on the Docker nodes: docs/deployment.md), "
                    "or set sandbox.ray.address"
                ) from exc
            self._joined = True
        self.lease_timeout = self.config.lease_timeout_s
        self._lock = threading.Lock()
        self._leases: set[PooledSandbox] = set()
        self._handles: dict[str, Any] = {}
        self._releases: list[Any] | None = None  # while close() gives leases back: their calls, to wait for
        self._closed = False
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Pinned (Ray's soft affinity was seen placing it elsewhere): see coordinator_node.
        here = NodeAffinitySchedulingStrategy(coordinator_node(ray, self.config.node_resource), soft=False)
        # Detached: no one process owns it (a non-detached actor ends with the process that created
        # it, under the other processes of the run); its clients do, together (see close()).
        self.client_id = uuid.uuid4().hex
        self._anchor = ray.put(None)  # the coordinator sees this process exit by it
        deadline = time.monotonic() + 30.0
        while True:
            self._coordinator = (
                ray.remote(FleetCoordinator)
                .options(
                    name=COORDINATOR_NAME,
                    namespace=self.config.namespace,
                    get_if_exists=True,
                    lifetime="detached",
                    num_cpus=0,
                    max_concurrency=256,
                    scheduling_strategy=here,
                )
                .remote(self.config, self.sandbox_config)
            )
            with contextlib.suppress(SandboxUnavailable):
                if self._coordinator_call("register", self.client_id, [self._anchor], wait_s=30.0):
                    break
            if time.monotonic() > deadline:  # pragma: no cover - a fleet ending for good
                raise SandboxUnavailable(
                    f"the sandbox fleet's coordinator in namespace {self.config.namespace!r} kept shutting "
                    "down while this process joined it: build the fleet again"
                )
            time.sleep(0.5)  # it was ending (its last client left): its name frees, then a new one
        self._wait_for_hosts(min_hosts)

    @property
    def size(self) -> int:
        """Sandboxes of the ready hosts (the most episodes the fleet plays at once, before the cap)."""
        return self.stats().size

    def _lost_while_leasing(
        self, node: str, name: str, reason: str, deadline: float, exc: BaseException, exhausted: str
    ) -> None:
        """A host failed while being leased: report it, forget its handle, and raise ``PoolExhausted``
        (``exhausted``) once the lease's ``deadline`` has passed; else the caller leases again."""
        self._coordinator.host_failed.remote(node, name, reason)
        with self._lock:
            self._handles.pop(name, None)
        if time.monotonic() >= deadline:
            raise PoolExhausted(exhausted) from exc

    def acquire(self, timeout: float | None = None, *, node_id: str | None = None) -> PooledSandbox:
        """Lease a clean, live sandbox on the host with the most free ones (on the node ``node_id``
        when given: ``stare-agent sandbox doctor --backend ray`` tries each host).

        Raises:
            PoolExhausted: None free within ``timeout`` (default ``lease_timeout``).
            SandboxClosed: The fleet is closed.
        """
        wait_s = self.lease_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait_s
        while True:
            if self._closed:
                raise SandboxClosed("the sandbox fleet is closed: build a new RaySandboxFleet")
            remaining = max(0.001, deadline - time.monotonic())
            node, name = self._coordinator_call("grant", remaining, node_id, wait_s=remaining)
            lease_id = uuid.uuid4().hex
            call_s = remaining + self.config.call_margin_s
            try:
                host = self._host_handle(name)
                ip, port, token = self.ray.get(host.acquire.remote(lease_id, remaining), timeout=call_s)
            except self.ray.exceptions.RayTaskError as exc:
                self._coordinator.returned.remote(node, name)
                if isinstance(exc.cause, PoolExhausted):
                    raise exc.cause from exc
                raise
            except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError, ValueError) as exc:
                # ValueError: no live actor of that name any more
                self._lost_while_leasing(
                    node, name, type(exc).__name__, deadline, exc,
                    f"no sandbox host answered within {wait_s:g} s (last: {type(exc).__name__} on node "
                    f"{node}): check the sandbox nodes with `ray status`",
                )  # fmt: skip
                continue  # that host is lost: lease again on another
            from stare_sandbox.fleet_wire import LeaseConnection

            try:
                connection = LeaseConnection((ip, port), token, min(call_s, 30.0))
            except PermissionError as exc:  # not ours to hold (taken back already): give it back
                host.release.remote(lease_id, False)
                raise SandboxClosed(f"{exc}: lease again") from exc
            except OSError as exc:  # its actor is up but cannot be reached: as a lost host
                host.release.remote(lease_id, False)
                self._lost_while_leasing(
                    node, name, f"its lease port {ip}:{port}: {exc}", deadline, exc,
                    f"no sandbox host could be reached within {wait_s:g} s (last: {exc} at {ip}:{port} "
                    f"on node {node}): the nodes of the Ray cluster must reach each other's ports",
                )  # fmt: skip
                continue
            lease = PooledSandbox(self, RaySandbox(self, node, name, host, lease_id, connection))
            with self._lock:
                self._leases.add(lease)
            return lease

    def release(self, sandbox: PooledSandbox, *, broken: bool = False) -> None:
        """Give a lease back; its host resets (or, ``broken`` or tainted, replaces) the sandbox."""
        if not isinstance(sandbox, PooledSandbox) or sandbox._pool is not self:
            raise ValueError(f"{sandbox!r} was not leased from this fleet: release it where it came from")
        inner, sandbox._inner = sandbox._inner, None
        with self._lock:
            self._leases.discard(sandbox)
        if isinstance(inner, RaySandbox):
            self._end_lease(inner, broken=broken or sandbox.tainted)

    @contextlib.contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[PooledSandbox]:
        """``acquire`` as a context manager that always gives the sandbox back."""
        sandbox = self.acquire(timeout)
        try:
            yield sandbox
        finally:
            self.release(sandbox)

    def stats(self) -> FleetStats:
        return self._coordinator_call("stats", wait_s=30.0)

    def close(self) -> None:
        """Give back this client's leases and leave the fleet; the last client to leave (in any
        process of the run) ends it (its coordinator, hosts and containers). Leave Ray if this fleet
        joined it. Idempotent.

        The coordinator is owned by its clients together, not by the process that created it: a
        rank that closes (or exits) first leaves it to the others; a client whose process dies
        without ``close`` is noticed by the coordinator within seconds, and counts as left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leases, self._leases = list(self._leases), set()
        releases: list[Any] = []
        self._releases = releases
        for lease in leases:
            with contextlib.suppress(Exception):
                self.release(lease)
        with contextlib.suppress(Exception):  # sent before this process may leave Ray below
            self.ray.wait(releases, num_returns=len(releases), timeout=10)
        self._releases = None
        remaining = 1
        with contextlib.suppress(Exception):  # a coordinator already gone has no one left to end
            remaining = self._coordinator_call("unregister", self.client_id, wait_s=30.0)
        if remaining == 0:
            self.shutdown_fleet()
        if self._joined:
            self.ray.shutdown()

    def shutdown_fleet(self) -> None:
        """Close every host's sandboxes and end the coordinator now, for every process that shares
        it (``close`` of the last client does it; this is for a run that ends them all at once)."""
        with contextlib.suppress(Exception):
            self.ray.get(self._coordinator.shutdown.remote(), timeout=90)
        with contextlib.suppress(Exception):
            self.ray.kill(self._coordinator)

    @property
    def closed(self) -> bool:
        return self._closed

    def __copy__(self) -> RaySandboxFleet:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> RaySandboxFleet:
        return self

    def __enter__(self) -> RaySandboxFleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RaySandboxFleet(namespace={self.config.namespace!r}, closed={self._closed})"

    # internals

    def _end_lease(self, sandbox: RaySandbox, *, broken: bool) -> None:
        if sandbox._closed:
            return
        sandbox._closed = True
        with contextlib.suppress(Exception):  # a lost host has nothing to give back (it was dropped)
            ref = sandbox._host.release.remote(sandbox.lease_id, broken)  # the host tells the coordinator
            if self._releases is not None:
                self._releases.append(ref)
        sandbox._connection.close()

    def _host_handle(self, name: str) -> Any:
        """The handle of the host actor ``name``, looked up once per host."""
        with self._lock:
            handle = self._handles.get(name)
        if handle is None:
            handle = self.ray.get_actor(name, namespace=self.config.namespace)
            with self._lock:
                self._handles[name] = handle
        return handle

    def _host_failed(self, sandbox: RaySandbox, reason: str) -> None:
        with self._lock:
            self._handles.pop(sandbox.host_name, None)
        with contextlib.suppress(Exception):
            self._coordinator.host_failed.remote(sandbox.node_id, sandbox.host_name, reason)

    def _coordinator_call(self, method: str, *args: Any, wait_s: float) -> Any:
        try:
            return self.ray.get(
                getattr(self._coordinator, method).remote(*args), timeout=wait_s + self.config.call_margin_s
            )
        except self.ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, SandboxError):
                raise exc.cause from exc
            raise
        except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError) as exc:
            raise SandboxUnavailable(
                f"the sandbox fleet's coordinator ({COORDINATOR_NAME!r} in namespace "
                f"{self.config.namespace!r}) did not answer {method} ({type(exc).__name__}): the process "
                "that created it may have exited; build the fleet again"
            ) from exc

    def _wait_for_hosts(self, min_hosts: int) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while True:
            self._coordinator_call("refresh", wait_s=60.0)
            ready = sum(h.ready for h in self.stats().hosts)
            if ready >= min_hosts:
                return
            if time.monotonic() > deadline:
                stats = self.stats()
                hosts = stats.hosts
                failure = f"; last failure: {stats.last_failure}" if stats.last_failure else ""
                self.close()
                raise SandboxUnavailable(
                    f"{ready} of {min_hosts} sandbox hosts ready after {self.config.start_timeout_s:g} s "
                    f"({len(hosts)} nodes have the resource {self.config.node_resource!r}{failure}): start sandbox "
                    f"nodes with `ray start --address ... --resources '{{\"{self.config.node_resource}\": 1}}'` "
                    "on machines with Docker and the sandbox image (`stare-agent sandbox doctor` says what "
                    "is missing there)"
                )
            time.sleep(0.2)
