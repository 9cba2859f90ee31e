"""Two episodes on one pooled Docker sandbox: what the first leaves, the second must not find."""

from __future__ import annotations

from stare_sandbox import ExecResult, SandboxPool


def next_episode(pool: SandboxPool, plant: str, probe: str) -> ExecResult:
    """Run ``plant`` in one episode and ``probe`` in the next on the same container (a pool of one
    leases it again); the probe's result. An error in either fails the test."""
    with pool.lease() as sandbox:
        container = sandbox.inner.container.id
        planted = sandbox.run(plant)
        assert planted.ok, planted
    with pool.lease() as sandbox:
        assert sandbox.inner.container.id == container, "the pool replaced the sandbox: nothing was tested"
        result = sandbox.run(probe)
    assert result.ok, result
    return result


def two_episodes(pool: SandboxPool, plant: str, probe: str) -> str:
    """:func:`next_episode`'s stdout."""
    return next_episode(pool, plant, probe).stdout
