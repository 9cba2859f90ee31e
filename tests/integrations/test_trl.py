"""The TRL adapter against the installed TRL: one ``GRPOTrainer`` step on CPU with the tiny model, its
rollouts played in our environment with real Docker sandboxes through ``EnvRollout`` (TRL's
``rollout_func``)."""

from __future__ import annotations

import pytest
import torch

from stare_envs import CodeInterpreterEnv
from stare_envs.problems import Problem
from tests.integrations.helpers import readme_block, require

pytestmark = pytest.mark.docker

PROBLEM = Problem(id="p0", problem="What is 17 * 12?", answer="204")
CODE_TURN = "Let me compute.\n<code>\n```python\nprint(17 * 12)\n```\n</code>"


def _config(tmp_path, **overrides):
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=96,
        max_steps=1,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    return GRPOConfig(**{**settings, **overrides})


def _one_step(model, tokenizer, rollout, tmp_path, *, closing=()):
    """One ``GRPOTrainer`` step whose rollouts come from ``rollout``; returns (trainer, its outputs).
    ``rollout`` and the ``closing`` objects are closed afterwards, whatever happens."""
    from trl import GRPOTrainer

    from stare_integrations.trl_rollout import env_reward

    outputs = []

    def recorded(prompts, trainer):
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=env_reward,
        args=_config(tmp_path),
        train_dataset=rollout.dataset(),
        rollout_func=recorded,
    )
    try:
        trainer.train()
    finally:
        rollout.close()
        for thing in closing:
            thing.close()
    return trainer, outputs


def test_one_grpo_step_trains_on_env_episodes_with_tool_output_masked(docker_ready, tmp_path):
    """Two episodes of one prompt: one runs code in the sandbox and answers right, one answers wrong.
    The env's rewards (1, 0) reach TRL, its advantages are nonzero, the step changes the weights, and
    the sandbox's output is in the completion with env_mask 0."""
    require("trl")
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import tiny_model
    from stare_integrations.trl_rollout import EnvRollout
    from stare_sandbox import SandboxPool

    model, tokenizer = tiny_model()
    scripts = [[CODE_TURN, "<answer>\\boxed{204}</answer>"], ["<answer>\\boxed{7}</answer>"]]
    pool = SandboxPool(1, backend="docker")
    rollout = EnvRollout(
        lambda: CodeInterpreterEnv([PROBLEM], pool=pool, max_turns=3),
        engine=lambda trainer: ScriptedEngine(trainer.processing_class, scripts),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, outputs = _one_step(model, tokenizer, rollout, tmp_path, closing=[pool])
    [out] = outputs
    assert out["env_reward"] == [1.0, 0.0] and out["num_tool_calls"] == [1, 0]
    ids, mask = out["completion_ids"][0], out["env_mask"][0]
    assert len(ids) == len(mask) == len(out["logprobs"][0])
    inserted = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
    sampled = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m == 1])
    assert "<interpreter>\n204" in inserted and "204" not in sampled.split("</code>")[0]
    [logged] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged["reward"] == pytest.approx(0.5)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "the GRPO step changed no weight"


def test_readme_trl_example_runs_one_step_with_the_models_own_rollouts(docker_ready, tmp_path, monkeypatch):
    """The integrations page's example as written (one step instead of 200): the trainer's model plays the episodes."""
    require("trl")
    code = readme_block("# TRL: GRPO on a code-interpreter environment")
    assert code.count("max_steps=200") == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code.replace("max_steps=200", "max_steps=1"), "docs/integrations.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    assert namespace["pool"].closed
    [logged] = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert logged["reward"] == 0.0  # a random model answers nothing right


def test_an_episode_lost_to_the_sandbox_is_left_out_of_the_step(docker_ready, tmp_path):
    """The container of one episode is removed mid-episode (no retry): that episode comes back as one
    masked EOS with reward None, which TRL leaves out; the step runs on."""
    require("trl")
    import docker

    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import tiny_model
    from stare_integrations.trl_rollout import EnvRollout
    from stare_sandbox import SandboxPool

    model, tokenizer = tiny_model()

    def doomed(prompt_text: str, turn: int) -> str:
        if turn == 1:  # the env of this episode (the second) holds a sandbox now: remove its container
            container = rollout.envs[1]._sandbox.inner.container
            docker.from_env().containers.get(container.id).remove(force=True)
        return "<code>\n```python\nx = 1\nprint(x)\n```\n</code>"

    scripts = [[CODE_TURN, "<answer>\\boxed{204}</answer>"], doomed]
    pool = SandboxPool(2, backend="docker")
    rollout = EnvRollout(
        lambda: CodeInterpreterEnv([PROBLEM], pool=pool, max_turns=3),
        engine=lambda trainer: ScriptedEngine(trainer.processing_class, scripts),
        max_episode_retries=0,
    )
    trainer, outputs = _one_step(model, tokenizer, rollout, tmp_path, closing=[pool])
    [out] = outputs
    assert out["env_reward"] == [1.0, None]
    assert (out["completion_ids"][1], out["env_mask"][1]) == ([tokenizer.eos_token_id], [0])
    assert trainer.state.global_step == 1
