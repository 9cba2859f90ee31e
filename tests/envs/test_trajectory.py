"""Trajectory and TrajectoryBuilder: masks built segment by segment, validation, JSON round trip."""

from __future__ import annotations

import json

import pytest

from stare_envs.trajectory import Trajectory, TrajectoryBuilder, TrajectoryError


def _example() -> Trajectory:
    b = TrajectoryBuilder(prompt_ids=[5, 6])
    b.append([10, 11, 12], mask=1, logprobs=[-0.1, -0.2, -0.3])
    b.append([20, 21], mask=0)
    b.append([], mask=0)
    b.append([13], mask=1, logprobs=[-1.5])
    return b.build(reward=1.0, info={"problem_id": "p", "tool_calls": [{"duration_s": 0.5}], "correct": True})


def test_builder_makes_masks_logprobs_and_turn_spans():
    t = _example()
    assert t.prompt_ids == [5, 6]
    assert t.response_ids == [10, 11, 12, 20, 21, 13]
    assert t.loss_mask == [1, 1, 1, 0, 0, 1]
    assert t.logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -1.5]
    assert t.turn_spans == [(0, 3), (5, 6)]
    assert t.input_ids == [5, 6, 10, 11, 12, 20, 21, 13]
    assert (t.num_tokens, t.num_sampled_tokens) == (8, 4)
    assert t.reward == 1.0 and t.info["problem_id"] == "p"


def test_build_copies_so_later_appends_do_not_leak():
    b = TrajectoryBuilder([1])
    b.append([2], 1, [-0.5])
    first = b.build()
    b.append([3], 0)
    assert first.response_ids == [2] and len(b) == 2 and b.context_ids == [1, 2, 3]


def test_json_round_trip():
    t = _example()
    line = t.to_json()
    assert "\n" not in line
    back = Trajectory.from_json(line)
    assert back == t
    assert back.turn_spans == [(0, 3), (5, 6)] and isinstance(back.turn_spans[0], tuple)
    assert json.loads(line)["turn_spans"] == [[0, 3], [5, 6]]
    assert Trajectory.from_dict(t.to_dict()) == t


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loss_mask=[1]), "one entry per response token"),
        (dict(loss_mask=[1, 2], logprobs=[-0.1, 0.0]), "mask values must be 0 or 1"),
        (dict(loss_mask=[1, 0], logprobs=[-0.1, -0.2]), "inserted tokens carry 0.0"),
        (dict(logprobs=[0.5, -0.2]), "finite and <= 0"),
        (dict(logprobs=[float("-inf"), -0.2]), "finite and <= 0"),
        (dict(turn_spans=[(1, 2), (0, 1)]), "out of order"),
        (dict(turn_spans=[(0, 3)]), "outside the response"),
        (dict(loss_mask=[1, 0], logprobs=[-0.1, 0.0], turn_spans=[(0, 2)]), "covers mask-0 tokens"),
        (dict(turn_spans=[(0, 1)]), "every sampled token belongs to exactly one model turn"),
    ],
)
def test_validation_names_the_rule(kwargs, message):
    fields = dict(
        prompt_ids=[1], response_ids=[2, 3], loss_mask=[1, 1], logprobs=[-0.1, -0.2], turn_spans=[(0, 2)]
    )
    fields.update(kwargs)
    with pytest.raises(TrajectoryError, match=message):
        Trajectory(**fields)


def test_builder_refuses_inconsistent_segments():
    b = TrajectoryBuilder([1])
    with pytest.raises(TrajectoryError, match="needs one log-prob per token"):
        b.append([2, 3], 1)
    with pytest.raises(TrajectoryError, match="needs one log-prob per token"):
        b.append([2, 3], 1, [-0.1])
    with pytest.raises(TrajectoryError, match="carry no log-probs"):
        b.append([2], 0, [-0.1])
    with pytest.raises(TrajectoryError, match="use 1 for sampled tokens"):
        b.append([2], 2)
    assert len(b) == 0  # nothing half-appended
