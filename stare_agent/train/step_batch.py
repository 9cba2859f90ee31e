"""One step's batch on this rank: its share of the kept groups with their advantages (step 4), its
mini-batches, and the metrics of several optimizer steps combined into the step's.

Kept group i is trained on rank i mod world; advantages are computed over all kept groups (identical
on every rank) before the share is taken, so a group's advantages never depend on the world size.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import torch

from stare_agent.algorithms import grpo_advantages
from stare_agent.train.batch import collate
from stare_agent.train.learner import SUMMED_METRICS, Learner
from stare_envs.trajectory import Trajectory

if TYPE_CHECKING:
    from stare_agent.config import AlgorithmConfig, DataConfig
    from stare_agent.train.diagnostics import PreUpdate
    from stare_agent.train.rollout_phase import Group


def rank_share(
    kept: list[Group], algorithm: AlgorithmConfig, rank: int, world: int
) -> tuple[torch.Tensor, list[Trajectory], torch.Tensor, dict[str, float]]:
    """4. GRPO advantages over all kept groups, then this rank's share (kept group i on rank i mod
    world): (A, trajectories, sequence_ids, metrics). The overlong and void-turn filters mask their
    episodes out of the loss after their rewards shaped the group's advantages."""
    rewards = torch.tensor([r for g in kept for r in g.rewards], dtype=torch.float32)
    group_index = torch.tensor([i for i, g in enumerate(kept) for _ in g.rewards])
    A_all, metrics = grpo_advantages(rewards, group_index=group_index)
    mine = [i for i, g in enumerate(kept) if i % world == rank]
    offsets = np.cumsum([0] + [len(g.rewards) for g in kept])
    rows = [r for i in mine for r in range(offsets[i], offsets[i + 1])]
    trajectories = [t for i in mine for t in kept[i].trajectories]
    if algorithm.overlong_filter:  # DAPO: budget-cut episodes shape their group's advantages, not the loss
        trajectories = [without_loss(t) if budget_cut(t) else t for t in trajectories]
    if algorithm.void_turn_filter:  # SimpleTIR: episodes with a void turn shape advantages, not the loss
        trajectories = [without_loss(t) if t.void_turn else t for t in trajectories]
    sequence_ids = torch.tensor([gid for i in mine for gid in kept[i].global_ids])
    return A_all[rows], trajectories, sequence_ids, metrics


def nothing_to_train(drawn: list[Group], kept: list[Group], data: DataConfig, world: int) -> str:
    """Why a step has fewer groups to train than ranks, in the user's terms, with what to change."""
    if not any(g.trajectories for g in drawn):
        return "every episode of the step was lost to sandbox failures: run `stare-agent sandbox doctor`"
    if data.dynamic_sampling and world == 1:
        return (
            f"none of the {len(drawn)} prompts drawn had samples that scored differently (all right or all "
            "wrong), so every GRPO advantage is 0 and there is nothing to learn from: if this repeats, "
            "match the problems to the model (data.train, data.difficulty) or draw more "
            "(data.max_sampling_batches, data.prompts_per_draw)"
        )
    groups = "groups with reward variance" if data.dynamic_sampling else "groups with episodes"
    return (
        f"{len(kept)} {groups} for {world} ranks, and every rank needs one: raise "
        "data.prompts_per_step or data.max_sampling_batches"
    )


def dropped_entropy(
    learner: Learner, drawn: list[Group], kept: list[Group], rank: int, world: int
) -> torch.Tensor:
    """The entropies of the model tokens of this rank's share of the groups dynamic sampling dropped
    (drawn group n on rank n mod world), for a gate that reads the whole draw; 1-D."""
    trained = {id(g) for g in kept}
    dropped = [
        t for n, g in enumerate(drawn) if id(g) not in trained and n % world == rank for t in g.trajectories
    ]
    if not dropped:
        return torch.empty(0)
    _, H = learner.compute_logprobs_and_entropy(dropped)
    return H[collate(dropped, learner.pad_id)["response_mask"].to(H.device).bool()]


