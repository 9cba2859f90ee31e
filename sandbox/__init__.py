"""Isolated, stateful Python execution: a Jupyter kernel in a hardened container (or, weaker, a
local process), one ``Sandbox`` interface, and a pool of warm sandboxes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stare_sandbox.backends import docker_available, make_sandbox, resolve_backend
from stare_sandbox.base import Sandbox
from stare_sandbox.config import BACKENDS, DEFAULT_IMAGE, Backend, SandboxConfig
from stare_sandbox.docker import DockerSandbox
from stare_sandbox.errors import SandboxClosed, SandboxError, SandboxUnavailable
from stare_sandbox.local import LocalSandbox
from stare_sandbox.pool import SandboxPool
from stare_sandbox.result import ExecError, ExecResult

if TYPE_CHECKING:
    from stare_sandbox.ray_fleet import RayFleetConfig, RaySandboxFleet

__all__ = [
    "BACKENDS",
    "DEFAULT_IMAGE",
    "Backend",
    "DockerSandbox",
    "ExecError",
    "ExecResult",
    "LocalSandbox",
    "Sandbox",
    "SandboxClosed",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "SandboxUnavailable",
    "docker_available",
    "make_sandbox",
    "open_pool",
    "resolve_backend",
]


def open_pool(
    size: int,
    backend: Backend = "auto",
    config: SandboxConfig | None = None,
    *,
    fleet: RayFleetConfig | None = None,
) -> SandboxPool | RaySandboxFleet:
    """What episodes lease their sandboxes from: a ``SandboxPool`` of ``size`` warm sandboxes on
    this machine, or, for ``"ray"``, the client of the sandbox fleet of a Ray cluster
    (``stare_sandbox.ray_fleet``; ``size`` is then what the caller leases at once, and ``fleet`` where
    and how many the cluster runs). Both have the verbs ``acquire``, ``release``, ``lease``,
    ``stats`` and ``close``.

    Raises:
        ValueError: unknown ``backend``.
        SandboxUnavailable: the backend cannot be used here (the message says why and the fix).
    """
    if backend == "ray":
        from stare_sandbox.ray_fleet import RaySandboxFleet

        return RaySandboxFleet(fleet, config)
    return SandboxPool(size, backend=backend, config=config)
