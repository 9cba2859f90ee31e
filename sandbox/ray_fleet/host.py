"""The fleet's actor on one node: a warm ``SandboxPool`` of the node's Docker daemon, leased by id."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from stare_sandbox.base import Sandbox
from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import SandboxClosed, SandboxError
from stare_sandbox.pool import PooledSandbox, SandboxPool
from stare_sandbox.ray_fleet.config import RayFleetConfig, import_ray
from stare_sandbox.ray_fleet.wire import pack_result, raised_answer

logger = logging.getLogger(__name__)


class SandboxHost:
    """The actor on one node: a warm ``SandboxPool`` of the node's daemon, leased by id.

    Run as a threaded Ray actor; Ray carries its leases (``acquire``, ``release``) and its health
    (``ready``, ``ping``). A lease's calls come on a TCP connection of their own
    (``stare_sandbox.ray_fleet.wire``: ``acquire`` returns the address and the lease's token), served by a
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
        from stare_sandbox.ray_fleet.wire import LeaseServer

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
        """The answer to a request on ``lease_id``'s connection (``stare_sandbox.ray_fleet.wire``)."""
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
            return raised_answer(exc)
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
