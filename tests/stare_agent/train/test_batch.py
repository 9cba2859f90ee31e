"""Collation of trajectories: padded and packed layouts and micro-batch splits, checked by hand."""

from __future__ import annotations

import pytest
import torch

from stare_agent.train.batch import bucket_by_length, collate, pack, split_by_token_budget
from stare_envs.trajectory import Trajectory, TrajectoryBuilder


def _two() -> list[Trajectory]:
    a = TrajectoryBuilder([1, 2])
    a.append([3], 1, [-0.1])
    a.append([4], 0)
    a.append([5], 1, [-0.3])
    b = TrajectoryBuilder([6])
    b.append([7], 1, [-0.7])
    return [a.build(reward=1.0), b.build(reward=0.0)]


def _of_length(n: int) -> Trajectory:
    b = TrajectoryBuilder([1] * (n - 1))
    b.append([2], 1, [-0.5])
    return b.build()


def test_collate_pads_right_and_scores_the_next_token():
    batch = collate(_two(), pad_id=0, advantages=[2.0, -1.0])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # column t scores token t + 1
    assert batch["targets"].tolist() == [[2, 3, 4, 5], [7, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]
    torch.testing.assert_close(batch["old_logprobs"], torch.tensor([[0, -0.1, 0, -0.3], [-0.7, 0, 0, 0]]))
    assert batch["advantages"].tolist() == [[0, 2, 0, 2], [-1, 0, 0, 0]]
    assert batch["rewards"].tolist() == [1.0, 0.0]
    assert batch["prompt_lengths"].tolist() == [2, 1] and batch["lengths"].tolist() == [5, 2]
    assert batch["input_ids"].dtype == torch.long and batch["response_mask"].dtype == torch.float32


def test_collate_without_advantages_leaves_zeros_and_moves_to_device():
    batch = collate(_two(), pad_id=9, device="cpu")
    assert batch["advantages"].abs().sum().item() == 0.0
    assert batch["input_ids"][1].tolist() == [6, 7, 9, 9, 9]
    assert all(v.device.type == "cpu" for v in batch.values())


def test_pack_concatenates_and_masks_sequence_boundaries():
    batch = pack(_two(), advantages=[2.0, -1.0])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 7] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 5
    assert batch["targets"].tolist() == [[2, 3, 4, 5, 6, 7]]
    # column 4 would score the second sequence's first (prompt) token from the first sequence: mask 0
    assert batch["response_mask"].tolist() == [[0, 1, 0, 1, 0, 1]]
    torch.testing.assert_close(batch["old_logprobs"], torch.tensor([[0, -0.1, 0, -0.3, 0, -0.7]]))
    assert batch["advantages"].tolist() == [[0, 2, 0, 2, 0, -1]]
    assert batch["sequence_ids"].tolist() == [[0, 0, 0, 0, 0, 1]]
    assert batch["rewards"].tolist() == [1.0, 0.0]


def test_pack_never_scores_across_a_boundary_even_without_a_prompt():
    a = TrajectoryBuilder([1])
    a.append([2], 1, [-0.2])
    b = TrajectoryBuilder([])
    b.append([3, 4], 1, [-0.3, -0.4])
    batch = pack([a.build(), b.build()])
    # columns: 0 scores 2 (sampled), 1 would score 3 across the boundary, 2 scores 4 (sampled)
    assert batch["response_mask"].tolist() == [[1, 0, 1]]
    torch.testing.assert_close(batch["old_logprobs"], torch.tensor([[-0.2, 0, -0.4]]))


def test_padded_and_packed_agree_on_the_scored_tokens():
    trajectories = _two()
    padded, packed = collate(trajectories, pad_id=0), pack(trajectories)
    pick = padded["response_mask"].bool()
    assert (
        padded["targets"][pick].tolist()
        == packed["targets"][packed["response_mask"].bool()].tolist()
        == [3, 5, 7]
    )
    assert padded["old_logprobs"][pick].tolist() == pytest.approx([-0.1, -0.3, -0.7])


