"""The field's token-weighting methods in the real trainer and learner: one step of each on the tiny
model with scripted rollouts (every group of 2 is {0, 1}), its selection recomputed from the step's own
pre-update pass; the adaptive entropy coefficient through a checkpoint and a resume."""

from __future__ import annotations

import json
import types

import pytest
import torch

from stare_agent.algorithms.token_weighting import (
    entroadv_advantages,
    first_order_weights,
    stapo_weights,
    steer_weights,
)
from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.batch import collate
from stare_agent.train.learner import Learner
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.scripted_training import scripted_policy, write_problems
from tests.stare_agent.train.test_learner import LINEAR_ADAM, _trajectory
from tests.stare_agent.train.test_trainer import make_config


@pytest.fixture
def problem_file(tmp_path):
    return write_problems(tmp_path / "problems.jsonl")


def one_step(tmp_path, problem_file, name, *extra):
    """One step of ``algorithm.name=name`` (global scope) on a fresh tiny model: (metrics, the step's
    pre-update pass, the arguments of its ``Learner.update``)."""
    model, tokenizer = tiny_model()
    config = make_config(
        tmp_path / name,
        problem_file,
        f"algorithm.name={name}",
        "algorithm.scope=global",
        "trainer.steps=1",
        *extra,
    )
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    passes, calls = [], []
    select, update = trainer.method.select, trainer.learner.update
    trainer.method.select = lambda batch: passes.append(batch.pre) or select(batch)  # type: ignore[method-assign]

    def recording(self, trajectories, advantages, weights=None, old_logprobs=None, **kw):
        calls.append({"advantages": advantages, "weights": weights, **kw})
        return update(trajectories, advantages, weights, old_logprobs, **kw)

    trainer.learner.update = types.MethodType(recording, trainer.learner)
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    return metrics, (passes[0] if passes else None), calls[0]


def test_steer_trains_with_its_weights_of_the_pre_update_pass(tmp_path, problem_file):
    metrics, pre, call = one_step(tmp_path, problem_file, "steer")
    expected, _ = steer_weights(pre.advantages, pre.logprobs, pre.entropy, pre.mask)
    assert torch.equal(call["weights"], expected)
    on = call["weights"][pre.mask.bool()]
    assert float(on.min()) == pytest.approx(0.8) and float(on.max()) == pytest.approx(1.2)
    assert metrics["skipped"] == 0 and 0.8 <= metrics["steer/weight_mean"] <= 1.2


def test_stapo_trains_with_its_silencing_of_the_pre_update_pass(tmp_path, problem_file):
    metrics, pre, call = one_step(tmp_path, problem_file, "stapo")
    expected, _ = stapo_weights(pre.advantages, pre.logprobs, pre.entropy, pre.mask)
    assert torch.equal(call["weights"], expected)
    # the tiny random model gives its scripted tokens p << 0.002: a quarter-ish of the positive
    # candidates are silenced, the rest renormalised by N / (N - |S|)
    mask = pre.mask.bool()
    n, s = int(mask.sum()), int((call["weights"][mask] == 0).sum())
    assert 0 < s < n and metrics["stapo/frac_silenced"] == pytest.approx(s / n)
    kept = call["weights"][mask & (call["weights"] != 0)]
    assert torch.allclose(kept, torch.full_like(kept, n / (n - s)))


def test_entroadv_trains_with_its_shaped_advantages(tmp_path, problem_file):
    metrics, pre, call = one_step(tmp_path, problem_file, "entroadv")
    expected, _ = entroadv_advantages(pre.advantages, pre.entropy, pre.mask)
    assert call["weights"] is None and torch.equal(call["advantages"], expected)
    psi = (call["advantages"] - pre.advantages)[pre.mask.bool()]
    assert float(psi.min()) >= 0 and torch.all(psi <= pre.advantages[pre.mask.bool()].abs() / 2 + 1e-7)
    assert metrics["entroadv/psi_mean"] > 0


def test_the_first_order_weighting_trains_with_c_t_of_the_pre_update_pass(tmp_path, problem_file):
    # H_tgt above the tiny model's entropy: the gate is on
    metrics, pre, call = one_step(tmp_path, problem_file, "first_order", "algorithm.H_tgt=100")
    assert pre.moments is not None and metrics["gate_on"] == 1
    expected, _ = first_order_weights(
        pre.advantages, pre.logprobs, pre.entropy, pre.moments, pre.mask, gate_on=True
    )
    assert torch.equal(call["weights"], expected)
    lam = metrics["first_order/lambda"]
    assert 0 <= lam <= 0.1 and abs(metrics["first_order/flow_weighted"]) <= abs(metrics["first_order/flow"])
    weights = call["weights"][pre.mask.bool()].tolist()
    assert all(min(abs(w - v) for v in (1 - lam, 1.0, 1 + lam)) < 1e-6 for w in weights)


def test_the_adaptive_entropy_coefficient_is_checkpointed_and_restored(tmp_path, problem_file):
    """Target 100 (above any entropy): c steps up by delta = 0.01 every step. Step 1 trains with the
    start, c = 0 (no bonus); its checkpoint holds c = 0.01; the resumed step 2 trains with 0.01."""
    extra = [
        "algorithm.name=adaptive_entropy",
        "algorithm.adaptive_entropy_target=100",
        "algorithm.adaptive_entropy_delta=0.01",
        "algorithm.adaptive_entropy_max=1.0",
    ]

    def fit(steps, resume):
        model, tokenizer = tiny_model()
        config = make_config(tmp_path, problem_file, *extra, f"trainer.steps={steps}")
        engine = ScriptedEngine(tokenizer, scripted_policy())
        return Trainer(config, model=model, tokenizer=tokenizer, engine=engine, resume=resume).fit()

    first = fit(1, resume=False)["last"]
    assert first["adaptive_entropy/beta"] == 0.0 and first["adaptive_entropy/coef"] == pytest.approx(0.01)
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("*/trainer_state.json")).read_text())
    assert state["method"]["coef"] == pytest.approx(0.01)
    second = fit(2, resume=True)["last"]
    assert second["adaptive_entropy/beta"] == pytest.approx(0.01)
    assert second["adaptive_entropy/coef"] == pytest.approx(0.02)


def test_the_learner_subtracts_the_given_entropy_coefficient_times_the_token_mean_entropy():
    """``Learner.update(entropy_coef=beta)``, zero advantages: the loss is -beta times the token-mean
    entropy of the model's tokens (the adaptive coefficient's bonus); beta = 0 adds nothing."""
    batch = [_trajectory(i, *s) for i, s in enumerate([(4, 6, 3, 2), (7, 3, 5, 4)])]
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(
        model, tokenizer, load_config(None, [*LINEAR_ADAM, "algorithm.name=adaptive_entropy"])
    )
    _, entropy = learner.compute_logprobs_and_entropy(batch)
    mask = collate(batch, tokenizer.pad_token_id)["response_mask"].bool()
    assert learner.update(batch, [0.0, 0.0], entropy_coef=0.0)["loss"] == 0.0
    out = learner.update(batch, [0.0, 0.0], entropy_coef=0.5)  # the policy is unchanged: beta 0 moved nothing
    assert out["loss"] == pytest.approx(-0.5 * float(entropy[mask].mean()), rel=1e-5)
