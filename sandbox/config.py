"""Limits and options of a sandbox, shared by every backend."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, get_args

DEFAULT_IMAGE = "stare-sandbox:0.3"

Backend = Literal["auto", "docker", "local", "ray"]
"""Where sandboxes run: ``docker`` (a hardened container), ``local`` (a kernel process on this host:
weaker isolation), ``auto`` (Docker when a daemon answers and the image is present, else local;
``stare_sandbox.resolve_backend``), or ``ray`` (the Docker nodes of a Ray cluster; ``stare_sandbox.open_pool``)."""

BACKENDS: tuple[Backend, ...] = get_args(Backend)
"""Every :data:`Backend`, in its declared order."""

SANDBOX_UIDS = range(61000, 62000)
"""uids (each with the same gid) that sandbox kernels run as, one per live sandbox on a host
(``stare_sandbox.uids``): above the login-user range (``UID_MAX`` 60000), so no real user's files or
processes are theirs, and none of them is the host user's (a kernel with the host user's uid would own
its connection dir and could unlock it). The image's default user is the first."""

HASH_SEED = "0"
"""``PYTHONHASHSEED`` of every sandbox: a set of strings prints in the same order in every sandbox
and every run, so a seeded run sees the same tool output (hash flooding is no threat from code that
may already use the whole sandbox)."""

RANDOM_SEED = 0
"""Seed of the ``random`` module in every kernel, at its start and at each reset, and of
``numpy.random``'s global generator where numpy is imported by then (``SandboxConfig.preload``;
in a local kernel also after an earlier episode imported it): code that draws from them without
seeding prints the same in every sandbox and run. Where numpy is imported later (in the Docker
sandbox without a preload), or by ``numpy.random.default_rng()`` without a seed, it draws from
the OS."""

PRELOAD_MATH = ("numpy", "sympy")
"""What ``preload`` lists for a model whose code imports the modules the code tool's description
offers (the ReTool configs for Qwen2.5 set it): an episode's first ``import numpy, sympy``
otherwise costs about 0.2 s of CPU time (its call's ``cpu_timeout_s`` included), since each
episode's kernel in the Docker sandbox is a fresh fork; the fork of a bigger warden costs every
episode a few ms of CPU more (``benchmarks/sandbox_latency.py``), so it pays once more than a few
percent of episodes import them."""

MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""A dotted module name: what ``preload`` accepts (it reaches the sandbox's Python as code)."""

SHARED_NETWORK_MODES = ("host", "container:")
"""Docker network modes that share another namespace's network: refused."""


KERNEL_OUTPUT_CHARS = 2**21
"""Most characters of stdout (and of stderr) a kernel sends from the start of one cell to the start of
the next; the rest is dropped in the kernel, with a line saying so (``sandbox/cells/streams.py``). It
bounds what the kernel holds for a host that is not reading (between calls) at about 25 MB, and is
the largest ``max_output_chars``."""


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
        timeout_s: Default per-call wall-clock timeout.
        cpu_timeout_s: Per-call CPU-time limit, or None for none: the call is interrupted once the
            sandbox's processes used this many CPU seconds since it began, read on the host (the
            container's cgroup; locally, the kernel and the children it reaped), while
            ``timeout_s`` stays the wall-clock limit. Wall time grows when other sandboxes or an
            engine share the cores, CPU time does not, so with this limit (and a ``timeout_s``
            well above it) whether a call times out does not depend on the machine's load: set
            it when runs must reproduce. Where CPU time cannot be read (a remote Docker daemon)
            only ``timeout_s`` applies, with a warning.
        max_output_chars: Cap on stdout and on stderr of one call; the rest is cut with a marker.
        network: Docker network mode; ``"none"`` (the default) gives the sandbox only a loopback
            interface. Any other Docker network (e.g. ``"bridge"``) lets model code reach the
            network and is logged as a warning for each sandbox; ``"host"`` and
            ``"container:..."`` (another namespace's network) are refused.
        user: None (the default): each sandbox runs as a uid of its own from ``SANDBOX_UIDS``,
            so the kernel's per-user quotas (pipe buffers, pending signals, epoll watches,
            processes) are never shared between sandboxes. A ``"uid:gid"`` (numeric, not root, not
            the host user's uid) pins one uid for every Docker sandbox of this config, which then
            share those quotas: one can exhaust them for the others and signal through them.
        runtime: Docker runtime of the container (e.g. ``"runsc"`` for gVisor, where installed);
            None is the daemon's default (runc).
        restart_grace_s: Extra time allowed to interrupt or restart a kernel after a timeout.
        env: Extra environment variables inside the sandbox (the host's are never passed).
        preload: Modules imported before any model code runs (e.g. ``PRELOAD_MATH``; none by
            default): in the Docker sandbox once per container, by the warden whose fork each
            episode's kernel is, so an episode's ``import`` of them is free (numpy and sympy: about
            40 MB more memory per container, counted against ``memory_mb``, 0.25 s more at its
            start, a few ms more CPU per episode); in a local kernel once at its start. A module the
            sandbox's Python lacks stops the sandbox's start with its name.
    """

    image: str = DEFAULT_IMAGE
    memory_mb: int = 1024
    cpus: float = 1.0
    pids_limit: int = 128
    tmpfs_mb: int = 256
    timeout_s: float = 10.0
    cpu_timeout_s: float | None = None
    max_output_chars: int = 16_384
    network: str = "none"
    user: str | None = None
    restart_grace_s: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    runtime: str | None = None
    preload: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("memory_mb", "cpus", "pids_limit", "tmpfs_mb", "timeout_s", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_output_chars > KERNEL_OUTPUT_CHARS:
            raise ValueError(
                f"sandbox.max_output_chars={self.max_output_chars} is above what a kernel sends of one cell "
                f"({KERNEL_OUTPUT_CHARS} characters a stream): use at most that"
            )
        if self.cpu_timeout_s is not None and not self.cpu_timeout_s > 0:
            raise ValueError(
                f"sandbox.cpu_timeout_s must be > 0 seconds or None (no CPU-time limit), got {self.cpu_timeout_s!r}"
            )
        match = None if self.user is None else re.fullmatch(r"(\d+)(?::(\d+))?", str(self.user))
        if self.user is not None and (match is None or int(match[1]) == 0 or match[2] == "0"):
            raise ValueError(
                f"sandbox.user must be a numeric 'uid:gid' other than root, got {self.user!r}: "
                "leave it unset (null) to give each sandbox a uid of its own"
            )
        if not isinstance(self.network, str) or not self.network:
            raise ValueError(
                f"sandbox.network must be a Docker network name, got {self.network!r}: use 'none'"
            )
        if self.network.startswith(SHARED_NETWORK_MODES):
            raise ValueError(
                f"sandbox.network={self.network!r} would share a network namespace with the host or "
                "another container: use 'none', or a Docker network such as 'bridge'"
            )
        if self.runtime is not None and (not isinstance(self.runtime, str) or not self.runtime):
            raise ValueError(f"sandbox.runtime must be a Docker runtime name or None, got {self.runtime!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError(f"sandbox.env must map str to str, got {self.env!r}")
        if isinstance(self.preload, str) or not all(
            isinstance(name, str) and MODULE_NAME.fullmatch(name) for name in self.preload
        ):
            raise ValueError(
                f"sandbox.preload must be a list of module names such as ['numpy', 'sympy'], got {self.preload!r}"
            )
