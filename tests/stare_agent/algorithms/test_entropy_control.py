"""KL-Cov, Clip-Cov, the forking-token update and the entropy bonus, worked by hand.

The batch: 2 sequences x 3 positions; row 0 has 2 model tokens
(its third column is interpreter output, mask 0, with values that would win every ranking),
row 1 has 3. Advantages +1 (row 0) and -1 (row 1); over the 5 model tokens:

    mean A    = (1 + 1 - 1 - 1 - 1) / 5 = -0.2
    mean logp = (-0.5 - 2.0 - 1.0 - 0.5 - 3.0) / 5 = -1.4
    cov       = (logp + 1.4) * (A + 0.2):
                row 0:  0.9 * 1.2 = 1.08,   -0.6 * 1.2 = -0.72
                row 1:  0.4 * -0.8 = -0.32,  0.9 * -0.8 = -0.72,  -1.6 * -0.8 = 1.28
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stare_agent.algorithms.entropy_control import (
    clip_cov_weights,
    forking_token_weights,
    kl_cov_coefficients,
    token_covariance,
)
from stare_agent.algorithms.losses import policy_loss
from tests.conftest import require

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
A = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
LOGP = torch.tensor([[-0.5, -2.0, 50.0], [-1.0, -0.5, -3.0]])
H = torch.tensor([[0.1, 0.9, 5.0], [0.5, 0.3, 0.9]])


def test_covariance_by_hand_over_model_tokens_only():
    cov = token_covariance(A, LOGP, torch.arange(2), MASK.bool(), None)
    expected = torch.tensor([[1.08, -0.72, 0.0], [-0.32, -0.72, 1.28]], dtype=torch.float64)
    assert torch.allclose(cov, expected, atol=1e-12)


def test_kl_cov_takes_the_top_floor_k_n_tokens_by_covariance():
    # k = 0.4: floor(0.4 * 5) = 2 tokens, cov 1.28 and 1.08
    coef, metrics = kl_cov_coefficients(A, LOGP, MASK, k=0.4, coef=2.0)
    assert coef.tolist() == [[2.0, 0.0, 0.0], [0.0, 0.0, 2.0]]
    assert metrics["kl_cov/frac_selected"] == pytest.approx(2 / 5)
    assert metrics["kl_cov/cov_selected_mean"] == pytest.approx((1.08 + 1.28) / 2)
    # the paper's k = 0.2 %: max(1, floor(0.002 * 5)) = 1 token, the largest covariance
    coef, _ = kl_cov_coefficients(A, LOGP, MASK)
    assert coef.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]


def test_kl_cov_in_the_micro_batch_scope_centres_inside_each_block():
    # each row alone: A is constant in a block, so every cov is 0; the tie goes to position 0
    coef, _ = kl_cov_coefficients(A, LOGP, MASK, k=0.2, scope="micro_batch", micro_batches=[[0], [1]])
    assert coef.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_kl_cov_penalty_in_the_loss():
    # off-policy by 0.1 nats everywhere: rho = e^0.1 inside the clip range, so l_t = -A e^0.1;
    # sum over the 5 tokens = (2 - 3) * -e^0.1 = e^0.1; the penalty adds 1 * 0.1 on 2 tokens
    old = LOGP - 0.1
    coef = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    base, _ = policy_loss(LOGP, old, A, MASK)
    loss, _ = policy_loss(LOGP, old, A, MASK, kl_coef=coef)
    assert float(base) == pytest.approx(math.exp(0.1) / 5)
    assert float(loss) == pytest.approx((math.exp(0.1) + 0.2) / 5)
    # on-policy (one step per batch) the penalty and its gradient are exactly 0
    lp1, lp2 = LOGP.clone().requires_grad_(), LOGP.clone().requires_grad_()
    l1, _ = policy_loss(lp1, lp1.detach(), A, MASK)
    l2, _ = policy_loss(lp2, lp2.detach(), A, MASK, kl_coef=coef)
    l1.backward()
    l2.backward()
    assert float(l1.detach()) == float(l2.detach()) and torch.equal(lp1.grad, lp2.grad)


def test_clip_cov_detaches_random_tokens_with_covariance_inside_the_bounds():
    # candidates with 1 < cov < 5: 1.08 (row 0, pos 0) and 1.28 (row 1, pos 2)
    w, metrics = clip_cov_weights(A, LOGP, MASK, r=0.4)  # floor(0.4 * 5) = 2: both
    assert w.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert metrics["clip_cov/frac_candidates"] == pytest.approx(2 / 5)
    picks = set()
    for seed in range(20):  # the paper's r = 2e-4: max(1, 0) = 1 of the 2, at random
        w, metrics = clip_cov_weights(A, LOGP, MASK, generator=torch.Generator().manual_seed(seed))
        zeros = {tuple(ix) for ix in (w == 0).nonzero().tolist()}
        assert len(zeros) == 1 and zeros <= {(0, 0), (1, 2)}
        picks |= zeros
    assert picks == {(0, 0), (1, 2)}
    w, _ = clip_cov_weights(A, LOGP, MASK, r=0.4, lb=1.1)  # only 1.28 qualifies
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="lb < ub"):
        clip_cov_weights(A, LOGP, MASK, lb=5.0, ub=1.0)


def test_the_loss_leaves_zero_weight_tokens_in_the_denominator():
    w = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = policy_loss(LOGP, LOGP, A, MASK, w)  # rho = 1: l = -A; kept -1 (row 0) + 1 + 1
    assert float(loss) == pytest.approx(1 / 5)


def test_forking_tokens_are_the_top_rho_by_entropy():
    # rho = 0.4: ceil(2) = 2 of the 5 model tokens, H = 0.9 and 0.9 (the mask-0 H = 5 never counts)
    w, metrics = forking_token_weights(H, MASK, rho=0.4)
    assert w.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    assert metrics == {
        "forking/frac_selected": pytest.approx(0.4),
        "forking/H_selected_min": pytest.approx(0.9),
    }
    # the paper's rho = 0.2: ceil(1) = 1; the tie at 0.9 goes to the smaller (sequence, position)
    w, _ = forking_token_weights(H, MASK)
    assert w.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # per micro-batch: row 0 keeps ceil(0.8) = 1 token, row 1 ceil(1.2) = 2 (0.9 and 0.5)
    w, _ = forking_token_weights(H, MASK, rho=0.4, scope="micro_batch", micro_batches=[[0], [1]])
    assert w.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]]


def test_entropy_bonus_subtracts_beta_times_the_token_mean_entropy():
    # A = 0: no policy term; masked sum of H = 0.1 + 0.9 + 0.5 + 0.3 + 0.9 = 2.7 over 5 tokens
    entropy = H.clone().requires_grad_()
    loss, _ = policy_loss(LOGP, LOGP, torch.zeros_like(A), MASK, entropy=entropy, entropy_coef=0.5)
    assert float(loss) == pytest.approx(-0.5 * 2.7 / 5)
    loss.backward()
    assert torch.allclose(entropy.grad, torch.tensor([[-0.1, -0.1, 0.0], [-0.1, -0.1, -0.1]]))


# ----------------------------------------------------------------------------------------------
# two gloo ranks: a global top fraction is global

SPLIT = 1  # rank 0 holds row 0, rank 1 row 1


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        out = {
            "kl": kl_cov_coefficients(A[rows], LOGP[rows], MASK[rows], k=0.4),
            "clip": clip_cov_weights(
                A[rows], LOGP[rows], MASK[rows], r=0.2, generator=torch.Generator().manual_seed(3)
            ),
            "fork": forking_token_weights(H[rows], MASK[rows], rho=0.4),
        }
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_select_as_one_process(tmp_path):
    require("train", None if dist.is_available() else "this torch build has no torch.distributed")
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    mp.spawn(_rank_main, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    single = {
        "kl": kl_cov_coefficients(A, LOGP, MASK, k=0.4),
        "clip": clip_cov_weights(A, LOGP, MASK, r=0.2, generator=torch.Generator().manual_seed(3)),
        "fork": forking_token_weights(H, MASK, rho=0.4),
    }
    for name, (tensor, metrics) in single.items():
        assert torch.equal(torch.cat([ranks[0][name][0], ranks[1][name][0]]), tensor), name
        for r in ranks:
            assert r[name][1] == pytest.approx(metrics, nan_ok=True), name
