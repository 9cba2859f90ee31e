"""What the learner's step reads: the advantages of each group on its own, and STARE's surprisal from
the learner's log-probs, never the engine's. Each test fails on a mutation the rest of the suite let
through (advantages over the whole batch; ``Trajectory.logprobs`` fed to the selection)."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
import torch

from stare_agent.algorithms.stare import stare_weights
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.batch import collate
from stare_agent.train.rollout_phase import Group
from stare_agent.train.step_batch import rank_share
from stare_agent.train.trainer import Trainer
from stare_envs.trajectory import TrajectoryBuilder
from tests.stare_agent.train.scripted_training import scripted_policy, write_problems
from tests.stare_agent.train.test_trainer import make_config


def episode(
    rng: random.Random, prompt: list[int], reward: float, engine_logp: float = -0.5, tool: bool = False
):
    """A one-turn episode of random tokens whose engine log-probs are all ``engine_logp``; with ``tool``,
    a second turn after 8 tokens of tool output (mask 0)."""
    b = TrajectoryBuilder(prompt)
    for turn in range(2 if tool else 1):
        if turn:
            b.append([rng.randint(100, 2000) for _ in range(8)], 0)
        n = rng.randint(6, 12)
        b.append([rng.randint(100, 2000) for _ in range(n)], 1, [engine_logp - 0.01 * i for i in range(n)])
    return b.build(reward=reward)


def groups_of(rewards: list[list[float]], seed: int = 0, tool: bool = False) -> list[Group]:
    rng = random.Random(seed)
    out, gid = [], 0
    for g, rs in enumerate(rewards):
        prompt = [rng.randint(100, 2000) for _ in range(5)]
        trajectories = [episode(rng, prompt, r, tool=tool) for r in rs]
        out.append(Group(g, None, list(rs), trajectories, list(range(gid, gid + len(rs)))))
        gid += len(rs)
    return out


NO_FILTER = types.SimpleNamespace(overlong_filter=False, void_turn_filter=False)


def test_advantages_are_normalized_within_each_group_not_over_the_batch():
    # two groups of 3 with different means (2/3 and 1/3): over the whole batch (mean 1/2) the
    # advantages would differ. By hand: std (n-1) of {1, 1, 0} is sqrt(1/3) = 0.57735, so
    # (1 - 2/3) / 0.57735 = 0.57735 and (0 - 2/3) / 0.57735 = -1.1547; the second group mirrors it.
    kept = groups_of([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    A, trajectories, sequence_ids, _ = rank_share(kept, NO_FILTER, rank=0, world=1)
    s = 3**-0.5
    expected = [s, s, -2 * s, 2 * s, -s, -s]
    assert A.tolist() == pytest.approx(expected, abs=1e-5)
    assert sequence_ids.tolist() == [0, 1, 2, 3, 4, 5] and len(trajectories) == 6


def test_advantages_of_a_rank_are_its_own_groups_rows():
    # two ranks: rank 1 owns group 1 (kept group i on rank i mod world) and its advantages only
    kept = groups_of([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0]])
    A, trajectories, sequence_ids, _ = rank_share(kept, NO_FILTER, rank=1, world=2)
    s = 3**-0.5
    assert A.tolist() == pytest.approx([2 * s, -s, -s], abs=1e-5)
    assert sequence_ids.tolist() == [3, 4, 5] and trajectories == kept[1].trajectories


@pytest.mark.parametrize(("scope", "tool"), [("micro_batch", False), ("global", False), ("global", True)])
def test_stare_ranks_surprisal_by_the_learners_log_probs_not_the_engines(tmp_path, scope, tool):
    """With ``tool``: episodes with tool output between turns; the selection must rank and weight the
    model's tokens only (handing it the whole response, tool output included, with the advantage
    broadcast over it, is a bug STARE's authors' code had)."""
    # The engine's log-probs here fall along each episode (-0.5, -0.51, ...), an order that has
    # nothing to do with the tiny random model's own (near -log V): the selection by the learner's
    # surprisal and the one by the engine's pick different tokens, and the update must get the first.
    problems = write_problems(tmp_path / "problems.jsonl")
    model, tokenizer = tiny_model()
    config = make_config(
        tmp_path, problems, "data.prompts_per_step=3", "data.samples_per_prompt=3",
        f"algorithm.scope={scope}", "algorithm.P=0.3",
        # tool output scored too, so that its log-probs are there for a selection that wrongly reads them
        *(["deepspeed.score_response_only=false"] if tool else []),
    )  # fmt: skip
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    kept = groups_of([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], seed=3, tool=tool)
    seen = {}
    update = trainer.learner.update

    def recording(trajectories, advantages, weights=None, old_logprobs=None, **kw):
        seen["weights"] = weights.clone()
        return update(trajectories, advantages, weights, old_logprobs, **kw)

    try:
        trajectories = [t for g in kept for t in g.trajectories]
        A, *_ = rank_share(kept, trainer.config.algorithm, rank=0, world=1)
        learner_logp, _ = trainer.learner.compute_logprobs_and_entropy(trajectories)
        batch = collate(trajectories, trainer.learner.pad_id)
        mask = batch["response_mask"]
        A_tok = A[:, None] * mask
        split = trainer.learner.micro_batches(trajectories) if scope == "micro_batch" else None

        def weights_by(logp):
            return stare_weights(
                A_tok, logp, mask, gate_on=True, P=0.3, scope=scope, micro_batches=split,
                sequence_ids=torch.arange(len(trajectories)),
            )[0]  # fmt: skip

        by_learner, by_engine = weights_by(learner_logp), weights_by(batch["old_logprobs"])
        assert not torch.equal(by_learner, by_engine)  # the two orders select different tokens
        trainer.learner.update = recording
        trainer.step = 1
        metrics = trainer.learn(kept, kept)
    finally:
        trainer.close()
    assert metrics["gate_on"] == 1
    assert torch.equal(seen["weights"], by_learner)
    assert torch.all(seen["weights"][mask == 0] == 1.0)  # tool output and padding: never reweighted
    assert (seen["weights"] != 1.0).sum() > 0


@pytest.mark.parametrize("flag", ["overlong_filter", "void_turn_filter"])
def test_a_filtered_episode_interrupted_by_a_sync_leaves_the_loss_without_an_error(flag):
    """A budget-cut (or void-turn) episode whose turn a weight sync interrupted
    (``trainer.interrupt_on_sync``: a version switch inside the turn) is masked out of the loss whole,
    its versions with its turns; it still shapes its group's advantages."""
    b = TrajectoryBuilder([5, 6])
    b.append([101, 102, 103, 104], 1, [-0.5] * 4, version=0, version_switches=[(2, 1)])  # 2-3: version 1
    cut = b.build(reward=0.0, info={"finish_reason": "budget"})
    assert cut.token_versions() == [0, 0, 1, 1]
    if flag == "void_turn_filter":
        cut = dataclasses.replace(cut, info={"finish_reason": "void_turn", "void_turn": True})
    whole = episode(random.Random(0), [5, 6], 1.0)
    kept = [Group(0, None, [0.0, 1.0], [cut, whole], [0, 1])]
    algorithm = types.SimpleNamespace(
        overlong_filter=flag == "overlong_filter", void_turn_filter=flag == "void_turn_filter"
    )
    A, trajectories, _, _ = rank_share(kept, algorithm, rank=0, world=1)
    assert A.tolist() == pytest.approx([-(2**-0.5), 2**-0.5], abs=1e-5)  # the reward still counts
    assert sum(trajectories[0].loss_mask) == 0 and trajectories[0].version_switches == []
    assert trajectories[1] is whole
