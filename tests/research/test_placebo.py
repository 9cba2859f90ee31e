"""The random-subset placebos of C2's L- and of STARE's L+: the draw itself, and the closed loop's
``research.L_minus_rule=random`` and ``research.L_plus_rule=random``."""

from __future__ import annotations

import pytest
import torch

from stare_agent.algorithms.selection import selection_blocks
from stare_agent.algorithms.stare import stare_weights
from stare_agent.config import ConfigError
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_research.config import load_research_config
from stare_research.placebo import placebo_seed, random_subset
from stare_research.trainer import ResearchTrainer
from tests.stare_agent.train.scripted_training import overrides, scripted_policy, write_problems


def _c2_selection(seed: int = 0):
    """A batch of 6 rows in 2 micro-batches with STARE's own C2 selection: (T-, L-, the blocks)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 40
    mask = torch.ones(B, T)
    mask[:, 30:] = 0
    A = torch.tensor([1.0, -1.0, -0.5, 0.7, -2.0, -0.3])[:, None].expand(B, T) * mask
    logp = -torch.rand(B, T, generator=g) * 5
    split = [[0, 2, 4], [1, 3, 5]]
    _, _, L_minus, _ = stare_weights(
        A,
        logp,
        mask,
        gate_on=True,
        variant="C2",
        P=0.1,
        W=1.0,
        M=0.9,
        scope="micro_batch",
        micro_batches=split,
    )
    T_minus = mask.bool() & (A < 0)
    return T_minus, L_minus, selection_blocks(B, "micro_batch", split, None, mask.device)


def test_random_subset_has_L_minus_size_per_block_inside_T_minus_and_is_seeded():
    T_minus, L_minus, blocks = _c2_selection()
    assert int(L_minus.sum()) > 0
    sub = random_subset(L_minus, T_minus, blocks, seed=7)
    assert sub.dtype == torch.bool and sub.shape == T_minus.shape
    assert not (sub & ~T_minus).any()  # inside T-
    for rows in blocks:  # exactly |L-| tokens in each block of L-'s own scope
        assert int(sub[rows].sum()) == int(L_minus[rows].sum())
    assert int(sub.sum()) == int(L_minus.sum())
    assert torch.equal(sub, random_subset(L_minus, T_minus, blocks, seed=7))  # reproducible from its seed
    others = [random_subset(L_minus, T_minus, blocks, seed=k) for k in range(8)]
    assert sum(not torch.equal(o, sub) for o in others) >= 7  # the seed matters
    # it is not L- (the top surprisal tokens): a random draw of 3 of 60 T- tokens in a block rarely is
    assert all(not torch.equal(o, L_minus) for o in others)
    assert sum(int((o & L_minus).sum()) for o in others) < sum(int(o.sum()) for o in others) / 2
    with pytest.raises(ValueError, match="inside T-"):
        random_subset(L_minus | ~T_minus, T_minus, blocks, seed=0)


def _capturing(trainer: ResearchTrainer) -> ResearchTrainer:
    """The research trainer, keeping what its method's selection saw and returned, as (pre, the
    micro-batches, (weights, L+, L-, metrics)), L+ and L- the ones the diagnostics read."""
    select = trainer.method.select

    def seen(batch):
        out = select(batch)
        trainer.seen = (
            batch.pre,
            batch.micro_batches,
            (out.weights, out.diagnosed["L_plus"], out.diagnosed["L_minus"], out.metrics),
        )
        return out

    trainer.method.select = seen  # type: ignore[method-assign]
    return trainer


def _c2_step(tmp_path, name: str, *extra: str, variant: str = "C2"):
    problems = write_problems(tmp_path / f"{name}.jsonl")
    base = overrides(str(tmp_path / name), str(problems), 1)
    config = load_research_config(
        None, [*base, f"algorithm.variant={variant}", "algorithm.gate=always_on", "algorithm.M=0.5", *extra]
    )
    model, tokenizer = tiny_model()
    trainer = _capturing(
        ResearchTrainer(
            config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
        )
    )
    try:
        trainer.step = 1
        return trainer.train_step(), trainer.seen
    finally:
        trainer.close()


def test_the_closed_loops_placebo_moves_c2s_attenuation_to_random_negative_tokens(tmp_path):
    """The same step as C2 and as its placebo: the same L+ (weight W) and L- count; the placebo puts M on
    the seeded draw of ``random_subset`` over C2's own L- and T- and blocks, and 1 on the rest of T-."""
    c2_record, (pre, split, (w_c2, L_plus, L_minus, _)) = _c2_step(tmp_path, "c2")
    record, (pre_p, _, (w, L_plus_p, placebo, _)) = _c2_step(
        tmp_path, "placebo", "research.L_minus_rule=random"
    )
    assert torch.equal(pre.logprobs, pre_p.logprobs) and torch.equal(L_plus, L_plus_p)  # the same batch
    T_minus = pre.mask.bool() & (pre.advantages < 0)
    blocks = selection_blocks(L_minus.shape[0], "micro_batch", split, None, L_minus.device)
    assert int(L_minus.sum()) >= 2 and not torch.equal(placebo, L_minus)
    assert torch.equal(placebo, random_subset(L_minus, T_minus, blocks, placebo_seed(0, 1)))
    assert torch.equal(w_c2 == 0.5, L_minus) and torch.equal(w == 0.5, placebo)
    assert torch.equal(w == 1.1, w_c2 == 1.1) and torch.equal(w == 1.1, L_plus)  # L+ untouched
    on_mask = pre.mask.bool()
    assert torch.all(w[on_mask & ~placebo & ~L_plus] == 1.0)  # C2's L- outside the draw: back to 1
    assert record["stare/L_minus"] == c2_record["stare/L_minus"] == int(L_minus.sum())
    overlap = int((placebo & L_minus).sum()) / int(placebo.sum())
    assert record["stare/L_minus_placebo_overlap"] == pytest.approx(overlap)
    assert record["loss"] != pytest.approx(c2_record["loss"], rel=1e-9)


