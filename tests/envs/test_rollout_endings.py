"""How episodes end inside the rollout runner: EOS in a ReTool turn, and the response-token budget.

Real tokenizer, real CodeInterpreterEnv on local sandboxes, scripted model turns (a turn without a
stop string ends with EOS, as a model that finished its message).
"""

from __future__ import annotations

import pytest

from stare_agent.engines.scripted import ScriptedEngine
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.problems import Problem
from stare_envs.rewards import RewardConfig
from stare_envs.rollout import RolloutRunner
from stare_sandbox.pool import SandboxPool
from tests.helpers_tokenizers import smollm2_tokenizer

PROBLEM = Problem(id="mul", problem="What is 6 * 7?", answer="42")
CODE = "Let me compute.\n<code>\n```python\nprint(6 * 7)\n```\n</code>"


@pytest.fixture(scope="module")
def sandboxes():
    with SandboxPool(1, backend="local") as pool:
        yield pool


@pytest.fixture
def play(sandboxes):
    """``play(scripts, budget=, reward=, fmt=)`` -> (trajectories, envs, tokenizer); envs closed after
    the test (so a test can look at the pool while they are still open)."""
    made: list[CodeInterpreterEnv] = []

    def run(scripts, *, budget=4096, reward=None, fmt="retool"):
        tokenizer = smollm2_tokenizer()
        envs = [
            CodeInterpreterEnv([PROBLEM], format=fmt, pool=sandboxes, tokenizer=tokenizer, reward=reward)
            for _ in scripts
        ]
        made.extend(envs)
        runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, scripts), max_response_tokens=budget)
        return runner.run(envs), envs, tokenizer

    yield run
    for env in made:
        env.close()


@pytest.mark.parametrize(
    "turn",
    [
        "I will run <code>\n```python\nprint(6 * 7)\n```",  # unclosed <code>, then EOS
        "The answer is <answer></answer>",  # an empty <answer>, then EOS
    ],
)
def test_eos_in_a_retool_turn_ends_the_episode(play, turn):
    """EOS ends the episode (as verl does): nothing after it, nothing in the turn runs, and the turn is
    scored on its (missing) answer by the reward config."""
    (t,), _, tokenizer = play(
        [[turn, "<answer>\\boxed{42}</answer>"]], reward=RewardConfig(format_penalty=0.5)
    )
    eos = tokenizer.eos_token_id
    assert t.response_ids[-1] == eos and eos not in t.response_ids[:-1]
    assert all(t.loss_mask)  # only the model's own turn: no observation was appended after EOS
    assert t.info["num_turns"] == 1 and t.info["finish_reason"] == "terminated"
    assert t.info["tool_calls"] == [] and t.info["answer"] is None
    assert t.reward == -0.5


def test_eos_in_a_hermes_turn_still_ends_only_the_message(play):
    """In hermes the EOS closes the assistant message and the tool message follows (unchanged)."""
    call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
    (t,), _, _ = play([["Let me think.", "<answer>\\boxed{42}</answer>"]], fmt="hermes")
    assert t.info["num_turns"] == 1 and t.info["finish_reason"] == "terminated"  # no tool tried: final
    (t,), _, _ = play([[call, "<answer>\\boxed{42}</answer>"]], fmt="hermes")
    assert t.info["num_turns"] == 2 and t.reward == 1.0


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        (RewardConfig(), 0.0),
        (RewardConfig(mode="plus_minus"), -1.0),
        (RewardConfig(format_penalty=0.25), -0.25),
    ],
)
def test_budget_cut_episode_is_scored_by_the_reward_config_and_gives_its_sandbox_back(
    play, sandboxes, reward, expected
):
    # Turn 0 runs code (leasing the pool's only sandbox); turn 1 runs past the budget.
    (t,), envs, _ = play([[CODE, "Now a long answer " + "so on and " * 200]], budget=200, reward=reward)
    assert t.info["finish_reason"] == "budget" and t.info["truncated"] and len(t.response_ids) == 200
    assert t.info["num_tool_calls"] == 1 and t.info["answer"] is None
    assert t.reward == expected
    # The env ended the episode: its sandbox is back in the pool while the env is still open.
    assert sandboxes.stats().leased == 0


def _broken_episode_rollout(max_episode_retries: int):
    """Three Docker episodes on a pool of 3; episode p0's container is removed (by the id its env
    leased) when the model writes p0's second turn, so p0's next step hits a Docker API error."""
    import docker

    tokenizer = smollm2_tokenizer()
    problems = [Problem(f"p{i}", f"Problem p{i}: what is {i} * 7?", str(i * 7)) for i in range(3)]
    removed: list[str] = []

    def policy(prompt_text: str, turn: int) -> str:
        i = int(prompt_text.rsplit("Problem p", 1)[1][0])
        if turn == 0:
            return f"<code>\n```python\nx = {i} * 7\nprint(x)\n```\n</code>"
        if turn == 1:
            if i == 0 and not removed:
                container = envs[0]._sandbox.inner.container  # the sandbox this test's pool leased to p0
                docker.from_env().containers.get(container.id).remove(force=True)
                removed.append(container.id)
            return "<code>\n```python\nprint(x + 0)\n```\n</code>"
        return f"<answer>\\boxed{{{i * 7}}}</answer>"

    with SandboxPool(3, backend="docker") as pool:
        envs = [
            CodeInterpreterEnv(problems, format="retool", pool=pool, tokenizer=tokenizer) for _ in problems
        ]
        runner = RolloutRunner(
            tokenizer,
            ScriptedEngine(tokenizer, policy),
            max_response_tokens=2048,
            max_episode_retries=max_episode_retries,
        )
        try:
            trajectories = runner.run(envs, options=[{"problem_index": i} for i in range(3)])
        finally:
            for env in envs:
                env.close()
        leased_after = pool.stats().leased
    return trajectories, runner.last_stats, removed, leased_after


@pytest.mark.docker
def test_a_removed_container_costs_one_retry_not_the_rollout(docker_ready):
    trajectories, stats, removed, leased = _broken_episode_rollout(max_episode_retries=1)
    assert len(removed) == 1
    assert [t.info["finish_reason"] for t in trajectories] == ["terminated"] * 3
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0]  # p0 played again, on a fresh sandbox
    assert [t.info["num_tool_calls"] for t in trajectories] == [2, 2, 2]
    assert stats.retried_episodes == 1 and stats.failed_episodes == 0 and leased == 0


@pytest.mark.docker
def test_an_episode_out_of_retries_is_excluded_and_the_others_finish(docker_ready):
    trajectories, stats, removed, leased = _broken_episode_rollout(max_episode_retries=0)
    failed, *others = trajectories
    assert failed.info["finish_reason"] == "failed" and "(container removed)" in failed.info["failed"]
    assert failed.info["failed"].endswith("[SandboxKilled]")
    assert failed.response_ids == [] and failed.reward == 0.0
    assert [t.reward for t in others] == [1.0, 1.0]
    assert stats.retried_episodes == 0 and stats.failed_episodes == 1 and leased == 0
