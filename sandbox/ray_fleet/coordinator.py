"""The fleet's one named actor: it places leases on hosts, holds the cluster-wide lease cap and the
container-creation rate limit, and looks for new and lost nodes, hosts and clients.

It is an asyncio actor: a lease waiting for a free sandbox, or a host waiting for its creation
token, is a parked coroutine, not a thread, so thousands of waiters cost nothing and never keep a
``returned`` or a ``ping`` from running. Waiters are served first come, first served. It can die
and come back (Ray restarts it in place; a client that finds it gone for good makes a new one): the
hosts are detached actors that outlive it, and each new incarnation adopts the hosts it finds in
its namespace and the leases they hold, so nothing is lost but the grants in flight, which their
clients ask for again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import PoolExhausted, SandboxClosed
from stare_sandbox.ray_fleet.config import FleetStats, HostStats, RayFleetConfig, import_ray
from stare_sandbox.ray_fleet.host import HOST_PREFIX, SandboxHost

logger = logging.getLogger(__name__)

MAX_CREATIONS_KEPT = 4096
"""Creation times ``stats`` reports (the latest ones)."""


@dataclass
class _Host:
    handle: Any
    node_id: str
    name: str
    capacity: int = 0
    ready: bool = False
    leases: dict[str, str] = field(default_factory=dict)  # lease id -> client id
    last_grant: float = 0.0
    watcher: Any = None  # its asyncio task: ready, then pings

    @property
    def leased(self) -> int:
        return len(self.leases)


@dataclass
class _Waiter:
    future: asyncio.Future[tuple[str, str, str]]
    client_id: str
    node_id: str | None


class FleetCoordinator:
    """The named actor that places leases, caps them and rate-limits container starts.

    Run as an asyncio Ray actor (every method below is a coroutine); a task of its own looks for new
    and lost nodes, hosts and clients every ``refresh_s``.
    """

    PING_TIMEOUT_S = 30.0
    """A host that leaves a ping unanswered this long is dropped (and started anew)."""

    PING_EVERY_S = 5.0
    """How often each host is pinged (a host actor that dies is noticed at once anyway: Ray fails its
    pending ping); at 100 hosts, 20 calls a second."""

    HOST_RETRY_S = 10.0
    """After a host failed to start on a node, how long before another is started there."""

    CLIENT_GRACE_S = 30.0
    """After this coordinator started, how long clients have to register (again: a restart forgets
    them; they register every ``RaySandboxFleet.HEARTBEAT_S``) before a lease whose client is not
    registered is taken for its dead client's and taken back."""

    def __init__(self, config: RayFleetConfig, sandbox_config: SandboxConfig) -> None:
        self.config, self.sandbox_config = config, sandbox_config
        self._hosts: dict[str, _Host] = {}
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._peak = self._leases = self._lost = self._reclaimed = 0
        self._tokens = float(config.creation_burst)
        self._token_time = time.monotonic()
        self._creations: collections.deque[float] = collections.deque(maxlen=MAX_CREATIONS_KEPT)
        self._last_failure = ""
        self._retry_after: dict[str, float] = {}
        self._stopped = False
        self._clients: dict[str, Any] = {}  # client id -> an object its process owns (alive while it is)
        self._failures: dict[str, str] = {}  # node id -> why its last host was dropped, until one is ready
        self._born = time.monotonic()
        with warnings.catch_warnings():  # Ray's own property warns of an API it uses inside
            warnings.simplefilter("ignore", DeprecationWarning)
            self._restarted = bool(import_ray().get_runtime_context().was_current_actor_reconstructed)
        self._adopted = 0
        self._task: asyncio.Task[None] | None = None
        self._refresh_lock: asyncio.Lock | None = None
        self._adoption: asyncio.Event | None = None
        with contextlib.suppress(RuntimeError):  # Ray runs an asyncio actor's __init__ on its loop
            self._start()

    def _start(self) -> None:
        """Start the refresh task on the actor's event loop (in ``__init__``, or at the first call
        where ``__init__`` runs outside it)."""
        if self._task is None:
            self._refresh_lock = asyncio.Lock()
            self._adoption = asyncio.Event()  # set once the hosts an earlier coordinator left are adopted
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop())

    # clients

    async def register(self, client_id: str, anchor: list[Any]) -> bool:
        """A client joins, or says again that it is here (every ``HEARTBEAT_S``: a restarted
        coordinator learns its clients so): ``anchor`` holds an ``ObjectRef`` its process owns, which
        fails to resolve once that process is gone. False when the fleet is shutting down."""
        self._start()
        if self._stopped:
            return False
        self._clients[client_id] = anchor[0]
        return True

    async def unregister(self, client_id: str) -> int:
        """A client left (its ``close``); the clients that remain (at 0, the caller ends the fleet)."""
        self._start()
        self._clients.pop(client_id, None)
        self._reclaim(lambda c: c == client_id)
        return len(self._clients)

    # leases

    async def grant(self, client_id: str, timeout: float, node_id: str | None = None) -> tuple[str, str, str]:
        """A ready host with a free sandbox (on ``node_id`` when given), booked for ``client_id``:
        ``(node_id, host name, lease id)`` (the host actor's name: a handle costs more to send than the
        rest of a lease). Waits up to ``timeout``, behind the leases that asked before.

        Raises:
            PoolExhausted: none in time (the message says how many are leased and what the cap is).
        """
        self._start()
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), client_id, node_id)
        self._waiters.append(waiter)
        self._dispatch()
        if not waiter.future.done():
            try:
                await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                if not waiter.future.cancelled():
                    raise  # this call itself was cancelled
        if waiter.future.cancelled():  # shutdown() ended the wait
            raise SandboxClosed("the sandbox fleet is shutting down: build it again to lease")
        if waiter.future.done():
            return waiter.future.result()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        waiter.future.cancel()
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
            f"no sandbox free after {timeout:g} s ({self._leased()} leased of a cap of {self._cap()} on "
            f"{len(ready)} hosts, {len(self._waiters)} more waiting): give leases back at the end of each "
            "episode, or add sandbox nodes, or raise sandbox.ray.sandboxes_per_node / max_leases"
        )

    async def returned(self, node_id: str, name: str, lease_id: str) -> None:
        """The lease ``lease_id`` on the host ``name`` ended (a lease ended before, or on a host
        dropped since, is ignored: each lease counts once)."""
        self._start()
        host = self._hosts.get(node_id)
        if host is not None and host.name == name and host.leases.pop(lease_id, None) is not None:
            self._dispatch()

    async def host_failed(self, node_id: str, name: str, reason: str) -> None:
        """A client saw the host ``name`` fail: drop it (its leases with it); the next refresh starts a
        new host on the node if the node is still alive."""
        self._start()
        host = self._hosts.get(node_id)
        if host is not None and host.name == name:  # else dropped before (another client saw it first)
            self._drop(host, reason)

    async def host_grew(self, node_id: str, name: str, capacity: int) -> None:
        """The host ``name`` has ``capacity`` sandboxes started (it takes leases from the first one)."""
        self._start()
        host = self._hosts.get(node_id)
        if host is None or host.name != name or capacity <= host.capacity:
            return
        host.capacity, host.ready = capacity, True
        self._failures.pop(node_id, None)
        self._dispatch()

    async def take_creation_token(self, timeout: float | None) -> float:
        """A token of the creation-rate limit (a bucket of ``creation_burst`` tokens that fills at
        ``creations_per_s``): returns when it is this caller's turn, the seconds it waited. Tokens
        are reserved in the order asked, so N starts take N / ``creations_per_s`` however many
        hosts ask at once; ``timeout`` None waits for its turn however late it is (a host's first
        fill), else a turn further off than ``timeout`` is refused at once.

        Raises:
            PoolExhausted: its turn is more than ``timeout`` seconds off.
        """
        self._start()
        rate = self.config.creations_per_s
        now = time.monotonic()
        self._tokens = min(float(self.config.creation_burst), self._tokens + (now - self._token_time) * rate)
        self._token_time = now
        wait = max(0.0, (1.0 - self._tokens) / rate)
        if timeout is not None and wait > timeout:
            raise PoolExhausted(
                f"no container-creation token within {timeout:g} s ({wait:.0f} s of starts are booked "
                f"ahead at sandbox.ray.creations_per_s={rate:g}): raise it, or the lease timeout"
            )
        self._tokens -= 1.0  # booked now: the next caller's turn is 1 / rate later
        self._creations.append(now + wait)
        if wait:
            await asyncio.sleep(wait)
        return wait

    async def stats(self) -> FleetStats:
        self._start()
        return FleetStats(
            hosts=tuple(
                HostStats(node_id=h.node_id, capacity=h.capacity, leased=h.leased, ready=h.ready)
                for h in self._hosts.values()
            ),
            leased=self._leased(),
            peak_leased=self._peak,
            max_leases=self._cap(),
            leases=self._leases,
            hosts_lost=self._lost,
            creations=tuple(self._creations),
            last_failure=self._last_failure,
            coordinator_node=import_ray().get_runtime_context().get_node_id(),
            clients=len(self._clients),
            failures=tuple(self._failures.items()),
            waiting=len(self._waiters),
            reclaimed=self._reclaimed,
            restarted=self._restarted,
            adopted=self._adopted,
        )

    async def refresh(self) -> None:
        """Start hosts on new sandbox nodes, drop the hosts of nodes that left."""
        self._start()
        ray = import_ray()
        assert self._refresh_lock is not None and self._adoption is not None
        # never before adoption: a host started on a node whose old host is not adopted yet would
        # make two, and the old one (with its leases) would be ended
        await asyncio.wait_for(self._adoption.wait(), self.PING_TIMEOUT_S * 2)
        async with self._refresh_lock:
            nodes = await asyncio.to_thread(ray.nodes)
            alive = {
                n["NodeID"]
                for n in nodes
                if n.get("Alive") and n.get("Resources", {}).get(self.config.node_resource, 0) > 0
            }
            if self._stopped:
                return
            for node_id, host in list(self._hosts.items()):
                if node_id not in alive:
                    self._drop(host, "its node left the cluster")
            now = time.monotonic()
            for node_id in alive:
                if node_id not in self._hosts and self._retry_after.get(node_id, 0.0) <= now:
                    self._start_host(ray, node_id)

    async def shutdown(self) -> None:
        """Close every host's pool (its containers) and end the host actors."""
        ray = import_ray()
        self._stopped = True
        hosts, self._hosts = list(self._hosts.values()), {}
        for waiter in self._waiters:
            waiter.future.cancel()
        self._waiters.clear()
        refs = [h.handle.close.remote() for h in hosts]
        for host in hosts:
            if host.watcher is not None:
                host.watcher.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), 60)
        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host.handle)

    # internals

    def _leased(self) -> int:
        return sum(h.leased for h in self._hosts.values())

    def _cap(self) -> int:
        capacity = sum(h.capacity for h in self._hosts.values() if h.ready)
        return capacity if self.config.max_leases is None else min(self.config.max_leases, capacity)

    def _pick(self, node_id: str | None, leased: int, cap: int) -> _Host | None:
        if leased >= cap:
            return None
        free = [
            h
            for h in self._hosts.values()
            if h.ready and h.leased < h.capacity and node_id in (None, h.node_id)
        ]
        # the most free sandboxes; among equals the host that was granted a lease longest ago
        return max(free, key=lambda h: (h.capacity - h.leased, -h.last_grant), default=None)

    def _dispatch(self) -> None:
        """Book free sandboxes for the waiters, first come first served (one asking for a node
        without a free sandbox lets the next one by)."""
        if not self._waiters:
            return
        leased, cap = self._leased(), self._cap()
        served: list[_Waiter] = []
        for waiter in self._waiters:
            if leased >= cap:
                break
            if waiter.future.done():  # timed out or cancelled: its grant returns by itself
                served.append(waiter)
                continue
            host = self._pick(waiter.node_id, leased, cap)
            if host is None:
                if waiter.node_id is None:
                    break  # nothing free anywhere
                continue
            lease_id = uuid.uuid4().hex
            host.leases[lease_id] = waiter.client_id
            host.last_grant = time.monotonic()
            leased += 1
            self._leases += 1
            self._peak = max(self._peak, leased)
            waiter.future.set_result((host.node_id, host.name, lease_id))
            served.append(waiter)
        for waiter in served:
            self._waiters.remove(waiter)

    def _reclaim(self, gone: Any) -> None:
        """Take back every lease whose client ``gone(client_id)`` says is gone: the host replaces its
        sandbox (its state is unknown) and the cap's slot frees."""
        freed = 0
        for host in self._hosts.values():
            for lease_id, client_id in list(host.leases.items()):
                if gone(client_id):
                    del host.leases[lease_id]
                    freed += 1
                    with contextlib.suppress(Exception):
                        host.handle.release.remote(lease_id, True)
        if freed:
            self._reclaimed += freed
            logger.warning("%d leases of gone clients taken back", freed)
            self._dispatch()

    def _drop(self, host: _Host, reason: str) -> None:
        """Forget ``host`` and end its actor; its leases are lost with it."""
        if self._hosts.get(host.node_id) is not host:
            return
        del self._hosts[host.node_id]
        self._lost += 1
        self._last_failure = f"node {host.node_id}: {reason}"
        self._failures[host.node_id] = reason
        if not host.ready:  # it never started: wait before starting another there
            self._retry_after[host.node_id] = time.monotonic() + self.HOST_RETRY_S
        logger.warning("sandbox host on node %s dropped: %s", host.node_id, reason)
        if host.watcher is not None and host.watcher is not asyncio.current_task():
            host.watcher.cancel()
        with contextlib.suppress(Exception):
            import_ray().kill(host.handle)
        self._dispatch()  # a cap set below the fleet's size may have room elsewhere

    def _start_host(self, ray: Any, node_id: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = f"{HOST_PREFIX}{node_id[:16]}-{uuid.uuid4().hex[:8]}"
        actor = ray.remote(SandboxHost).options(
            name=name,
            namespace=self.config.namespace,
            # detached: it outlives a coordinator that dies (the next one adopts it); it ends itself
            # when no coordinator has pinged it for SandboxHost.ORPHAN_S
            lifetime="detached",
            num_cpus=0,
            resources={self.config.node_resource: 0.001},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            max_concurrency=2 * self.config.sandboxes_per_node + 16,
            max_restarts=0,
        )
        me = ray.get_runtime_context().current_actor
        handle = actor.remote(self.config, self.sandbox_config, me, name)
        logger.info("starting sandbox host %s", name)
        self._add(_Host(handle=handle, node_id=node_id, name=name))

    def _add(self, host: _Host) -> None:
        self._hosts[host.node_id] = host
        host.watcher = asyncio.get_running_loop().create_task(self._watch(host))

    async def _watch(self, host: _Host) -> None:
        """Mark ``host`` ready once its first sandbox is up (``host_grew`` tells the rest), then
        ping it every ``refresh_s``; drop it when it fails or leaves a ping unanswered."""
        try:
            if not host.ready:
                _, capacity = await host.handle.ready.remote()
                if self._hosts.get(host.node_id) is host and capacity > host.capacity:
                    host.capacity, host.ready = capacity, True
                    self._failures.pop(host.node_id, None)
                    self._dispatch()
            while self._hosts.get(host.node_id) is host:
                try:
                    await asyncio.wait_for(host.handle.ping.remote(), self.PING_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"no answer to a ping in {self.PING_TIMEOUT_S:g} s") from None
                await asyncio.sleep(self.PING_EVERY_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a host drops it
            self._drop(host, _one_line(exc))

    async def _adopt(self, ray: Any) -> None:
        """Take over the hosts an earlier coordinator of this namespace left (a restart, or a new
        coordinator after one that died for good), with their leases."""
        namespace = self.config.namespace
        named = await asyncio.to_thread(ray.util.list_named_actors, True)
        names = [
            a["name"] for a in named if a["namespace"] == namespace and a["name"].startswith(HOST_PREFIX)
        ]
        me = ray.get_runtime_context().current_actor
        for name in names:
            try:
                handle = await asyncio.to_thread(ray.get_actor, name, namespace)
                node_id, capacity, leases = await asyncio.wait_for(
                    handle.adopt.remote(me), self.PING_TIMEOUT_S
                )
            except Exception as exc:  # noqa: BLE001 - a host that cannot be adopted is ended
                logger.warning("sandbox host %s not adopted: %s", name, _one_line(exc))
                with contextlib.suppress(Exception):
                    ray.kill(await asyncio.to_thread(ray.get_actor, name, namespace))
                continue
            if node_id in self._hosts:  # two on one node: keep the first
                with contextlib.suppress(Exception):
                    ray.kill(handle)
                continue
            self._adopted += 1
            self._add(
                _Host(handle=handle, node_id=node_id, name=name, capacity=capacity, ready=capacity > 0,
                      leases=dict(leases))
            )  # fmt: skip
            self._leases += len(leases)
        if self._adopted:
            logger.warning("sandbox fleet coordinator adopted %d hosts", self._adopted)
            self._dispatch()  # leases that asked before the hosts were known

    async def _check_clients(self, ray: Any) -> None:
        """Forget clients whose process is gone without ``close`` and take their leases back; when
        none is left, end the fleet (the coordinator is detached: nothing else would end it, its hosts
        or their containers)."""
        clients = list(self._clients.items())
        answers = await asyncio.gather(
            *(asyncio.wait_for(anchor, 5) for _, anchor in clients), return_exceptions=True
        )  # at once: a slow node must not hold up the others' round
        gone = []
        for (client_id, _), answer in zip(clients, answers, strict=True):
            if isinstance(answer, ray.exceptions.RayError):  # OwnerDiedError: its process exited
                logger.warning("sandbox fleet client %s is gone (%s)", client_id[:8], type(answer).__name__)
                gone.append(client_id)
            # a timeout (a busy node) is looked at again next round
        for client_id in gone:
            self._clients.pop(client_id, None)
        settled = time.monotonic() - self._born > self.CLIENT_GRACE_S
        if gone or settled:
            self._reclaim(lambda c: c not in self._clients if settled else c in gone)
        # the last client gone; or, after a restart, none came back in the grace period
        if (gone and not self._clients) or (
            settled and not self._clients and (self._restarted or self._adopted)
        ):
            logger.warning("every client of the sandbox fleet is gone: ending it")
            await self.shutdown()
            with contextlib.suppress(Exception):
                ray.kill(ray.get_runtime_context().current_actor)

    async def _refresh_loop(self) -> None:
        ray = import_ray()
        try:
            await self._adopt(ray)
        except Exception as exc:  # noqa: BLE001 - a fleet without the old hosts still works
            logger.warning("sandbox fleet coordinator could not look for hosts to adopt: %s", exc)
        finally:
            assert self._adoption is not None
            self._adoption.set()
        while not self._stopped:
            try:
                await self.refresh()
                await self._check_clients(ray)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive a failed round
                logger.warning("sandbox fleet refresh failed: %s", exc)
            await asyncio.sleep(self.config.refresh_s)


# -------------------------------------------------------------------------------------- client


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
