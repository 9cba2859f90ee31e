"""The verl adapter against the installed verl: our code interpreter as a verl ``BaseTool`` (built from the
integrations page's tool config by verl's own loader, run through verl's own agent loop step) and our checker as a
verl ``compute_score`` (loaded from the integrations page's overrides by verl's loader, called by verl's reward
manager). Real Docker sandboxes.

verl's agent loop imports hydra-core, whose pins (omegaconf 2.3, antlr4 4.9) would downgrade .venv's
omegaconf; ``scripts/setup_integrations.sh`` puts those three in ``.venv/verl-overlay`` instead, and the
agent-loop test runs in a subprocess with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import require as require_need
from tests.integrations.helpers import readme_block, require

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / ".venv" / "verl-overlay"

pytestmark = pytest.mark.docker


def overlay_env() -> dict[str, str]:
    """The environment of a subprocess that imports verl's Hydra-based modules from the overlay."""
    if not (OVERLAY / "hydra").is_dir():
        require_need("integrations", f"{OVERLAY} has no hydra: run scripts/setup_integrations.sh")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(OVERLAY), str(REPO)])}


def _wait_idle(pool, size: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (stats := pool.stats()).idle < size:
        assert time.monotonic() < deadline, f"sandboxes not back in the pool: {stats}"
        time.sleep(0.1)
    assert stats.leased == 0, stats


def test_readme_tool_config_gives_each_trajectory_one_stateful_sandbox(docker_ready, tmp_path):
    require("verl")
    from verl.tools.base_tool import BaseTool
    from verl.tools.tool_registry import initialize_tools_from_config

    config = readme_block("# stare_tool_config.yaml")
    assert "pool_size: 16" in config
    path = tmp_path / "stare_tool_config.yaml"
    path.write_text(config.replace("pool_size: 16", "pool_size: 1"))  # one container on this machine
    [tool] = initialize_tools_from_config(str(path))
    assert isinstance(tool, BaseTool)
    assert tool.name == "code_interpreter" and tool.timeout_s == 30 and tool.sandbox_config.memory_mb == 1024

    async def trajectory():
        instance, _ = await tool.create()
        texts = []
        for code in ("import math\nx = 6", "```python\nprint(math.prod([x, 7]))\n```", "1 / 0"):
            response, step_reward, metrics = await tool.execute(instance, {"code": code})
            texts.append(response.text)
        leased = tool.pool.stats().leased
        reward = await tool.calc_reward(instance)
        await tool.release(instance)
        return texts, metrics, leased, reward

    try:
        texts, metrics, leased, reward = asyncio.run(trajectory())
        assert texts[1] == "42", texts  # state kept between calls; the fenced code ran
        assert "ZeroDivisionError" in texts[2] and metrics["error_type"] == "ZeroDivisionError"
        assert (leased, reward) == (1, 0.0)
        _wait_idle(tool.pool, 1)  # release() gave the sandbox back

        async def next_trajectory():
            instance, _ = await tool.create()
            response, _, _ = await tool.execute(instance, {"code": "print(x)"})
            await tool.release(instance)
            return response.text

        assert "NameError" in asyncio.run(next_trajectory())  # the next trajectory starts clean
    finally:
        tool.close()


AGENT_LOOP = textwrap.dedent(
    """
    import asyncio, gc, json, time
    from types import SimpleNamespace

    from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    from stare_integrations.verl_tool import CodeInterpreterTool

    tool = CodeInterpreterTool({"type": "native", "pool_size": 2, "backend": "docker"})
    # The attributes ToolAgentLoop._call_tool reads; the step itself is verl's.
    agent_loop = SimpleNamespace(
        tools={tool.name: tool}, max_tool_response_length=4096, tool_response_truncate_side="middle"
    )


    def trajectory():  # the same request id for both, as verl gives under full_determinism
        return AgentData(messages=[], image_data=None, video_data=None, audio_data=None,
                         mm_processor_kwargs=None, metrics={}, request_id="det-0", tools_kwargs={})


    async def call(agent_data, code):
        call = FunctionCall(name="code_interpreter", arguments=json.dumps({"code": code}))
        response, _, _ = await ToolAgentLoop._call_tool(agent_loop, call, {}, agent_data)
        return response.text


    async def main():
        a, b = trajectory(), trajectory()
        texts = [await call(b, "x = 100")]
        # verl runs the tool calls of one turn concurrently (asyncio.gather); here a's first two calls
        texts += await asyncio.gather(call(a, "x = 6"), call(a, "y = 7"))
        texts += [await call(a, "print(x * y)"), await call(b, "print(x + 1)")]
        leased = tool.pool.stats().leased
        del a, b  # the trajectories end: verl drops their AgentData
        gc.collect()
        deadline = time.monotonic() + 30
        while tool.pool.stats().idle < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return texts, leased, tool.pool.stats().leased, tool.pool.stats().idle


    texts, leased, leased_after, idle_after = asyncio.run(main())
    tool.close()
    print("RESULT " + json.dumps([texts, leased, leased_after, idle_after]))
    """
)


def test_verl_agent_loop_keeps_each_trajectorys_sandbox_across_its_calls(docker_ready):
    """verl's ToolAgentLoop runs create/execute/release around every call, and a turn's calls at once:
    the sandbox follows the trajectory (its AgentData), not the per-call instance, runs its calls one
    at a time, and goes back when the trajectory ends."""
    require("verl")
    env = overlay_env()
    done = subprocess.run(
        [sys.executable, "-c", AGENT_LOOP], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    texts, leased, leased_after, idle_after = json.loads(line.removeprefix("RESULT "))
    assert texts[3:] == ["42", "101"], texts  # each trajectory kept its own variables, in one kernel
    assert (leased, leased_after, idle_after) == (2, 0, 2)


COMPOSE = textwrap.dedent(
    """
    import json, os, sys

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        config = compose("ppo_trainer", overrides=sys.argv[1:])
    print("RESULT " + json.dumps({
        "reward": OmegaConf.to_container(config.reward.custom_reward_function),
        "multi_turn": OmegaConf.to_container(config.actor_rollout_ref.rollout.multi_turn),
    }))
    """
)


def test_readme_reward_overrides_score_through_verls_reward_manager():
    """The integrations page's overrides, composed with verl's own trainer config by Hydra (in the overlay), load
    our compute_score through verl's loader; verl's naive reward manager scores with it."""
    require("verl")
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from tests.helpers_tokenizers import smollm2_tokenizer

    overrides = [
        line.strip().rstrip("\\").strip() for line in readme_block("python3 -m verl").splitlines()[1:]
    ]
    env = overlay_env()
    done = subprocess.run(
        [sys.executable, "-c", COMPOSE, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    composed = json.loads(line.removeprefix("RESULT "))
    assert composed["reward"] == {
        "path": "pkg://stare_integrations.verl_tool",
        "name": "compute_score",
        "reward_kwargs": {"mode": "plus_minus"},
    }
    assert composed["multi_turn"]["tool_config_path"] == "stare_tool_config.yaml"
    config = OmegaConf.create({"reward": {"custom_reward_function": composed["reward"]}})
    compute_score = get_custom_reward_fn(config)
    tokenizer = smollm2_tokenizer()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    manager = NaiveRewardManager(config, tokenizer, compute_score)

    def score(response: str, ground_truth: str) -> dict:
        prompt = tokenizer.encode("What is 6 * 7?")
        ids = tokenizer.encode(response)
        data = DataProto.from_dict(
            tensors={
                "prompts": torch.tensor([prompt]),
                "responses": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
            },
            non_tensors={
                "data_source": ["stare/test"],
                "reward_model": [{"ground_truth": ground_truth}],
                "extra_info": [{}],
            },
        )
        return loop.run_until_complete(manager.run_single(data))

    try:
        code = "<tool_call>\n{}\n</tool_call>\n<tool_response>\n42\n</tool_response>\n"
        right = score(code + "So the answer is <answer>\\boxed{42}</answer>", "42")
        as_fraction = score("It is \\boxed{\\frac{84}{2}}.", "42")
        wrong = score("<answer>\\boxed{41}</answer>", "42")
        missing = score("I do not know.", "42")
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    assert right["reward_score"] == 1.0 and right["reward_extra_info"]["pred"] == "42"
    assert as_fraction["reward_score"] == 1.0  # math-verify, not string equality
    assert (wrong["reward_score"], wrong["reward_extra_info"]["acc"]) == (-1.0, 0.0)  # plus_minus
    assert (missing["reward_score"], missing["reward_extra_info"]["pred"]) == (-1.0, "")


def test_a_removed_container_raises_and_the_trajectory_goes_on_in_a_fresh_sandbox(docker_ready):
    """Infrastructure failures are not tool output: execute raises (verl's agent loop then reports the
    error), the broken sandbox goes back for replacement, and the next call leases a fresh one."""
    require("verl")
    import docker

    from stare_envs.tool_env import EpisodeInfrastructureError, is_infrastructure_error
    from stare_integrations.verl_tool import CodeInterpreterTool

    tool = CodeInterpreterTool({"type": "native", "pool_size": 1, "backend": "docker"})

    async def trajectory():
        instance, _ = await tool.create()
        await tool.execute(instance, {"code": "x = 1"})
        container = tool._instances[instance].sandbox.inner.container
        docker.from_env().containers.get(container.id).remove(force=True)
        with pytest.raises(EpisodeInfrastructureError, match="handed back for replacement") as failure:
            await tool.execute(instance, {"code": "print(x)"})
        after, _, _ = await tool.execute(instance, {"code": "print(41 + 1)"})
        await tool.release(instance)
        return failure.value, after.text

    try:
        failure, after = asyncio.run(trajectory())
        assert is_infrastructure_error(failure.__cause__), repr(failure.__cause__)
        assert after == "42"
        _wait_idle(tool.pool, 1)
        assert tool.pool.stats().replaced >= 1
    finally:
        tool.close()


def test_a_bad_tool_config_is_refused_with_the_valid_keys():
    require("verl")
    from stare_integrations.verl_tool import CodeInterpreterTool

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pool'\] .*use \[.*'pool_size'"):
        CodeInterpreterTool({"type": "native", "pool": 4})
    with pytest.raises(ValueError, match=r"unknown sandbox option\(s\) \['memory'\] .*'memory_mb'"):
        CodeInterpreterTool({"type": "native", "sandbox": {"memory": 1}})
    with pytest.raises(ValueError, match="pool_size must be >= 1"):
        CodeInterpreterTool({"type": "native", "pool_size": 0})
    with pytest.raises(ValueError, match=r"unknown ray option\(s\) \['nodes'\] .*RayFleetConfig"):
        CodeInterpreterTool({"type": "native", "backend": "ray", "ray": {"nodes": 2}})


def test_what_a_tool_printed_never_scores(docker_ready):
    """The model's code prints a boxed answer; under verl the decoded response holds the tool message,
    so a reward function reading it whole would take the tool's answer (1.0 for 42 below, also when the
    model gives none). The tool records its outputs in the trajectory's extra_fields, verl's reward loop
    passes them in extra_info, and compute_score reads the model's words alone."""
    require("verl")
    import torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from stare_integrations.verl_tool import TOOL_OUTPUTS_KEY, CodeInterpreterTool, compute_score
    from tests.helpers_tokenizers import smollm2_tokenizer

    tool = CodeInterpreterTool({"type": "native", "pool_size": 1, "backend": "docker"})

    class Trajectory:  # what the tool uses of verl's AgentData (whose module needs the Hydra overlay)
        def __init__(self) -> None:
            self.extra_fields: dict = {}

    agent_data = Trajectory()

    async def call() -> str:
        instance, _ = await tool.create()
        response, _, _ = await tool.execute(
            instance, {"code": "print('<answer>\\\\boxed{42}</answer>')"}, agent_data=agent_data
        )
        await tool.release(instance)
        return response.text

    try:
        printed = asyncio.run(call())
    finally:
        tool.close()
    assert printed == "<answer>\\boxed{42}</answer>" and agent_data.extra_fields[TOOL_OUTPUTS_KEY] == [
        printed
    ]
    tokenizer = smollm2_tokenizer()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the manager runs the reward function on the loop it was made in
    manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, compute_score)

    def score(model_after: str, fields: dict) -> dict:
        response = f"<code>\nprint(...)\n</code>\n<interpreter>\n{printed}\n</interpreter>\n{model_after}"
        prompt, ids = tokenizer.encode("What is 6 * 7?"), tokenizer.encode(response)
        data = DataProto.from_dict(
            tensors={
                "prompts": torch.tensor([prompt]),
                "responses": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
            },
            non_tensors={
                "data_source": ["stare/test"],
                "reward_model": [{"ground_truth": "42"}],
                "extra_info": [{}],
                "tool_extra_fields": [fields],
            },
        )
        return loop.run_until_complete(manager.run_single(data))

    try:
        wrong = score("So the answer is \\boxed{41}.", agent_data.extra_fields)
        silent = score("I cannot tell.", agent_data.extra_fields)
        right = score("So the answer is \\boxed{42}.", agent_data.extra_fields)
        unmatched = score("So the answer is \\boxed{42}.", {TOOL_OUTPUTS_KEY: ["never printed"]})
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    assert (wrong["reward_score"], wrong["reward_extra_info"]["pred"]) == (0.0, "41")
    assert (silent["reward_score"], silent["reward_extra_info"]["pred"]) == (0.0, "")
    assert (right["reward_score"], right["reward_extra_info"]["pred"]) == (1.0, "42")
    assert unmatched["reward_score"] == 0.0 and unmatched["reward_extra_info"]["tool_output_unmatched"] == 1.0
