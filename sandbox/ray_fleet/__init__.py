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
to its host, opened with a token the host issued for that lease (``stare_sandbox.ray_fleet.wire``), which
costs a fraction of a Ray actor call.

Faults: a host lost mid-call (its actor killed, its node gone: its connection is closed, reset,
or silent past TCP keepalive) raises :class:`SandboxLost`, a ``SandboxError``: the env ends the
episode with ``EpisodeInfrastructureError`` and the rollout plays it again, on a healthy host (the
coordinator drops the lost host; a node that is still alive gets a new one). A call that does not
come back within its timeout plus ``call_margin_s`` raises ``SandboxLost`` too, and costs its own
sandbox only (the host is dropped when it stops answering pings). The leases of a client whose
process died are taken back; a live client's are never taken back for idleness. The coordinator
can die: Ray restarts it (or the next client call makes a new one), and it adopts the hosts,
detached actors that outlive it, with their leases. A node that joins the cluster later gets a
host within ``refresh_s`` and takes new leases.

Ray is optional (``pip install 'stare-agent[ray]'``); this module imports it only when a fleet
is built, so ``import stare_sandbox`` never needs it.
"""

from stare_sandbox.ray_fleet.client import RaySandbox, RaySandboxFleet
from stare_sandbox.ray_fleet.config import (
    COORDINATOR_NAME,
    FleetStats,
    HostStats,
    RayFleetConfig,
    SandboxLost,
    import_ray,
)
from stare_sandbox.ray_fleet.coordinator import FleetCoordinator, coordinator_node
from stare_sandbox.ray_fleet.host import SandboxHost

__all__ = [
    "COORDINATOR_NAME",
    "FleetCoordinator",
    "FleetStats",
    "HostStats",
    "RayFleetConfig",
    "RaySandbox",
    "RaySandboxFleet",
    "SandboxHost",
    "SandboxLost",
    "coordinator_node",
    "import_ray",
]
