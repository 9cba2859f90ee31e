"""Dual-clip PPO loss times STARE weights; expected values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.stare import stare_weights


def _on_policy_case():
    # row 0: A = +1 on 2 model tokens (+1 pad); row 1: A = -2 on 3 model tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    A = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    weights = torch.tensor([[1.1, 1.0, 1.0], [1.0, 0.9, 1.0]])
    logp = torch.tensor([[-0.5, -1.0, -3.0], [-0.2, -2.0, -0.7]], requires_grad=True)
    return logp, A, mask, weights


@pytest.mark.parametrize(
    ("agg", "kwargs", "expected"),
    [
        # rho = 1, so l_t = -A: row 0 -> -1, -1; row 1 -> 2, 2, 2 (dual clip min(20, 2) = 2)
        # weighted: -1.1 - 1 = -2.1 and 2 + 1.8 + 2 = 5.8; total 3.7 over 5 model tokens
        ("token-mean", {}, 3.7 / 5),
        ("token-mean", {"token_count": 10}, 3.7 / 10),
        ("seq-mean-token-sum", {}, (-2.1 + 5.8) / 2),
        ("seq-mean-token-mean", {}, (-2.1 / 2 + 5.8 / 3) / 2),
        ("seq-mean-token-sum-norm", {"norm_length": 4}, 3.7 / 4),
    ],
)
def test_on_policy_aggregations_by_hand(agg, kwargs, expected):
    logp, A, mask, weights = _on_policy_case()
    loss, metrics = policy_loss(logp, logp.detach(), A, mask, weights, agg=agg, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ratio_mean"] == 1.0


def test_on_policy_gradient_is_minus_w_a_over_n():
    logp, A, mask, weights = _on_policy_case()
    loss, _ = policy_loss(logp, logp.detach(), A, mask, weights)
    loss.backward()
    # d/dlogp (-w A rho) at rho = 1 is -w A; divided by 5 tokens; pads get 0
    expected = torch.tensor([[-1.1, -1.0, 0.0], [2.0, 1.8, 2.0]]) / 5
    torch.testing.assert_close(logp.grad, expected)


def test_clip_and_dual_clip_by_hand():
    # four single tokens; log-ratios chosen to give rho = 1.5, 0.5, 0.5, 20, and one clamped at +20
    log_ratio = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), math.log(20.0), 50.0]])
    A = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    logp_old = torch.zeros_like(log_ratio)
    logp = log_ratio.clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, logp_old, A, torch.ones_like(A))
    # token 1: A=+1, rho 1.5: l1 = -1.5, l2 = -1.28 -> max = -1.28 (clipped, no gradient)
    # token 2: A=+1, rho 0.5: l1 = -0.5, l2 = -0.8  -> -0.5 (unclipped, gradient -rho = -0.5)
    # token 3: A=-1, rho 0.5: l1 = 0.5,  l2 = 0.8   -> lc = 0.8; min(10, 0.8) = 0.8 (clipped)
    # token 4: A=-1, rho 20:  l1 = 20,   l2 = 1.28  -> lc = 20; min(10, 20) = 10 (dual clip)
    # token 5: A=+1, log-ratio 50 clamped to 20: l1 = -e^20, l2 = -1.28 -> -1.28
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 10 - 1.28) / 5, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 5, 0.0, 0.0, 0.0]]))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 5)  # tokens 1, 3 and 5 have l2 > l1
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # token 4


def _random_case(seed: int, B: int = 4, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    A = torch.randn(B, 1, generator=g) * mask
    logp_old = -torch.rand(B, T, generator=g) * 3
    logp = (logp_old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_(True)
    return logp, logp_old, A, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gate_off_equals_grpo_ds_bit_for_bit(agg):
    logp, logp_old, A, mask = _random_case(0)
    weights, *_ = stare_weights(A, logp, mask, gate_on=False, variant="C2")
    loss_grpo, _ = policy_loss(logp, logp_old, A, mask, agg=agg)
    (grad_grpo,) = torch.autograd.grad(loss_grpo, logp)
    loss_stare, _ = policy_loss(logp, logp_old, A, mask, weights, agg=agg)
    (grad_stare,) = torch.autograd.grad(loss_stare, logp)
    assert torch.equal(weights, torch.ones_like(weights))
    assert torch.equal(loss_grpo, loss_stare)
    assert torch.equal(grad_grpo, grad_stare)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), garbage=st.sampled_from([float("nan"), float("inf"), -1e30, 5.0]))
def test_mask_zero_tokens_never_change_loss_or_gradient(seed, garbage):
    logp, logp_old, A, mask = _random_case(seed)
    weights = 1 + torch.rand_like(logp_old)
    pad = ~mask.bool()
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, metrics = policy_loss(logp, logp_old, A, mask, weights, agg=agg)
        (grad,) = torch.autograd.grad(loss, logp)
        dirty = torch.where(pad, garbage, logp)
        loss2, metrics2 = policy_loss(
            dirty, torch.where(pad, -garbage, logp_old), torch.where(pad, garbage, A), mask,
            torch.where(pad, garbage, weights), agg=agg,
        )  # fmt: skip
        (grad2,) = torch.autograd.grad(loss2, logp)
        assert torch.equal(loss, loss2) and torch.equal(grad, grad2) and metrics == metrics2
        assert not grad[pad].any()


def test_errors_name_the_fix():
    logp, logp_old, A, mask = _random_case(1)
    with pytest.raises(ValueError, match="use one of token-mean"):
        policy_loss(logp, logp_old, A, mask, agg="sum")
    with pytest.raises(ValueError, match="pass norm_length="):
        policy_loss(logp, logp_old, A, mask, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="clip_c > 1"):
        policy_loss(logp, logp_old, A, mask, clip_c=1.0)
    with pytest.raises(ValueError, match="share one"):
        policy_loss(logp[:, :2], logp_old, A, mask)