def test_l_pluss_placebo_moves_ws_amplification_to_random_positive_tokens(tmp_path):
    """O1 at W 3 and its L+ placebo on the same step: the placebo puts W on the seeded draw of
    ``random_subset`` over O1's own L+ and T+ and blocks, 1 on the rest of T+, and L- is untouched."""
    o1_record, (pre, split, (w_o1, L_plus, _, _)) = _c2_step(tmp_path, "o1", "algorithm.W=3.0", variant="O1")
    record, (pre_p, _, (w, placebo, L_minus_p, _)) = _c2_step(
        tmp_path, "o1-placebo", "algorithm.W=3.0", "research.L_plus_rule=random", variant="O1"
    )
    assert torch.equal(pre.logprobs, pre_p.logprobs)  # the same batch
    T_plus = pre.mask.bool() & (pre.advantages > 0)
    blocks = selection_blocks(L_plus.shape[0], "micro_batch", split, None, L_plus.device)
    assert int(L_plus.sum()) >= 2 and not torch.equal(placebo, L_plus)
    assert torch.equal(placebo, random_subset(L_plus, T_plus, blocks, placebo_seed(0, 1)))
    assert int(placebo.sum()) == int(L_plus.sum()) and not (placebo & ~T_plus).any()
    assert torch.equal(w_o1 == 3.0, L_plus) and torch.equal(w == 3.0, placebo)
    assert torch.all(w[pre.mask.bool() & ~placebo] == 1.0) and not L_minus_p.any()  # O1: no L-
    overlap = int((placebo & L_plus).sum()) / int(placebo.sum())
    assert record["stare/L_plus_placebo_overlap"] == pytest.approx(overlap)
    # at ratio 1 the loss is the weighted advantages' sum, equal when W moves between tokens of one
    # advantage; the gradient is not
    assert record["grad_norm"] != pytest.approx(o1_record["grad_norm"], rel=1e-6)


def test_both_placebos_in_one_c2_step_leave_no_surprisal_selection(tmp_path):
    _, (pre, _, (w_c2, L_plus, L_minus, _)) = _c2_step(tmp_path, "c2", "algorithm.W=3.0")
    _, (_, _, (w, plus, minus, _)) = _c2_step(
        tmp_path, "both", "algorithm.W=3.0", "research.L_plus_rule=random", "research.L_minus_rule=random"
    )
    assert torch.equal(w == 3.0, plus) and torch.equal(w == 0.5, minus)
    assert int(plus.sum()) == int(L_plus.sum()) and int(minus.sum()) == int(L_minus.sum())
    assert not torch.equal(plus, L_plus) and not torch.equal(minus, L_minus)


def test_the_placebo_is_refused_outside_c2_in_the_micro_batch_scope():
    with pytest.raises(ConfigError, match=r"research.L_minus_rule=random is C2's placebo, .* variant=O1"):
        load_research_config(None, ["research.L_minus_rule=random"])
    with pytest.raises(ConfigError, match=r"scope=global: set algorithm.name=stare algorithm.variant=C2"):
        load_research_config(
            None, ["research.L_minus_rule=random", "algorithm.variant=C2", "algorithm.scope=global"]
        )
    with pytest.raises(
        ConfigError, match=r"research.L_minus_rule='any' is not valid: use one of top_k, random"
    ):
        load_research_config(None, ["research.L_minus_rule=any"])
    with pytest.raises(
        ConfigError, match=r"L_plus_rule=random is STARE's L\+ placebo, .*algorithm.name=grpo_ds"
    ):
        load_research_config(None, ["research.L_plus_rule=random", "algorithm.name=grpo_ds"])
    with pytest.raises(
        ConfigError, match=r"scope=global: set algorithm.name=stare algorithm.scope=micro_batch"
    ):
        load_research_config(None, ["research.L_plus_rule=random", "algorithm.scope=global"])
