"""Limits and options of a sandbox, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_IMAGE = "stare-sandbox:0.1"


@dataclass
class SandboxConfig:
    """Resource limits and options. Every field applies to the Docker backend; the local backend
    applies those it can (memory, CPU time, processes, file size, work dir).

    Attributes:
        image: Docker image built by ``stare-agent sandbox build``.
        memory_mb: Memory limit; Docker's memory+swap is set to the same value (no swap).
        cpus: CPU quota in cores (Docker ``nano_cpus``).
        pids_limit: Maximum processes/threads inside the sandbox (fork bombs stop here).
        tmpfs_mb: Size of the writable work dir ``/work`` (the root filesystem is read-only).
        timeout_s: Default per-call timeout.
        max_output_chars: Cap on stdout and on stderr of one call; the rest is cut with a marker.
        network: Docker network mode; ``"none"`` gives the sandbox only a loopback interface.
        user: User the kernel runs as inside the container.
        restart_grace_s: Extra time allowed to interrupt or restart a kernel after a timeout.
        env: Extra environment variables inside the sandbox (the host's are never passed).
    """

    image: str = DEFAULT_IMAGE
    memory_mb: int = 1024
    cpus: float = 1.0
    pids_limit: int = 128
    tmpfs_mb: int = 256
    timeout_s: float = 10.0
    max_output_chars: int = 16_384
    network: str = "none"
    user: str = "1000:1000"
    restart_grace_s: float = 2.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("memory_mb", "cpus", "pids_limit", "tmpfs_mb", "timeout_s", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
