"""The sandbox side of the verl and verifiers adapters: one :class:`~stare_sandbox.SandboxPool`, started
at the first call (trainers build their tools in every worker when they read the config), and per
session (a verl trajectory, a verifiers rollout) one sandbox leased at the session's first call,
with our ``code_interpreter`` bound to it, kept until the session ends."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from stare_envs.tools import BoundTool, get_tool
from stare_sandbox import resolve_backend
from stare_sandbox.config import SandboxConfig
from stare_sandbox.pool import PooledSandbox, SandboxPool
from stare_sandbox.ray_fleet import RayFleetConfig, RaySandboxFleet


@dataclass
class ToolSession:
    """One session's sandbox and the code_interpreter bound to it."""

    sandbox: PooledSandbox | None = None
    tool: BoundTool | None = None
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    """One call at a time: a turn's tool calls may come concurrently, and one kernel runs one cell."""


class LeasedTools:
    """The pool and the leases of an adapter's sessions.

    Args:
        pool_size: Sandboxes kept warm: sessions that run code at once (the others wait up to
            ``lease_timeout_s``).
        backend: ``docker``, ``local``, ``auto``, or ``ray``: the sandbox fleet of the Ray cluster this
            process runs in (docs/deployment.md), as ``fleet`` configures it.
        sandbox_config: Limits of each sandbox.
        lease_timeout_s: How long a session's first call waits for a free sandbox.
        timeout_s: Per-call timeout of the code; None for the sandbox config's.
    """

    def __init__(
        self,
        pool_size: int,
        backend: str,
        sandbox_config: SandboxConfig | None,
        lease_timeout_s: float,
        timeout_s: float | None,
        fleet: RayFleetConfig | None = None,
    ) -> None:
        self.pool_size, self.backend, self.sandbox_config = pool_size, backend, sandbox_config
        self.lease_timeout_s, self.timeout_s = lease_timeout_s, timeout_s
        self.fleet = fleet
        self.pool: SandboxPool | RaySandboxFleet | None = None
        self._lock = threading.Lock()

    def run(self, session: ToolSession, parameters: dict[str, Any]) -> Any:
        """Blocking: lease the session's sandbox on its first call, then run the tool; the calls of one
        session run one after another, in the order they arrive."""
        with session.lock:
            if session.tool is None:
                session.sandbox = self._pool().acquire(timeout=self.lease_timeout_s)
                options = {} if self.timeout_s is None else {"timeout_s": float(self.timeout_s)}
                session.tool = get_tool("code_interpreter").bind(session.sandbox, **options)
            session.calls += 1
            return session.tool(parameters)

    def end(self, session: ToolSession, broken: bool = False) -> None:
        """Close the session's tool and give its sandbox back (replaced when ``broken``). Idempotent."""
        tool, session.tool = session.tool, None
        sandbox, session.sandbox = session.sandbox, None
        if tool is not None:
            tool.close()
        pool = self.pool
        if sandbox is not None and pool is not None and not pool.closed:
            pool.release(sandbox, broken=broken)

    def close(self) -> None:
        """Close the pool (every sandbox); end the sessions first. Idempotent."""
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def _pool(self) -> SandboxPool | RaySandboxFleet:
        with self._lock:
            if self.pool is None and self.backend == "ray":
                fleet = self.fleet or RayFleetConfig(lease_timeout_s=self.lease_timeout_s)
                self.pool = RaySandboxFleet(fleet, self.sandbox_config)
            if self.pool is None:
                self.pool = SandboxPool(
                    self.pool_size,
                    backend=resolve_backend(self.backend, self.sandbox_config),  # a config's string, checked
                    config=self.sandbox_config,
                    lease_timeout=self.lease_timeout_s,
                )
            return self.pool
