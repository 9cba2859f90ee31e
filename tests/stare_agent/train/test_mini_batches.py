"""PPO mini-batches and epochs (``algorithm.ppo_mini_batch_size`` / ``ppo_epochs``): the plan, the old
policy, where the clip and KL-Cov act, and when STARE's selection is taken. Real DeepSpeed on CPU,
the tiny model, scripted rollouts whose rewards are known (every group of 2 is {0, 1})."""

from __future__ import annotations

import json
import types

import pytest
import torch

from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.metrics import read_metrics
from stare_agent.models import tiny_model
from stare_agent.train.learner import Learner
from stare_agent.train.step_batch import combine_updates, mini_batch_plan
from stare_agent.train.trainer import Trainer
from tests.stare_agent.train.scripted_training import scripted_policy
from tests.stare_agent.train.test_trainer import make_config

PROMPTS = ["data.prompts_per_step=4", "trainer.steps=1"]


@pytest.fixture
def problem_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    pairs = [(2, 3), (10, 7), (40, 2), (6, 6), (9, 1), (8, 5)]
    path.write_text(
        "".join(
            json.dumps({"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a, b in pairs
        )
    )
    return path


def one_step(tmp_path, problem_file, name, *extra, spy=None, monkeypatch=None):
    """One training step of a fresh tiny model; returns (metrics, the learner's parameters after,
    the arguments of every ``Learner.update`` call when ``spy``)."""
    model, tokenizer = tiny_model()
    config = make_config(tmp_path / name, problem_file, *PROMPTS, *extra)
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    calls: list[dict] = []
    if spy is not None:
        update = trainer.learner.update

        def recording(self, trajectories, advantages, weights=None, old_logprobs=None, **kw):
            calls.append(
                {
                    "n": len(trajectories),
                    "weights": None if weights is None else weights.clone(),
                    "old": None if old_logprobs is None else old_logprobs.clone(),
                    "kl_coef": kw.get("kl_coef"),
                }
            )
            return update(trajectories, advantages, weights, old_logprobs, **kw)

        trainer.learner.update = types.MethodType(recording, trainer.learner)
    try:
        trainer.step = 1
        metrics = trainer.train_step()
        params = {k: v.detach().clone() for k, v in trainer.learner.module.state_dict().items()}
    finally:
        trainer.close()
    return metrics, params, calls


def test_four_mini_batches_take_four_steps_whose_ratio_leaves_one_and_clips(tmp_path, problem_file):
    metrics, _, calls = one_step(
        tmp_path, problem_file, "four", "algorithm.name=grpo_ds", "algorithm.ppo_mini_batch_size=1",
        "optim.lr=1e-2", spy=True,
    )  # fmt: skip
    # 4 kept groups of 2, one group per mini-batch: 4 optimizer steps of 2 episodes each
    assert [c["n"] for c in calls] == [2, 2, 2, 2]
    assert all(c["old"] is not None for c in calls)  # the pre-update log-probs are the old policy
    steps = metrics["ppo/per_mini_batch"]
    assert [(s["epoch"], s["mini_batch"]) for s in steps] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert metrics["ppo/optimizer_steps"] == 4 and metrics["ppo/steps_skipped"] == 0
    # the first step is on the pre-update policy: rho = 1 (up to the eval/train forward's rounding)
    assert abs(steps[0]["actor/ppo_kl"]) < 1e-5 and steps[0]["actor/pg_clipfrac"] == 0
    # later steps see a policy three earlier steps moved: the ratio leaves 1 and the clip acts
    assert any(abs(s["actor/ppo_kl"]) > 1e-3 for s in steps[1:])
    assert metrics["actor/pg_clipfrac_max"] > 0
    assert metrics["tokens"] == sum(s["tokens"] for s in steps)


def test_kl_cov_equals_grpo_ds_with_one_step_and_differs_with_four_mini_batches(tmp_path, problem_file):
    params = {}
    for name, extra in [
        ("grpo_1", ["algorithm.name=grpo_ds"]),
        ("klcov_1", ["algorithm.name=kl_cov", "algorithm.kl_cov_k=0.5"]),
        ("grpo_4", ["algorithm.name=grpo_ds", "algorithm.ppo_mini_batch_size=1"]),
        ("klcov_4", ["algorithm.name=kl_cov", "algorithm.kl_cov_k=0.5", "algorithm.ppo_mini_batch_size=1"]),
    ]:
        _, params[name], _ = one_step(tmp_path, problem_file, name, *extra)
    # on-policy, one step: |logp - logp_old| is 0 with gradient 0, so the penalty does nothing
    assert all(torch.equal(params["grpo_1"][k], params["klcov_1"][k]) for k in params["grpo_1"])
    # four steps: from the second on, logp leaves logp_old and the penalty pulls it back
    assert any(not torch.equal(params["grpo_4"][k], params["klcov_4"][k]) for k in params["grpo_4"])


@pytest.mark.parametrize("selection", ["per_mini_batch", "pre_update"])
def test_stare_selection_per_mini_batch_or_from_the_pre_update_pass(
    tmp_path, problem_file, monkeypatch, selection
):
    passes: list[int] = []
    score = Learner.compute_logprobs_and_entropy

    def counting(self, trajectories, **kw):
        passes.append(len(trajectories))
        return score(self, trajectories, **kw)

    monkeypatch.setattr(Learner, "compute_logprobs_and_entropy", counting)
    metrics, _, calls = one_step(
        tmp_path, problem_file, selection, "algorithm.ppo_mini_batch_size=2", "algorithm.ppo_epochs=2",
        f"algorithm.selection={selection}", "algorithm.scope=global", "optim.lr=1e-2", spy=True,
    )  # fmt: skip
    assert len(calls) == 4 and metrics["ppo/optimizer_steps"] == 4 and metrics["gate_on"] == 1
    if selection == "pre_update":
        # one pass (the whole batch), its L+ kept for every mini-batch and epoch
        assert passes == [8]
        assert torch.equal(calls[0]["weights"], calls[2]["weights"])
        assert torch.equal(calls[1]["weights"], calls[3]["weights"])
    else:
        # the whole batch, then each mini-batch but the first of the first epoch, on the policy then
        assert passes == [8, 4, 4, 4]
        assert not torch.equal(calls[0]["weights"], calls[2]["weights"])  # re-ranked by the moved policy
    for c in calls:  # P = 0.1 of each unit's T+ tokens: the global scope takes ceil(0.1 |T+|) per mini-batch
        reweighted = int((c["weights"] > 1).sum())
        assert reweighted >= 1


def test_the_mini_batch_plan_gives_every_rank_whole_groups_and_the_same_number_of_steps():
    def plan(K, S, world, rank, sizes=None):
        groups = [types.SimpleNamespace(trajectories=[0] * (sizes[i] if sizes else 2)) for i in range(K)]
        return mini_batch_plan(groups, S, rank, world)

    assert plan(4, None, 1, 0) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert plan(4, 1, 1, 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan(4, 3, 1, 0) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # ceil(4 / 3) = 2 parts of 2 groups
    # 5 groups on 2 ranks (rank 0: groups 0, 2, 4; rank 1: 1, 3), S = 1: 5 wanted, 5 // 2 = 2 possible
    assert plan(5, 1, 2, 0) == [[0, 1, 2, 3], [4, 5]]
    assert plan(5, 1, 2, 1) == [[0, 1], [2, 3]]
    # groups of unequal size (drop_episode): rows follow each group's own length
    assert plan(3, 1, 1, 0, sizes=[2, 1, 3]) == [[0, 1], [2], [3, 4, 5]]


def test_combined_metrics_weigh_by_tokens_and_keep_each_step():
    def update(tokens, clip, kl, skipped=0.0, lr=1.0):
        return {"loss": clip, "tokens": tokens, "micro_batches": 1.0, "lr": lr, "skipped": skipped,
                "grad_norm": 1.0, "actor/pg_clipfrac": clip, "actor/ppo_kl": kl, "entropy": 2.0}  # fmt: skip

    one = update(10, 0.0, 0.0)
    assert combine_updates([one], epochs=1, mini_batches=1) is one
    out = combine_updates(
        [update(10, 0.0, 0.0), update(30, 0.2, -0.05), update(10, 0.1, 0.01, skipped=1.0, lr=0.5), update(30, 0.4, 0.02)],
        epochs=2, mini_batches=2,
    )  # fmt: skip
    assert out["tokens"] == 40 and out["micro_batches"] == 2  # one epoch's
    assert out["actor/pg_clipfrac"] == pytest.approx((0 * 10 + 0.2 * 30 + 0.1 * 10 + 0.4 * 30) / 80)
    assert out["actor/pg_clipfrac_last"] == 0.4 and out["actor/pg_clipfrac_max"] == 0.4
    assert out["actor/ppo_kl_max"] == -0.05  # the largest in size, with its sign
    assert out["skipped"] == 0.0 and out["ppo/steps_skipped"] == 1 and out["lr"] == 1.0
    assert [(s["epoch"], s["mini_batch"]) for s in out["ppo/per_mini_batch"]] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    # a count (sequences the rollout correction took out) adds up over one epoch's mini-batches
    counted = [
        dict(update(10, 0.0, 0.0), **{"rollout_correction/seq_rejected": float(k)}) for k in (1, 2, 1, 2)
    ]
    assert combine_updates(counted, epochs=2, mini_batches=2)["rollout_correction/seq_rejected"] == 3.0


def test_the_learning_rate_schedule_steps_once_a_trainer_step_whatever_its_mini_batches(
    tmp_path, problem_file
):
    """trainer.steps 4, linear decay to 0 after a warmup of 2, 4 mini-batches a step: every optimizer
    step of trainer step t trains at lr0 * f(t - 1), f = 0, 1/2, 1, 1/2 (transformers' linear schedule
    in trainer steps), and each step logs the lr after its schedule step. Stepped at every optimizer
    step instead, the horizon ran out inside step 1 and steps 2-4 trained at lr 0."""
    model, tokenizer = tiny_model()
    config = make_config(
        tmp_path, problem_file, "data.prompts_per_step=4", "trainer.steps=4", "algorithm.name=grpo_ds",
        "algorithm.ppo_mini_batch_size=1", "optim.lr=1e-2", "optim.warmup_steps=2", "optim.schedule=linear",
    )  # fmt: skip
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    used: list[float] = []
    update = trainer.learner.update

    def recording(self, *args, **kw):
        used.append(float(self.scheduler.get_last_lr()[0]))
        return update(*args, **kw)

    trainer.learner.update = types.MethodType(recording, trainer.learner)
    trainer.fit()
    logged = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert used == pytest.approx([1e-2 * f for f in (0.0, 0.5, 1.0, 0.5) for _ in range(4)])
    assert logged == pytest.approx([1e-2 * f for f in (0.5, 1.0, 0.5, 0.0)])


@pytest.mark.slow  # three trainer steps of four mini-batches
def test_the_gate_of_every_mini_batch_is_the_pre_update_policys(tmp_path, problem_file):
    """The gate is taken once a step, on the pre-update pass, whatever the mini-batches (the paper's step
    4): with H_tgt a hair above that pass's H-bar every mini-batch is weighted (gate on), a hair below
    none is (gate off), though the policy moves between mini-batches (lr 1e-2) and a gate taken again
    on it would flip one way or the other."""
    extra = ("algorithm.ppo_mini_batch_size=1", "algorithm.scope=global", "optim.lr=1e-2")
    metrics, _, _ = one_step(tmp_path, problem_file, "probe", *extra, "algorithm.H_tgt=100")
    Hbar = metrics["entropy"]  # the pre-update pass's (the same start and rollouts in each run below)
    for name, H_tgt, on in (("above", Hbar * (1 + 1e-6), True), ("below", Hbar * (1 - 1e-6), False)):
        metrics, _, calls = one_step(
            tmp_path, problem_file, name, *extra, f"algorithm.H_tgt={H_tgt}", spy=True
        )
        assert metrics["entropy"] == pytest.approx(Hbar, rel=1e-9) and metrics["gate_on"] == int(on)
        assert len(calls) == 4
        assert [bool((c["weights"] > 1).any()) for c in calls] == [on] * 4, name
