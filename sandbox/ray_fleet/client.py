"""The fleet as a process that plays episodes uses it: ``RaySandboxFleet``, a pool's verbs over Ray, and
``RaySandbox``, one leased sandbox whose calls go on the lease's own connection to its host."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stare_sandbox.base import Sandbox
from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import PoolExhausted, SandboxClosed, SandboxError, SandboxUnavailable
from stare_sandbox.pool import PooledSandbox
from stare_sandbox.ray_fleet.config import (
    COORDINATOR_NAME,
    FleetStats,
    RayFleetConfig,
    SandboxLost,
    import_ray,
)
from stare_sandbox.ray_fleet.coordinator import FleetCoordinator, coordinator_node
from stare_sandbox.ray_fleet.wire import raised_error, unpack_result
from stare_sandbox.result import ExecResult

if TYPE_CHECKING:
    from stare_sandbox.ray_fleet.wire import LeaseConnection


MAX_COORDINATOR_CALLS = 100_000
"""Calls the coordinator (an asyncio actor) runs at once: every lease that waits is one of them."""


class RaySandbox(Sandbox):
    """One leased sandbox on a host actor: ``Sandbox``'s verbs as requests on the lease's own
    connection to that host (``stare_sandbox.ray_fleet.wire``), one at a time.

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

    def image_id(self) -> str:
        """The id of the sandbox image on its host's node ("" when unknown)."""
        try:
            return str(self._fleet.ray.get(self._host.image_id.remote(), timeout=60))
        except (self._fleet.ray.exceptions.RayError, self._fleet.ray.exceptions.GetTimeoutError):
            return ""

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
            # this sandbox is given back as broken (its host replaces it); the host is dropped only
            # if it stops answering the coordinator's pings, with its other leases
            self._fleet._end_lease(self, broken=True)
            raise SandboxLost(
                f"the sandbox on node {self.node_id} did not answer {method} in {wait_s:g} s: it is "
                "replaced and the episode must be played again; if this repeats, look at that node's "
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

    HEARTBEAT_S = 5.0
    """How often a client tells the coordinator it is here (a restarted coordinator learns its
    clients so, within ``FleetCoordinator.CLIENT_GRACE_S``)."""

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
        self.client_id = uuid.uuid4().hex
        self._anchor = ray.put(None)  # the coordinator sees this process exit by it
        deadline = time.monotonic() + 30.0
        while True:
            self._connect()
            with contextlib.suppress(SandboxUnavailable):
                if self._coordinator_call("register", self.client_id, [self._anchor], wait_s=30.0):
                    break
            if time.monotonic() > deadline:  # pragma: no cover - a fleet ending for good
                raise SandboxUnavailable(
                    f"the sandbox fleet's coordinator in namespace {self.config.namespace!r} kept shutting "
                    "down while this process joined it: build the fleet again"
                )
            time.sleep(0.5)  # it was ending (its last client left): its name frees, then a new one
        self._stop_heartbeat = threading.Event()
        threading.Thread(target=self._heartbeat, name="fleet-heartbeat", daemon=True).start()
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
            node, name, lease_id = self._coordinator_call(
                "grant", self.client_id, remaining, node_id, wait_s=remaining
            )
            remaining = max(0.001, deadline - time.monotonic())
            call_s = remaining + self.config.call_margin_s
            try:
                host = self._host_handle(name)
                ip, port, token = self.ray.get(
                    host.acquire.remote(lease_id, self.client_id, remaining), timeout=call_s
                )
            except self.ray.exceptions.RayTaskError as exc:
                with contextlib.suppress(Exception):
                    self._coordinator.returned.remote(node, name, lease_id)
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
            from stare_sandbox.ray_fleet.wire import LeaseConnection

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
        self._stop_heartbeat.set()
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

    def _connect(self) -> None:
        """The coordinator's handle: the named actor, made here (on :func:`coordinator_node`) when
        there is none (the first client, or the last coordinator died for good)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Pinned (Ray's soft affinity was seen placing it elsewhere): see coordinator_node.
        here = NodeAffinitySchedulingStrategy(
            coordinator_node(self.ray, self.config.node_resource), soft=False
        )
        # Detached: no one process owns it (a non-detached actor ends with the process that created
        # it, under the other processes of the run); its clients do, together (see close()). Ray
        # restarts it where it died; the hosts outlive it and the next incarnation adopts them.
        self._coordinator = (
            self.ray.remote(FleetCoordinator)
            .options(
                name=COORDINATOR_NAME,
                namespace=self.config.namespace,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                max_concurrency=MAX_COORDINATOR_CALLS,
                max_restarts=-1,
                scheduling_strategy=here,
            )
            .remote(self.config, self.sandbox_config)
        )

    def _coordinator_call(self, method: str, *args: Any, wait_s: float) -> Any:
        """``method(*args)`` on the coordinator, answered within ``wait_s`` + ``call_margin_s``.
        A coordinator that died is asked again, with backoff, until then: Ray restarts it, or the
        next :meth:`_connect` makes a new one (either adopts the hosts)."""
        ray = self.ray
        deadline = time.monotonic() + wait_s + self.config.call_margin_s
        backoff = 0.05
        while True:
            try:
                return ray.get(
                    getattr(self._coordinator, method).remote(*args),
                    timeout=max(0.01, deadline - time.monotonic()),
                )
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, SandboxError):
                    raise exc.cause from exc
                raise
            except ray.exceptions.RayActorError as exc:  # died, restarting, or gone for good
                if time.monotonic() + backoff > deadline:
                    raise self._unreachable(method, exc) from exc
                time.sleep(backoff)
                backoff = min(2 * backoff, 2.0)
                with contextlib.suppress(Exception):
                    self._connect()
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                raise self._unreachable(method, exc) from exc

    def _unreachable(self, method: str, exc: BaseException) -> SandboxUnavailable:
        return SandboxUnavailable(
            f"the sandbox fleet's coordinator ({COORDINATOR_NAME!r} in namespace {self.config.namespace!r}) "
            f"did not answer {method} ({type(exc).__name__}) within its deadline: look at the Ray cluster's "
            "head node (`ray status`); the fleet takes its hosts back when a coordinator answers again"
        )

    def _heartbeat(self) -> None:
        """Register again every ``HEARTBEAT_S`` (a restarted coordinator forgot this client)."""
        while not self._stop_heartbeat.wait(self.HEARTBEAT_S):
            with contextlib.suppress(Exception):
                self.ray.get(
                    self._coordinator.register.remote(self.client_id, [self._anchor]),
                    timeout=self.HEARTBEAT_S,
                )

    def _wait_for_hosts(self, min_hosts: int) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        # one refresh starts the hosts now; later ones are the coordinator's own, every refresh_s (a
        # refresh per poll from every rank that starts at once would queue on its lock)
        self._coordinator_call("refresh", wait_s=60.0)
        while True:
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
