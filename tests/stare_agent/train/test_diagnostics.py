"""The trainer's one diagnostics hook: called at its three points, logged, given the moments only when
it asks, and never a change to what the step computes."""

from __future__ import annotations

import json

import pytest

from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.diagnostics import Diagnostics, PreUpdate
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.scripted_training import overrides, scripted_policy, write_problems


class Probe(Diagnostics):
    def __init__(self, needs_moments: bool) -> None:
        self.needs_moments = needs_moments
        self.calls: list[str] = []
        self.batches: list[PreUpdate] = []

    def on_fit_start(self, trainer):
        self.calls.append(f"start {trainer.step}")

    def on_pre_update(self, batch):
        self.calls.append(f"pre {batch.step}")
        self.batches.append(batch)
        return {"probe/L_plus_share": float(batch.L_plus.sum()) / float(batch.mask.sum())}

    def on_evaluation(self, trainer):
        self.calls.append(f"eval {trainer.step}")
        return {"probe/evaluated": 1.0}


def _fit(tmp_path, problem_file, hooks, *extra) -> list[dict]:
    bank = [f"data.eval={problem_file}", "data.eval_limit=1", "data.eval_samples=1", "trainer.eval_every=2"]
    config = load_config(None, overrides(str(tmp_path), str(problem_file), 2) + bank + list(extra))
    model, tokenizer = tiny_model()
    Trainer(
        config,
        model=model,
        tokenizer=tokenizer,
        engine=ScriptedEngine(tokenizer, scripted_policy()),
        diagnostics=hooks,
    ).fit()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def problem_file(tmp_path):
    return write_problems(tmp_path / "problems.jsonl")


def test_a_hook_is_called_at_its_three_points_and_its_metrics_are_logged(tmp_path, problem_file):
    plain, probe = Probe(False), Probe(True)
    records = _fit(tmp_path / "hooked", problem_file, [plain, probe])
    assert probe.calls == ["start 0", "pre 1", "pre 2", "eval 2"] == plain.calls
    assert [r.get("probe/evaluated") for r in records] == [None, 1.0]
    assert all(0 < r["probe/L_plus_share"] <= 0.5 for r in records)  # P = 0.1 of the T+ half at most
    # the moments come when one hook asks, for every hook of that step: [B, T, 2], sum_j p_j^2 in (0, 1]
    moments = probe.batches[0].moments
    assert moments is not None and moments.shape == (*probe.batches[0].logprobs.shape, 2)
    assert bool(((moments[..., 0] > 0) & (moments[..., 0] <= 1))[probe.batches[0].mask.bool()].all())
    # ... and not at all without a hook that asks: the same run, same numbers
    alone = Probe(False)
    again = _fit(tmp_path / "alone", problem_file, [alone])
    assert alone.batches[0].moments is None
    for key in ("loss", "entropy", "stare/L_plus"):
        assert [r[key] for r in again] == [r[key] for r in records], key


def test_grpo_ds_has_no_pre_update_pass_to_read(tmp_path, problem_file):
    probe = Probe(False)
    _fit(tmp_path, problem_file, [probe], "algorithm.name=grpo_ds")
    assert probe.calls == ["start 0", "eval 2"]
