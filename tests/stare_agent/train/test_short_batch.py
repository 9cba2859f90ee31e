"""Dynamic sampling that falls short of ``data.prompts_per_step`` after its batch cap: the config
decides (train on fewer groups / skip the step / raise), and each shortfall is said and logged."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from stare_agent.algorithms.dynamic_sampling import DynamicSamplingShortfall
from stare_agent.config import ConfigError, load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.scripted_training import overrides

PROBLEMS = [
    {"id": "a", "problem": "What is 2 + 3?", "answer": "5"},
    {"id": "b", "problem": "What is 4 + 4?", "answer": "8"},
]


def policy():
    """Problem a: right, wrong, right, ... (reward variance); problem b: always right (none)."""
    count = iter(range(10**6))

    def turn(prompt_text: str, turn_index: int) -> str:
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
        wrong = a == 2 and next(count) % 2
        return f"<answer>\\boxed{{{a + b + wrong}}}</answer>"

    return turn


def test_shortfall_trains_on_fewer_skips_or_raises_as_configured(tmp_path, capsys):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    # 2 prompts per step, one sampling batch: only problem a's group has reward variance
    config = load_config(
        None, overrides(str(tmp_path / "run"), str(problems), 3) + ["data.max_sampling_batches=1"]
    )
    assert config.data.on_short_batch == "train"  # the default keeps the paper-era behaviour
    model, tokenizer = tiny_model()
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, policy()))
    try:
        trainer.step = 1
        metrics = trainer.train_step()
        assert (metrics["kept_groups"], metrics["skipped"], metrics["ds/reached_target"]) == (1, 0, 0.0)
        said = capsys.readouterr().out
        assert (
            "step 1: dynamic sampling kept 1 of 2 groups after data.max_sampling_batches=1: training on 1"
            in said
        )

        trainer.config.data.on_short_batch = "skip"
        trainer.step = 2
        before = {k: v.clone() for k, v in trainer.learner.module.state_dict().items()}
        metrics = trainer.train_step()
        assert metrics["skipped"] == 1 and metrics["ds/groups_kept"] == 1.0
        assert "skip_reason" in metrics and "kept_groups" not in metrics
        assert math.isnan(metrics["gate_on"])  # no update, no gate: neither on nor off
        after = trainer.learner.module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert (
            "kept 1 of 2 groups after data.max_sampling_batches=1: skipping the step"
            in capsys.readouterr().out
        )

        trainer.config.data.on_short_batch = "raise"
        trainer.step = 3
        with pytest.raises(DynamicSamplingShortfall, match="kept 1 of 2 groups after max_batches=1"):
            trainer.train_step()
    finally:
        trainer.close()
    with pytest.raises(
        ConfigError, match="data.on_short_batch='drop' is not valid: use one of train, skip, raise"
    ):
        load_config(None, ["data.on_short_batch=drop"])


class _Batches(ScriptedEngine):
    """Records the number of prompts of every engine call."""

    def __init__(self, tokenizer, turn) -> None:
        super().__init__(tokenizer, turn)
        self.sizes: list[int] = []

    def generate(self, prompts, params, stop):
        self.sizes.append(len(prompts))
        return super().generate(prompts, params, stop)


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_larger_draw_plays_its_prompts_in_one_batch_and_keeps_prompts_per_step(tmp_path, dynamic):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    config = load_config(
        None,
        overrides(str(tmp_path / "run"), str(problems), 1)
        + [
            "data.prompts_per_step=1",
            "data.prompts_per_draw=2",  # both problems, 2 samples each, in one draw
            "data.max_sampling_batches=1",
            "sandbox.pool_size=4",  # one sandbox per concurrent episode
            f"data.dynamic_sampling={str(dynamic).lower()}",
        ],
    )
    model, tokenizer = tiny_model()
    engine = _Batches(tokenizer, policy())
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine)
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert engine.sizes == [4]  # one turn of 2 problems x 2 samples, one engine call
    assert metrics["kept_groups"] == 1
    if dynamic:  # problem a's group is the only one with reward variance, whichever came first
        assert (metrics["ds/batches_drawn"], metrics["ds/groups_drawn"], metrics["ds/reached_target"]) == (
            1.0,
            2.0,
            1.0,
        )


def test_prompts_per_draw_must_be_positive():
    with pytest.raises(ConfigError, match=r"data.prompts_per_draw=0 must be > 0"):
        load_config(None, ["data.prompts_per_draw=0"])


def test_a_step_without_reward_variance_on_one_process_says_so_in_the_users_terms(tmp_path, capsys):
    """Every sample right: no group has reward variance, so one process has nothing to train. The step
    says that (not "fewer groups ... than ranks", which means nothing on one process) and what to change."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(PROBLEMS[1]) + "\n")  # problem b: always right
    config = load_config(
        None, overrides(str(tmp_path / "run"), str(problems), 1) + ["data.max_sampling_batches=1"]
    )
    model, tokenizer = tiny_model()
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, policy()))
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["skipped"] == 1
    reason = metrics["skip_reason"]
    assert reason.startswith("none of the 2 prompts drawn had samples that scored differently")
    assert "data.difficulty" in reason and "ranks" not in reason
    said = capsys.readouterr().out
    assert "dynamic sampling kept 0 of 2 groups after data.max_sampling_batches=1: skipping the step" in said
    assert f"step 1: no update: {reason}" in said


def test_a_run_of_skipped_steps_says_so_and_logs_no_gate(tmp_path):
    """Every step short and skipped: the summary counts them (the CLI then says "skipped", not
    "trained") and metrics.jsonl holds null, not 0, for their gate."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    config = load_config(
        None,
        overrides(str(tmp_path / "run"), str(problems), 2)
        + ["data.max_sampling_batches=1", "data.on_short_batch=skip"],
    )
    model, tokenizer = tiny_model()
    summary = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, policy())
    ).fit()
    assert (summary["steps"], summary["skipped_steps"]) == (2, 2)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["gate_on"]) for r in records] == [(1, 1, None), (2, 1, None)]
