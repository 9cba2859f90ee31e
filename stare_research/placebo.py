"""The random-subset placebo of STARE-C2's L- (issue 44): the same attenuation M on tokens drawn at random.

C2 multiplies the weight of L-, the top ``P`` of the negative-advantage tokens T- by surprisal, by ``M``.
Its placebo attenuates as many tokens of T- drawn uniformly at random instead, so that a difference
between the two is put on the surprisal selection, not on attenuating some negative tokens at all. Used
by ``benchmarks/adam_lever.py`` (one real optimizer step) and by the closed loop
(``research.L_minus_rule=random``, :class:`stare_research.trainer.ResearchTrainer`). L+'s placebo
(``research.L_plus_rule=random``) is the same draw over T+: W on as many positive-advantage tokens as L+
holds, drawn at random (its arguments below are then L+ and T+).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SEED_STRIDE = 1_000_003
"""A placebo draw's seed is ``seed * SEED_STRIDE + step``: one fixed draw per (seed, step)."""


def placebo_seed(seed: int, step: int) -> int:
    """The generator seed of the draw at ``step`` of a run (or benchmark) seeded ``seed``."""
    return int(seed) * SEED_STRIDE + int(step)


def random_subset(
    L_minus: torch.Tensor, T_minus: torch.Tensor, blocks: Sequence[torch.Tensor], seed: int
) -> torch.Tensor:
    """The placebo's tokens: inside each selection block (rows ``blocks[i]``, the scope of L-), exactly
    as many tokens as L- holds there, drawn uniformly without replacement from that block's T- with a
    ``torch.Generator`` seeded by ``seed`` (CPU, so the draw is the same on any device). One draw: the
    placebo arm is one random subset per batch, not an expectation over subsets."""
    if L_minus.shape != T_minus.shape:
        raise ValueError(f"L- {tuple(L_minus.shape)} and T- {tuple(T_minus.shape)} must have one shape")
    L_minus, T_minus = L_minus.bool(), T_minus.bool()
    if (L_minus & ~T_minus).any():
        raise ValueError("L- must lie inside T-")
    gen = torch.Generator().manual_seed(int(seed))
    out = torch.zeros_like(T_minus)
    for rows in blocks:
        rows = rows.to(T_minus.device)
        k = int(L_minus[rows].sum())
        cand = T_minus[rows].nonzero()  # [n, 2]: (row within the block, position), row-major order
        if k == 0:
            continue
        pick = cand[torch.randperm(len(cand), generator=gen)[:k].to(cand.device)]
        sub = torch.zeros_like(T_minus[rows])
        sub[pick[:, 0], pick[:, 1]] = True
        out[rows] = sub
    return out
