"""The fleet's actor on one node: a warm ``SandboxPool`` of the node's Docker daemon, leased by id."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from stare_sandbox.base import Sandbox
from stare_sandbox.config import SandboxConfig
from stare_sandbox.errors import SandboxClosed, SandboxError, SandboxUnavailable
from stare_sandbox.pool import PooledSandbox, SandboxPool
from stare_sandbox.ray_fleet.config import RayFleetConfig, import_ray
from stare_sandbox.ray_fleet.wire import pack_result, raised_answer

logger = logging.getLogger(__name__)


HOST_PREFIX = "stare-sandbox-host-"
"""The names of host actors start with it (in the fleet's namespace): a coordinator adopts them."""


class SandboxHost:
    """The actor on one node: a warm ``SandboxPool`` of the node's daemon, leased by id.

    Run as a threaded, detached Ray actor; Ray carries its leases (``acquire``, ``release``) and
    its health (``ready``, ``ping``, ``adopt``). A lease's calls come on a TCP connection of their
    own (``stare_sandbox.ray_fleet.wire``: ``acquire`` returns the address and the lease's token),
    served by a thread per connection, so calls on different leases run at once. Every container
    start takes a token of the coordinator's creation-rate limit first; the pool starts in the
    background and the host takes leases from its first sandbox on (``ready``), reporting the rest
    as they come (``host_grew``). It outlives its coordinator (the next one adopts it) and ends
    itself when no coordinator has pinged it for ``ORPHAN_S``.
    """

    ORPHAN_S = 120.0
    """A host no coordinator pinged for this long closes its pool and ends (its fleet is gone)."""

    def __init__(
        self, config: RayFleetConfig, sandbox_config: SandboxConfig, coordinator: Any, name: str
    ) -> None:
        ray = import_ray()
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.name = name
        self._leases: dict[str, PooledSandbox] = {}
        self._clients: dict[str, str] = {}  # lease id -> client id
        self._lock = threading.Lock()
        self._coordinator = coordinator
        self._pinged = time.monotonic()
        self._closed = False
        self._start_timeout = config.start_timeout_s
        self._lease_timeout = config.lease_timeout_s
        self._fill_left = config.sandboxes_per_node  # the pool's first starts, in order
        self._first_asked = threading.Event()  # the first start has its token (or failed): others follow
        self._started = 0
        backend = config.node_backend
        self._backend, self._image = backend, sandbox_config.image

        def make() -> Sandbox:
            with self._lock:
                first_fill = self._fill_left == config.sandboxes_per_node
                filling = self._fill_left > 0
                self._fill_left -= 1
            try:
                if filling and not first_fill:  # every host's first sandbox comes before anyone's second
                    self._first_asked.wait(self._start_timeout)
                self._creation_token(None if filling else self._lease_timeout)
            finally:
                if first_fill:
                    self._first_asked.set()
            from stare_sandbox.docker import DockerSandbox
            from stare_sandbox.local import LocalSandbox

            sandbox = DockerSandbox(sandbox_config) if backend == "docker" else LocalSandbox(sandbox_config)
            if filling:
                with self._lock:
                    self._started += 1
                    started = self._started
                with contextlib.suppress(Exception):
                    self._coordinator.host_grew.remote(self.node_id, self.name, started)
            return sandbox

        self._pool = SandboxPool(
            config.sandboxes_per_node, factory=make, lease_timeout=config.lease_timeout_s, wait=False
        )
        from stare_sandbox.ray_fleet.wire import LeaseServer

        self._server = LeaseServer(ray.util.get_node_ip_address(), self._answer, ports=config.port_range())
        threading.Thread(target=self._orphan_watch, name="host-orphan-watch", daemon=True).start()

    def ready(self) -> tuple[str, int]:
        """The node id and the sandboxes started, once the first has (up to ``start_timeout_s``).

        Raises:
            SandboxUnavailable: none started in time; the last start's error when every one failed.
        """
        started = self._pool.wait_started(1, self._start_timeout)
        if not started:
            raise SandboxUnavailable(
                f"no sandbox started on node {self.node_id} in {self._start_timeout:g} s "
                "(sandbox.ray.start_timeout_s): `stare-agent sandbox doctor` on that node says why"
            )
        with self._lock:
            return self.node_id, max(self._started, started)

    def ping(self) -> bool:
        self._pinged = time.monotonic()
        return True

    def adopt(self, coordinator: Any) -> tuple[str, int, dict[str, str]]:
        """A (new) coordinator takes this host over: its node, the sandboxes started, and its leases
        (lease id -> client id)."""
        with self._lock:
            self._coordinator, self._pinged = coordinator, time.monotonic()
            return self.node_id, self._started, dict(self._clients)

    def acquire(self, lease_id: str, client_id: str, timeout: float) -> tuple[str, int, bytes]:
        """Lease a sandbox as ``lease_id`` for ``client_id``: the address its calls go to and the
        lease's token."""
        lease = self._pool.acquire(timeout)
        with self._lock:
            self._leases[lease_id] = lease
            self._clients[lease_id] = client_id
        return (*self._server.address, self._server.admit(lease_id))

    def run(self, lease_id: str, code: str, timeout: float | None) -> tuple[Any, ...]:
        """``ExecResult`` packed (:func:`pack_result`)."""
        return pack_result(self._lease(lease_id).run(code, timeout))

    def reset(self, lease_id: str) -> None:
        self._lease(lease_id).reset()

    def is_alive(self, lease_id: str) -> bool:
        try:
            return self._lease(lease_id).is_alive()
        except SandboxClosed:
            return False

    def release(self, lease_id: str, broken: bool) -> None:
        """End a lease (once: the host, not its holder, tells the coordinator, which counts each lease
        once however often it hears of its end)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            self._clients.pop(lease_id, None)
            coordinator = self._coordinator
        self._server.revoke(lease_id)
        if lease is not None:
            self._pool.release(lease, broken=broken)
            with contextlib.suppress(Exception):
                coordinator.returned.remote(self.node_id, self.name, lease_id)

    def image_id(self) -> str:
        """The id of the sandbox image on this node's daemon (``sandbox doctor`` compares nodes), or
        "" for the local backend or an image the daemon does not have."""
        if self._backend != "docker":
            return ""
        try:
            from stare_sandbox.docker import docker_client

            return str(docker_client().images.get(self._image).id)
        except Exception:  # noqa: BLE001 - unknown: the doctor's other checks say why
            return ""

    def pool_stats(self) -> dict[str, int]:
        return dataclasses.asdict(self._pool.stats())

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self._pool.close()

    def _creation_token(self, timeout: float | None) -> None:
        """Wait for this start's turn at the coordinator; through a coordinator restart, keep asking
        (up to ``ORPHAN_S``)."""
        ray = import_ray()
        deadline = time.monotonic() + self.ORPHAN_S
        while True:
            try:
                ray.get(self._coordinator.take_creation_token.remote(timeout))
                return
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError:
                if time.monotonic() > deadline or self._closed:
                    raise
                time.sleep(1.0)

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

    def _lease(self, lease_id: str) -> PooledSandbox:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise SandboxClosed(
                f"lease {lease_id} is not held on this host (given back, or taken back when its client "
                "was gone): lease a new sandbox"
            )
        return lease

    def _orphan_watch(self) -> None:
        """End this host when no coordinator has pinged it for ``ORPHAN_S`` (its fleet is gone)."""
        while not self._closed:
            time.sleep(5.0)
            if time.monotonic() - self._pinged > self.ORPHAN_S:
                logger.warning(
                    "no sandbox fleet coordinator for %g s: host %s ends", self.ORPHAN_S, self.name
                )
                self.close()
                ray = import_ray()
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_runtime_context().current_actor)
                return
