"""SFT trains on exactly the prompt RL samples from: for the same problem, the prompt tokens of a
cold-start trace equal those of a rollout, in both tool-call formats, with the format's system
prompt, with none, and with a custom one (real tokenizers and chat templates, a real rollout)."""

from __future__ import annotations

import pytest

from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.train.sft_data import Trace, trace_to_trajectory
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.problems import Problem
from stare_envs.rollout import RolloutRunner
from tests.helpers_tokenizers import TOKENIZERS

# Corner cases: an escape sequence and a zero-width space (not printable: the env escapes them), LaTeX.
PROBLEM = Problem("p0", "What is $6 \\times 7$?\x1b[0m\u200b Give the integer.", "42")
ANSWER = "The product is \\boxed{42}."


@pytest.mark.parametrize("tokenizer_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("fmt", ["retool", "hermes"])
@pytest.mark.parametrize("system_prompt", [None, "", "You are careful."], ids=["format", "none", "custom"])
def test_sft_and_rl_prompts_are_identical_token_for_token(tokenizer_name, fmt, system_prompt):
    tokenizer = TOKENIZERS[tokenizer_name]()
    env = CodeInterpreterEnv(
        [PROBLEM], format=fmt, tokenizer=tokenizer, system_prompt=system_prompt, sandbox_backend="local"
    )
    try:
        runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, [[ANSWER]]), max_response_tokens=256)
        (played,) = runner.run([env], options=[{"problem": PROBLEM}])
    finally:
        env.close()
    trace = Trace(PROBLEM.id, PROBLEM.problem, [("model", ANSWER)], fmt, PROBLEM.answer)
    trained = trace_to_trajectory(trace, tokenizer, system_prompt=system_prompt)
    assert trained.prompt_ids == played.prompt_ids
    assert trained.response_ids == played.response_ids  # the answer turn, then EOS, alike


def test_an_env_without_tools_renders_its_prompt_and_plays():
    """A hermes tool env with no tools at all (a reasoning-only task): its prompt renders (no system
    prompt of the format lists a tool) and an episode plays to its reward."""
    from stare_envs import ToolEnv

    tokenizer = TOKENIZERS[sorted(TOKENIZERS)[0]]()
    env = ToolEnv([PROBLEM], tools=(), format="hermes", tokenizer=tokenizer)
    try:
        runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, [[ANSWER]]), max_response_tokens=64)
        (played,) = runner.run([env], options=[{"problem": PROBLEM}])
    finally:
        env.close()
    assert played.reward == 1.0 and sum(played.loss_mask) > 0
