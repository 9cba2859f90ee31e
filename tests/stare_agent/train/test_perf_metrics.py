"""The perf/* metrics a real RL step and a real SFT step log (stare_agent.perf)."""

from __future__ import annotations

import json
import math

from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.sft import sft
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.scripted_training import scripted_policy
from tests.stare_agent.train.test_trainer import make_config, problem_file  # noqa: F401 (fixture)


def test_an_rl_step_logs_learner_mfu_tokens_per_s_and_the_rollout_rate(tmp_path, problem_file):  # noqa: F811
    config = make_config(tmp_path, problem_file, "trainer.steps=1")
    model, tokenizer = tiny_model()
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    trainer.fit()
    (record,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the scripted engine plays without a model, so its rate is only positive and finite
    for key in ("perf/tokens_per_s", "perf/rollout_tokens_per_s"):
        assert math.isfinite(record[key]) and record[key] > 0
    # model FLOPs: share_prompts skips work they count, so a real model's batch may read above 1
    # (docs/benchmarks.md); the tiny model's step, all overhead, stays far below
    assert 0 < record["perf/mfu"] <= 1
    seconds = record["time/logprob_s"] + record["time/update_s"] - record["time/sync_s"]
    tokens = record["perf/tokens_per_s"] * seconds  # whole trained tokens, prompts included
    assert tokens > 0 and abs(tokens - round(tokens)) < 1e-6 * tokens


def test_an_sft_step_logs_mfu_and_tokens_per_s(shared_data, tmp_path):
    model, tokenizer = tiny_model(seed=2)
    cfg = load_config(
        None,
        [
            f"sft.data={shared_data / 'tora_examples.jsonl'}",
            "sft.limit=2",
            "sft.batch_size=2",
            "sft.epochs=1",
            "sft.max_tokens=400",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    sft(cfg, model=model, tokenizer=tokenizer)
    steps = [json.loads(x) for x in (tmp_path / "run" / "sft_log.jsonl").read_text().splitlines()][:-1]
    assert steps
    for r in steps:
        assert math.isfinite(r["perf/tokens_per_s"]) and r["perf/tokens_per_s"] > 0
        assert 0 < r["perf/mfu"] <= 1