def test_split_by_token_budget_counts_padding_or_tokens():
    trajectories = [_of_length(n) for n in (5, 1, 1, 1)]
    assert split_by_token_budget(trajectories, 10) == [[0, 1], [2, 3]]  # 3 x 5 padded > 10
    assert split_by_token_budget(trajectories, 10, padded=False) == [[0, 1, 2, 3]]  # 8 tokens
    assert split_by_token_budget(trajectories, 5) == [[0], [1, 2, 3]]
    assert split_by_token_budget([], 5) == []


def test_bucket_by_length_puts_similar_lengths_together():
    trajectories = [_of_length(n) for n in (2, 9, 3, 8, 9)]
    # in batch order: [2, 9] pads to 18, then [3, 8] to 16, [9] alone: 43 padded tokens for 31
    assert split_by_token_budget(trajectories, 20) == [[0, 1], [2, 3], [4]]
    # longest first (ties in batch order): [9, 9] = 18, [8, 3] = 16 -> then 2 fits: 3 x 8 > 20, alone
    assert bucket_by_length(trajectories, 20) == [[1, 4], [3, 2], [0]]
    assert bucket_by_length(trajectories, 100) == [[1, 4, 3, 2, 0]]
    assert bucket_by_length([], 5) == []
    with pytest.raises(ValueError, match="trajectory 1 has 9 tokens"):  # named by its place in the batch
        bucket_by_length(trajectories, 8)


def test_bucket_by_length_runs_a_long_outlier_alone_when_padding_costs_more_than_a_micro_batch():
    """Each part costs its padded tokens plus MICRO_BATCH_OVERHEAD (64). Lengths 300, 60, 50, 40 (no
    common prompt): together 4 x 300 + 64 = 1264; [300] + [60, 50, 40]: 300 + 64 + 3 x 60 + 64 = 608;
    [300] + [60] + [50, 40]: 364 + 124 + 164 = 652. So the outlier runs alone. Lengths 90, 60, 50, 40:
    together 424; [90] + [60, 50, 40] = 154 + 244 = 398: cut too; 70, 60, 50, 40: 344 < 134 + 244."""
    assert bucket_by_length([_of_length(n) for n in (60, 300, 40, 50)], 10_000) == [[1], [0, 3, 2]]
    assert bucket_by_length([_of_length(n) for n in (90, 60, 50, 40)], 10_000) == [[0], [1, 2, 3]]
    assert bucket_by_length([_of_length(n) for n in (70, 60, 50, 40)], 10_000) == [[0, 1, 2, 3]]


def test_bucket_by_length_counts_a_shared_prompt_once():
    """A GRPO group: one 100-token prompt, responses of 100, 20, 20, 20 tokens (widths 200, 120, 120,
    120). With the prompt counted once (share_prompts): together 100 + 4 x 100 + 64 = 564; [200] +
    [120 x 3]: 200 + 64 + (100 + 3 x 20 + 64) = 488: cut. Responses 60, 20, 20, 20 (widths 160, 120 x 3):
    together 100 + 4 x 60 + 64 = 404 against 224 + 224 = 448: kept together; counting the prompt per
    row instead, 4 x 160 + 64 = 704 against 224 + 3 x 120 + 64 = 648: cut. Sharing the prompt makes
    padding cheaper, so it cuts less."""

    def group(responses: list[int]) -> list[Trajectory]:
        out = []
        for n in responses:
            b = TrajectoryBuilder(list(range(100)))
            b.append([7] * n, 1, [-0.5] * n)
            out.append(b.build())
        return out

    assert bucket_by_length(group([100, 20, 20, 20]), 10_000, share_prompts=True) == [[0], [1, 2, 3]]
    assert bucket_by_length(group([60, 20, 20, 20]), 10_000, share_prompts=True) == [[0, 1, 2, 3]]
    assert bucket_by_length(group([60, 20, 20, 20]), 10_000) == [[0], [1, 2, 3]]


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="raise the token budget to at least"):
        split_by_token_budget([_of_length(11)], 10)
    with pytest.raises(ValueError, match="pass one per trajectory"):
        collate(_two(), pad_id=0, advantages=[1.0])
    with pytest.raises(ValueError, match="pass at least one"):
        pack([])
