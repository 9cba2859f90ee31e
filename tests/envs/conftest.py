"""Fixtures of the environment tests: sandbox pools (in-process fake, local kernels, Docker)."""

from __future__ import annotations

import functools
import io
import time
import traceback
from collections.abc import Iterator

import pytest

from stare_sandbox.base import Sandbox
from stare_sandbox.pool import SandboxPool
from stare_sandbox.result import ExecError, ExecResult


class InProcessSandbox(Sandbox):
    """Runs code with ``exec`` in the test process: fast, stateful, NOT isolated and without
    timeouts. It exercises the environment's logic; the real backends are tested beside it."""

    backend = "in-process-test"

    def __init__(self) -> None:
        super().__init__()
        self.namespace: dict = {}
        self.runs = 0

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        self.runs += 1
        out = io.StringIO()
        self.namespace["print"] = functools.partial(print, file=out)
        start = time.monotonic()
        error = None
        try:
            exec(compile(code, "<cell>", "exec"), self.namespace)
        except Exception as exc:  # noqa: BLE001 - the executed code's failure is its result
            error = ExecError(type(exc).__name__, str(exc), traceback.format_exc(limit=0))
        return ExecResult(stdout=out.getvalue(), error=error, duration_s=time.monotonic() - start)

    def reset(self) -> None:
        self.namespace = {}

    def close(self) -> None:
        self.namespace = {}

    def is_alive(self) -> bool:
        return True


@pytest.fixture(scope="module")
def fake_pool() -> Iterator[SandboxPool]:
    """Two in-process sandboxes behind a real ``SandboxPool``."""
    with SandboxPool(2, factory=InProcessSandbox) as pool:
        yield pool


def _idle_pool(pool: SandboxPool, timeout_s: float = 10.0):
    """Stats once nothing is leased or re-arming (re-arming runs on background threads)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = pool.stats()
        if (stats.leased == 0 and stats.rearming == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


@pytest.fixture
def settled():
    """``settled(pool)`` waits for background re-arming and returns the pool's stats."""
    return _idle_pool


@pytest.fixture(scope="module")
def local_pool() -> Iterator[SandboxPool]:
    """Two local Jupyter kernels (the weaker, Docker-free backend) with a short timeout."""
    from stare_sandbox.config import SandboxConfig

    config = SandboxConfig(timeout_s=3.0)
    with SandboxPool(2, backend="local", config=config) as pool:
        yield pool


@pytest.fixture(scope="module")
def docker_pool(docker_ready) -> Iterator[SandboxPool]:
    """Two Docker sandboxes with a short timeout."""
    from stare_sandbox.config import SandboxConfig

    with SandboxPool(2, backend="docker", config=SandboxConfig(timeout_s=3.0)) as pool:
        yield pool
