"""Dynamic sampling (the "-ds" of GRPO-ds) with scripted batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stare_agent.algorithms.dynamic_sampling import (
    DynamicSamplingShortfall,
    dynamic_sampling,
    has_reward_variance,
)


@dataclass(frozen=True)
class Group:
    name: str
    rewards: tuple[float, ...]


class Script:
    """draw_batch that returns the scripted batches in order and counts its calls."""

    def __init__(self, batches: list[list[Group]]):
        self.batches, self.calls = batches, 0

    def __call__(self) -> list[Group]:
        batch = self.batches[self.calls % len(self.batches)]
        self.calls += 1
        return batch


def test_drops_equal_groups_and_truncates_in_draw_order():
    draw = Script(
        [
            [Group("a", (1, 1)), Group("b", (0, 1)), Group("c", (0, 0))],
            [Group("d", (1, 0)), Group("e", (1, 0)), Group("f", (1, 1))],
            [Group("never", (0, 1))],
        ]
    )
    kept, metrics = dynamic_sampling(draw, target_groups=2, max_batches=10)
    # batch 1 keeps b (a, c dropped); batch 2 keeps d, e (f dropped) -> 3 kept, truncated to [b, d]
    assert [g.name for g in kept] == ["b", "d"]
    assert draw.calls == 2  # stops as soon as the target is reached
    assert metrics == {
        "ds/batches_drawn": 2.0,
        "ds/groups_drawn": 6.0,
        "ds/groups_dropped": 3.0,
        "ds/groups_kept": 2.0,
        "ds/groups_surplus": 1.0,
        "ds/reached_target": 1.0,
    }


def test_cap_hit_keep_returns_fewer_groups():
    draw = Script([[Group("x", (1, 1, 1)), Group("y", (0.0, 0.5))]])
    kept, metrics = dynamic_sampling(draw, target_groups=5, max_batches=3)
    # 3 draws x 1 informative group each = 3 < 5
    assert [g.name for g in kept] == ["y", "y", "y"]
    assert draw.calls == 3
    assert metrics["ds/reached_target"] == 0.0
    assert metrics["ds/groups_dropped"] == 3.0


def test_cap_hit_raise_names_the_fix():
    draw = Script([[Group("x", (0, 0))]])
    with pytest.raises(
        DynamicSamplingShortfall, match="kept 0 of 4 groups after max_batches=2.*raise max_batches"
    ):
        dynamic_sampling(draw, target_groups=4, max_batches=2, on_shortfall="raise")


def test_reward_variance_rules():
    assert has_reward_variance([0, 1])
    assert not has_reward_variance([1.0])  # a singleton group has no variance
    assert not has_reward_variance([0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="at least one response"):
        has_reward_variance([])


@pytest.mark.parametrize(
    "kwargs",
    [{"target_groups": 0}, {"target_groups": 2, "max_batches": 0}, {"target_groups": 2, "on_shortfall": "x"}],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        dynamic_sampling(Script([[Group("a", (0, 1))]]), **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=4), max_size=5),
        min_size=1,
        max_size=4,
    ),
    target=st.integers(1, 8),
    cap=st.integers(1, 6),
)
def test_properties(batches, target, cap):
    script = Script([[Group(f"{i}.{j}", tuple(r)) for j, r in enumerate(b)] for i, b in enumerate(batches)])
    kept, m = dynamic_sampling(script, target_groups=target, max_batches=cap)
    assert all(has_reward_variance(g.rewards) for g in kept)
    assert len(kept) <= target and (len(kept) == target) == bool(m["ds/reached_target"])
    assert script.calls == m["ds/batches_drawn"] <= cap
    assert m["ds/groups_drawn"] == m["ds/groups_dropped"] + m["ds/groups_kept"] + m["ds/groups_surplus"]
