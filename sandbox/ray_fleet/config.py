"""What a Ray sandbox fleet is configured with and reports: its config, its stats, its one error of its
own, and Ray's import (optional: ``pip install 'stare-agent[ray]'``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stare_sandbox.errors import SandboxError, SandboxUnavailable

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
        start_timeout_s: How long building a fleet waits for its first ready host (and a host for
            its first sandbox).
        lease_ports: The TCP ports hosts listen on for their leases' calls, ``"FIRST-LAST"`` (each
            host takes the first free one: open this range between the nodes), or None for any port
            the system gives.
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
    start_timeout_s: float = 300.0
    lease_ports: str | None = None

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
        if self.lease_ports is not None:
            self.port_range()
        if not self.node_resource:
            raise ValueError("sandbox.ray.node_resource must name a Ray resource, e.g. 'stare_sandbox'")

    def port_range(self) -> range | None:
        """``lease_ports`` as a range (None: any port)."""
        if self.lease_ports is None:
            return None
        first, sep, last = str(self.lease_ports).partition("-")
        try:
            lo, hi = int(first), int(last if sep else first)
        except ValueError:
            lo = hi = -1
        if not 1024 <= lo <= hi <= 65535:
            raise ValueError(
                f"sandbox.ray.lease_ports must be 'FIRST-LAST' with 1024 <= FIRST <= LAST <= 65535, "
                f"e.g. '20000-20099', got {self.lease_ports!r}"
            )
        return range(lo, hi + 1)


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
        waiting: Leases waiting for a free sandbox now.
        reclaimed: Leases taken back because their client's process was gone.
        restarted: Whether this coordinator is a restart of one that died (Ray restarted it).
        adopted: Hosts this coordinator took over from an earlier one, with their leases.
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
    waiting: int = 0
    reclaimed: int = 0
    restarted: bool = False
    adopted: int = 0

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
