"""32 episodes stepping concurrently (threads) against one small pool: every answer is right, no
episode sees another's state, and every sandbox is back in the pool afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from stare_envs import CodeInterpreterEnv
from stare_envs.problems import Problem
from stare_sandbox.config import SandboxConfig
from stare_sandbox.pool import SandboxPool

EPISODES = 32


def scripted_episode(pool: SandboxPool, index: int) -> tuple[str, float, bool]:
    """Stores a per-episode secret, reads it back next turn, and boxes it."""
    problem = Problem(f"c{index}", f"Return {index * 1000 + 7}.", str(index * 1000 + 7))
    env = CodeInterpreterEnv([problem], pool=pool)
    try:
        env.reset(seed=index)
        first, *_ = env.step(
            f"<code>\n```python\nsecret = {index} * 1000 + 7\nseen = globals().get('mark')\nmark = {index}\n```\n</code>"
        )
        second, *_ = env.step("<code>\n```python\nprint(secret, seen)\n```\n</code>")
        _, reward, terminated, _, _ = env.step(f"<answer>\\boxed{{{index * 1000 + 7}}}</answer>")
    finally:
        env.close()
    return second, reward, terminated


def run_concurrently(pool: SandboxPool, settled) -> None:
    with ThreadPoolExecutor(max_workers=EPISODES) as executor:
        outcomes = list(executor.map(lambda i: scripted_episode(pool, i), range(EPISODES)))
    for index, (second, reward, terminated) in enumerate(outcomes):
        # ``seen`` is None: no episode inherited another's variables from a reused sandbox.
        assert second == f"\n<interpreter>\n{index * 1000 + 7} None\n</interpreter>\n"
        assert (reward, terminated) == (1.0, True)
    stats = settled(pool, 60.0)
    assert (stats.leased, stats.rearming, stats.idle) == (0, 0, pool.size)
    assert stats.resets + stats.replaced >= EPISODES  # every episode's sandbox came back and was re-armed


def test_32_concurrent_episodes_on_local_kernels(settled):
    with SandboxPool(4, backend="local", config=SandboxConfig(timeout_s=10.0)) as pool:
        run_concurrently(pool, settled)


@pytest.mark.docker
def test_32_concurrent_episodes_in_docker(docker_ready, settled):
    with SandboxPool(4, backend="docker", config=SandboxConfig(timeout_s=10.0)) as pool:
        run_concurrently(pool, settled)
