"""Isolated, stateful Python execution: a Jupyter kernel in a hardened container (or, weaker, a
local process), one ``Sandbox`` interface, and a pool of warm sandboxes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from sandbox.base import Sandbox
from sandbox.config import DEFAULT_IMAGE, SandboxConfig
from sandbox.docker import DockerSandbox, docker_client
from sandbox.errors import SandboxClosed, SandboxError, SandboxUnavailable
from sandbox.local import LocalSandbox
from sandbox.pool import PoolBackend, SandboxPool
from sandbox.result import ExecError, ExecResult

if TYPE_CHECKING:
    from sandbox.ray_fleet import RayFleetConfig, RaySandboxFleet

__all__ = [
    "DEFAULT_IMAGE",
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


def docker_available(image: str = DEFAULT_IMAGE) -> bool:
    """True when a Docker daemon answers and ``image`` is present."""
    try:
        client = docker_client(timeout=5)
        try:
            client.images.get(image)
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False
    return True


def resolve_backend(
    backend: Literal["auto", "docker", "local"], config: SandboxConfig | None = None
) -> Literal["docker", "local"]:
    """The concrete backend for ``backend``: ``"auto"`` is ``"docker"`` when a daemon answers and
    the image is present, else ``"local"``. Resolve once per run (``SandboxPool`` does): a Docker
    hiccup later on must be an error, never model code started on the host instead.

    Raises:
        ValueError: unknown ``backend``.
    """
    if backend == "auto":
        return "docker" if docker_available((config or SandboxConfig()).image) else "local"
    if backend in ("docker", "local"):
        return backend
    raise ValueError(f"unknown sandbox backend {backend!r}: use 'auto', 'docker' or 'local'")


def open_pool(
    size: int,
    backend: PoolBackend = "auto",
    config: SandboxConfig | None = None,
    *,
    fleet: RayFleetConfig | None = None,
) -> SandboxPool | RaySandboxFleet:
    """What episodes lease their sandboxes from: a ``SandboxPool`` of ``size`` warm sandboxes on
    this machine, or, for ``"ray"``, the client of the sandbox fleet of a Ray cluster
    (``sandbox.ray_fleet``; ``size`` is then what the caller leases at once, and ``fleet`` where
    and how many the cluster runs). Both have the verbs ``acquire``, ``release``, ``lease``,
    ``stats`` and ``close``.

    Raises:
        ValueError: unknown ``backend``.
        SandboxUnavailable: the backend cannot be used here (the message says why and the fix).
    """
    if backend == "ray":
        from sandbox.ray_fleet import RaySandboxFleet

        return RaySandboxFleet(fleet, config)
    return SandboxPool(size, backend=backend, config=config)


def make_sandbox(
    backend: Literal["auto", "docker", "local"] = "auto", config: SandboxConfig | None = None
) -> Sandbox:
    """A started sandbox. ``"auto"`` is Docker when a daemon answers and the image is present,
    else the local backend (which warns that its isolation is weaker); see ``resolve_backend``.

    Raises:
        ValueError: unknown ``backend``.
        SandboxUnavailable: ``"docker"`` was asked for and cannot be used (the message says why).
    """
    config = config or SandboxConfig()
    if resolve_backend(backend, config) == "docker":
        return DockerSandbox(config)
    return LocalSandbox(config)