def mini_batch_plan(kept: list[Group], size: int | None, rank: int, world: int) -> list[list[int]]:
    """This rank's rows (indices into its trajectories) of each mini-batch, whole groups each.

    ``size = S`` (``algorithm.ppo_mini_batch_size``) cuts the K kept groups into ``n = ceil(K / S)``
    mini-batches, fewer when a rank would get none (``n <= K // world``): each rank splits its own
    groups (kept group i on rank i mod world) into n consecutive near-equal parts, so mini-batch j
    is about S groups over all ranks and every rank takes the same n optimizer steps. None: one."""
    mine = [g for i, g in enumerate(kept) if i % world == rank]
    offsets = np.cumsum([0] + [len(g.trajectories) for g in mine])
    n = 1 if size is None else max(1, min(-(-len(kept) // size), len(kept) // world))
    return [
        [r for gi in part for r in range(int(offsets[gi]), int(offsets[gi + 1]))]
        for part in np.array_split(np.arange(len(mine)), n)
    ]


@overload
def rows_of(t: torch.Tensor, rows: list[int], part: list[Trajectory]) -> torch.Tensor: ...
@overload
def rows_of(t: torch.Tensor | None, rows: list[int], part: list[Trajectory]) -> torch.Tensor | None: ...
def rows_of(t: torch.Tensor | None, rows: list[int], part: list[Trajectory]) -> torch.Tensor | None:
    """The [B, L-1, ...] token tensor ``t`` of a rank's batch cut to ``rows``, aligned with
    ``collate(part)`` (``part`` the trajectories of those rows: collate pads to the longest)."""
    if t is None:
        return None
    width = max(x.num_tokens for x in part) - 1
    return t[torch.as_tensor(rows, device=t.device), :width]


def pre_update_rows(pre: PreUpdate, rows: list[int], part: list[Trajectory]) -> PreUpdate:
    """``pre`` (before its weights) cut to ``rows``, as :func:`rows_of` cuts each of its tensors."""
    return dataclasses.replace(
        pre,
        advantages=rows_of(pre.advantages, rows, part),
        logprobs=rows_of(pre.logprobs, rows, part),
        entropy=rows_of(pre.entropy, rows, part),
        mask=rows_of(pre.mask, rows, part),
        moments=rows_of(pre.moments, rows, part),
    )


def combine_updates(updates: list[dict[str, float]], *, epochs: int, mini_batches: int) -> dict[str, Any]:
    """The step's metrics from its optimizer steps' (``Learner.update``, epoch-major): one step's as
    they are; for several, token-weighted means (``tokens`` and ``micro_batches`` of one epoch,
    ``lr`` the last, ``skipped`` 1 when every step was dropped), ``ppo/*`` counts, the clip fraction
    and approximate KL of the last and the largest, and ``ppo/per_mini_batch``: each step's
    ``epoch``, ``mini_batch``, loss, clip fractions, approximate KL, ratio mean and gradient norm."""
    if len(updates) == 1:
        return updates[0]
    weight = [u["tokens"] for u in updates]
    total = sum(weight) or 1.0
    keys = [k for k in updates[0] if all(isinstance(u.get(k), int | float) for u in updates)]
    out: dict[str, Any] = {
        k: sum(u[k] * n for u, n in zip(updates, weight, strict=True)) / total for k in keys
    }
    for key in SUMMED_METRICS & set(keys):  # counts: each sequence once, in the first epoch
        out[key] = sum(u[key] for u in updates[:mini_batches])
    out.update(
        tokens=sum(u["tokens"] for u in updates[:mini_batches]),
        micro_batches=sum(u["micro_batches"] for u in updates[:mini_batches]),
        lr=updates[-1]["lr"],
        skipped=float(all(u["skipped"] for u in updates)),
    )
    out["ppo/optimizer_steps"] = float(len(updates))
    out["ppo/mini_batches"] = float(mini_batches)
    out["ppo/epochs"] = float(epochs)
    out["ppo/steps_skipped"] = float(sum(u["skipped"] for u in updates))
    out["ppo/per_mini_batch"] = [  # a list: metrics.jsonl keeps it, trackers take the scalars
        {
            "epoch": i // mini_batches,
            "mini_batch": i % mini_batches,
            **{k: u[k] for k in PER_MINI_BATCH if k in u},
        }
        for i, u in enumerate(updates)
    ]
    for key in ("actor/pg_clipfrac", "actor/ppo_kl"):
        values = [u[key] for u in updates if key in u]
        if values:
            out[f"{key}_last"] = values[-1]
            out[f"{key}_max"] = max(values, key=abs)
    return out


PER_MINI_BATCH = (
    "loss",
    "grad_norm",
    "skipped",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/ratio_mean",
    "tokens",
)
"""``Learner.update`` metrics logged for each optimizer step of a step (``ppo/per_mini_batch``)."""


def budget_cut(trajectory: Trajectory) -> bool:
    """The episode was cut by the response-token budget."""
    return trajectory.info.get("finish_reason") == "budget"


def without_loss(trajectory: Trajectory) -> Trajectory:
    """The episode with every token masked out of the loss (and out of every token count); its turns
    (and so the policy versions that sampled them) go with the loss."""
    n = len(trajectory.response_ids)
    return dataclasses.replace(
        trajectory,
        loss_mask=[0] * n,
        logprobs=[0.0] * n,
        turn_spans=[],
        turn_versions=[],
        version_switches=[],
    )
