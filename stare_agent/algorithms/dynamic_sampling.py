"""Dynamic sampling, the "-ds" of GRPO-ds (DAPO, arXiv 2503.14476; STARE arXiv 2606.19236 step 3).

A group whose G rewards are all equal has all GRPO advantages 0 and so no gradient. Drop such
groups, keep drawing prompt batches (at most ``max_batches`` draws) until ``target_groups``
groups remain, and truncate to exactly ``target_groups`` in the order drawn.

When the cap is hit first: ``on_shortfall="keep"`` returns the groups kept so far (fewer than
the target, possibly none; ``ds/reached_target`` is 0), ``on_shortfall="raise"`` raises
``DynamicSamplingShortfall``. Pure Python: the groups are opaque, only their rewards are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, TypeVar

from stare_agent.errors import StareError


class RewardedGroup(Protocol):
    """Anything with the rewards of one group of responses to the same prompt."""

    @property
    def rewards(self) -> Sequence[float]: ...


G = TypeVar("G", bound=RewardedGroup)


class DynamicSamplingShortfall(StareError, RuntimeError):
    """``max_batches`` were drawn and fewer than ``target_groups`` groups had differing rewards."""


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """True when the group's rewards are not all equal (a group of size 1 never has variance)."""
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("a group with no rewards was drawn: every group needs at least one response")
    return min(values) != max(values)


def dynamic_sampling(
    draw_batch: Callable[[], Sequence[G]],
    *,
    target_groups: int,
    max_batches: int = 10,
    on_shortfall: Literal["keep", "raise"] = "keep",
) -> tuple[list[G], dict[str, float]]:
    """Draw batches of groups until ``target_groups`` groups with reward variance remain.

    Args:
        draw_batch: returns one prompt batch of groups, each with ``.rewards``.
        target_groups: number of groups to return (default 64 in the paper).
        max_batches: cap on calls to ``draw_batch`` (default 10).
        on_shortfall: what to do when the cap is hit first (see the module docstring).

    Returns:
        (the kept groups, at most ``target_groups``, in draw order; metrics ``ds/batches_drawn``,
        ``ds/groups_drawn``, ``ds/groups_dropped`` (all-equal), ``ds/groups_kept`` (returned),
        ``ds/groups_surplus`` (informative but cut by truncation), ``ds/reached_target``).
    """
    if target_groups < 1 or max_batches < 1:
        raise ValueError(
            f"target_groups={target_groups} and max_batches={max_batches} must be >= 1: e.g. 64 and 10"
        )
    if on_shortfall not in ("keep", "raise"):
        raise ValueError(f"on_shortfall={on_shortfall!r} is unknown: use 'keep' or 'raise'")
    kept: list[G] = []
    batches = drawn = dropped = 0
    while len(kept) < target_groups and batches < max_batches:
        batch = draw_batch()
        batches += 1
        drawn += len(batch)
        for group in batch:
            if has_reward_variance(group.rewards):
                kept.append(group)
            else:
                dropped += 1
    surplus = max(len(kept) - target_groups, 0)
    kept = kept[:target_groups]
    reached = len(kept) == target_groups
    if not reached and on_shortfall == "raise":
        raise DynamicSamplingShortfall(
            f"dynamic sampling kept {len(kept)} of {target_groups} groups after max_batches={max_batches} "
            f"({dropped} of {drawn} groups had all-equal rewards): raise max_batches or lower target_groups"
        )
    metrics = {
        "ds/batches_drawn": float(batches),
        "ds/groups_drawn": float(drawn),
        "ds/groups_dropped": float(dropped),
        "ds/groups_kept": float(len(kept)),
        "ds/groups_surplus": float(surplus),
        "ds/reached_target": float(reached),
    }
    return kept, metrics
