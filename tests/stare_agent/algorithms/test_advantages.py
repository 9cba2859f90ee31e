"""GRPO advantages and their broadcast; expected values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages


def test_two_groups_of_four_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    A, metrics = grpo_advantages(rewards, group_size=4)
    # group 1: mean 0.25; squared deviations 0.5625 + 3 * 0.0625 = 0.75; unbiased var 0.75 / 3 = 0.25; std 0.5
    # group 2: mean 0.5; squared deviations 4 * 0.25 = 1; var 1 / 3; std sqrt(1/3) = 0.57735...
    std2 = math.sqrt(1 / 3)
    expected = (
        [0.75 / 0.500001] + [-0.25 / 0.500001] * 3 + [0.5 / (std2 + 1e-6)] * 2 + [-0.5 / (std2 + 1e-6)] * 2
    )
    torch.testing.assert_close(A, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert metrics["grpo/groups"] == 2.0
    assert metrics["grpo/groups_all_equal"] == 0.0
    assert metrics["grpo/reward_mean"] == pytest.approx(3 / 8)


def test_group_index_in_any_order_and_id():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    A, _ = grpo_advantages(rewards, group_index=torch.tensor([7, 3, 7, 3]))
    # each group is {1, 0}: mean 0.5, var ((0.5)^2 * 2) / 1 = 0.5, std sqrt(0.5) = 0.70711
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(A, torch.tensor([a, -a, -a, a]))


def test_singleton_group_uses_mean_0_std_1_and_equal_groups_get_0():
    rewards = torch.tensor([2.0, 1.0, 1.0])
    A, metrics = grpo_advantages(rewards, group_index=torch.tensor([0, 1, 1]))
    # singleton: (2 - 0) / (1 + 1e-6); group {1, 1}: deviation 0 -> advantage exactly 0
    torch.testing.assert_close(A, torch.tensor([2.0 / (1 + 1e-6), 0.0, 0.0]))
    assert A[1].item() == 0.0 and A[2].item() == 0.0
    assert metrics["grpo/groups_all_equal"] == 1.0


def test_integer_rewards_become_float():
    A, _ = grpo_advantages(torch.tensor([1, 0]), group_size=2)
    assert A.dtype == torch.float32
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(A, torch.tensor([a, -a]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of group_index or group_size"),
        ({"group_size": 2, "group_index": torch.zeros(3)}, "exactly one"),
        ({"group_size": 2}, "do not split into groups of 2"),
        ({"group_index": torch.zeros(2)}, "must match rewards"),
    ],
)
def test_errors_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), **kwargs)


def test_broadcast_only_to_model_tokens():
    A = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    A_tok = broadcast_to_tokens(A, mask)
    assert torch.equal(A_tok, torch.tensor([[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]))
    assert not torch.signbit(A_tok[1, 0])  # +0, not -0


def test_broadcast_shape_error():
    with pytest.raises(ValueError, match="one advantage per row"):
        broadcast_to_tokens(torch.ones(3), torch.ones(2, 4))
