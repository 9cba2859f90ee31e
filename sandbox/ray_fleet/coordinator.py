"""The fleet's one named actor: it places leases on hosts, holds the cluster-wide lease cap and the
container-creation rate limit, and looks for new and lost nodes, hosts and clients."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import PoolExhausted
from stare_sandbox.ray_fleet.config import FleetStats, HostStats, RayFleetConfig, import_ray
from stare_sandbox.ray_fleet.host import SandboxHost

logger = logging.getLogger(__name__)


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
