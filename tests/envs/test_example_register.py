"""examples/register_tool_env.py: a new tool environment in under 40 lines, run through gymnasium.make."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

from stare_envs.tools import unregister_tool

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "register_tool_env.py"


@pytest.fixture
def example():
    namespace = runpy.run_path(str(EXAMPLE), run_name="example")  # registers, does not play
    yield namespace
    unregister_tool("calculator")
    gymnasium.registry.pop("demo/Calculator-v0", None)


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_example_is_short_and_plays_an_episode_to_reward_one():
    assert len(EXAMPLE.read_text().splitlines()) < 40
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.splitlines()[-1].startswith("reward=1.0 answer=")


def test_registered_env_through_gymnasium_make(example):
    env = gymnasium.make("demo/Calculator-v0", max_turns=6)
    prompt, info = env.reset(seed=3)
    assert info["tools"][0]["function"]["name"] == "calculator" and "\\times" in prompt
    assert env.step(call("binomial(10, 3) * 2**3"))[0] == "960"  # 120 * 8
    assert env.step(call("__import__('os')"))[0].startswith("calculator error: ToolInputError: only numbers")
    assert env.step(call("2 +* 3"))[0].startswith("calculator error: SympifyError")
    observation = prompt
    while True:  # the example's own scripted policy solves the episode
        observation, reward, terminated, truncated, info = env.step(example["policy"](observation))
        if terminated or truncated:
            break
    assert (reward, terminated, info["correct"]) == (1.0, True, True)
    env.close()
