"""STEER, STAPO, EntroAdv, the first-order weighting and the adaptive entropy coefficient, worked by hand.

Each batch has interpreter output (mask 0) holding values that would change every result if it were
read; the expected numbers are derived in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.token_weighting import (
    AdaptiveEntropyCoefficient,
    entroadv_advantages,
    first_order_entropy_effect,
    first_order_weights,
    stapo_weights,
    steer_weights,
)
from stare_agent.config import ConfigError, load_config

# ----------------------------------------------------------------------------------------------
# STEER
# ----------------------------------------------------------------------------------------------

# Row 0: A = +1, two model tokens; row 1: A = -1, three. log p + H is 0 or 1 on every model token:
#   row 0: log p = -1, -2   H = 1, 3   -> log p + H = 0, 1
#   row 1: log p = -0.5, -1, -3   H = 0.5, 2, 4   -> 0, 1, 1
# On-policy Omega = A (1 - p)(log p + H), so |Omega|:
#   row 0: 0,  1 - e^-2 = 0.864665
#   row 1: 0,  1 - e^-1 = 0.632121,  1 - e^-3 = 0.950213
STEER_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
STEER_A = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
STEER_LOGP = torch.tensor([[-1.0, -2.0, -0.01], [-0.5, -1.0, -3.0]])
STEER_H = torch.tensor([[1.0, 3.0, 9.0], [0.5, 2.0, 4.0]])


def test_steer_maps_abs_omega_inversely_onto_0_8_to_1_2():
    # lo = 0, hi = 0.950213: w = 1.2 - |Omega| * 0.4 / 0.950213
    #   |Omega| 0        -> 1.2
    #   0.864665 -> 1.2 - 0.4 * 0.909970 = 0.836012
    #   0.632121 -> 1.2 - 0.4 * 0.665242 = 0.933904
    #   0.950213 -> 0.8
    w, metrics = steer_weights(STEER_A, STEER_LOGP, STEER_H, STEER_MASK)
    expected = torch.tensor([[1.2, 0.836012, 1.0], [1.2, 0.933904, 0.8]])
    assert torch.allclose(w, expected, atol=1e-6)
    assert metrics["steer/weight_mean"] == pytest.approx(
        (1.2 + 0.836012 + 1.2 + 0.933904 + 0.8) / 5, abs=1e-6
    )
    assert metrics["steer/abs_omega_mean"] == pytest.approx((0.864665 + 0.632121 + 0.950213) / 5, abs=1e-6)


def test_steer_reads_pi_old_and_maps_each_micro_batch_alone():
    # pi_old = p / 2 on every token doubles every Omega: lo and hi double too, the weights stay
    old = STEER_LOGP - math.log(2.0)
    w_old, _ = steer_weights(STEER_A, STEER_LOGP, STEER_H, STEER_MASK, old_logprobs=old)
    w, _ = steer_weights(STEER_A, STEER_LOGP, STEER_H, STEER_MASK)
    assert torch.allclose(w_old, w, atol=1e-6)
    # each row its own block: row 0's hi is 0.864665, so its second token gets 0.8; row 1 as before
    w, _ = steer_weights(
        STEER_A, STEER_LOGP, STEER_H, STEER_MASK, scope="micro_batch", micro_batches=[[0], [1]]
    )
    assert torch.allclose(w, torch.tensor([[1.2, 0.8, 1.0], [1.2, 0.933904, 0.8]]), atol=1e-6)
    # every |Omega| equal (all 0 here: log p + H = 0 everywhere): the midpoint (0.8 + 1.2) / 2 = 1
    w, _ = steer_weights(STEER_A, STEER_LOGP, -STEER_LOGP, STEER_MASK)
    assert torch.equal(w, torch.ones(2, 3))


# ----------------------------------------------------------------------------------------------
# STAPO
# ----------------------------------------------------------------------------------------------

# Row 0: A = +1, four model tokens; row 1: A = -0.5, two (then interpreter output).
# p < tau_p = 0.002 means log p < log 0.002 = -6.2146:
#   row 0: log p = -7, -8, -0.1, -9  -> candidates columns 0, 1, 3 with H = 0.2, 1.0, 0.5
#   row 1: A < 0, never a candidate (its -7 is not one)
# tau_h = the 0.75-quantile of {0.2, 0.5, 1.0}: position 0.75 * (3 - 1) = 1.5, halfway from 0.5 to 1.0
#       = 0.75, so S = {H < 0.75} = columns 0 (0.2) and 3 (0.5)
# N = 6 model tokens, |S| = 2: the others weigh 6 / 4 = 1.5
STAPO_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
STAPO_A = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, 9.0, 9.0]])
STAPO_LOGP = torch.tensor([[-7.0, -8.0, -0.1, -9.0], [-7.0, -0.2, -20.0, -20.0]])
STAPO_H = torch.tensor([[0.2, 1.0, 0.1, 0.5], [0.1, 0.3, 0.0, 0.0]])


def test_stapo_silences_improbable_low_entropy_positive_tokens_and_renormalises():
    w, metrics = stapo_weights(STAPO_A, STAPO_LOGP, STAPO_H, STAPO_MASK)
    assert w.tolist() == [[0.0, 1.5, 1.5, 0.0], [1.5, 1.5, 1.0, 1.0]]
    assert metrics["stapo/frac_silenced"] == pytest.approx(2 / 6)
    assert metrics["stapo/frac_candidates"] == pytest.approx(3 / 6)
    # on-policy l_t = -A_t: the kept tokens' losses are -1, -1 (row 0) and 0.5, 0.5 (row 1), so the
    # paper's mean over the kept tokens is (-1 - 1 + 0.5 + 0.5) / 4 = -0.25 = sum_t w_t l_t / 6
    loss, _ = policy_loss(STAPO_LOGP, STAPO_LOGP, STAPO_A, STAPO_MASK, w)
    assert float(loss) == pytest.approx(-0.25)


def test_stapo_per_micro_batch_and_its_defaults():
    # row 0 alone: N = 4, |S| = 2 -> 4 / 2 = 2; row 1 has no candidate: all 1
    w, _ = stapo_weights(
        STAPO_A, STAPO_LOGP, STAPO_H, STAPO_MASK, scope="micro_batch", micro_batches=[[0], [1]]
    )
    assert w.tolist() == [[0.0, 2.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    # q = 1: tau_h = the largest candidate entropy 1.0, strictly below it: 0.2 and 0.5 again
    w, _ = stapo_weights(STAPO_A, STAPO_LOGP, STAPO_H, STAPO_MASK, q=1.0)
    assert w[0].tolist() == [0.0, 1.5, 1.5, 0.0]
    # tau_p = 1e-4 (log = -9.21): no token is that improbable, nothing is silenced
    w, metrics = stapo_weights(STAPO_A, STAPO_LOGP, STAPO_H, STAPO_MASK, tau_p=1e-4)
    assert torch.equal(w, torch.ones(2, 4)) and metrics["stapo/frac_silenced"] == 0.0
    with pytest.raises(ValueError, match="the paper uses 0.002 and 0.75"):
        stapo_weights(STAPO_A, STAPO_LOGP, STAPO_H, STAPO_MASK, q=0.0)


# ----------------------------------------------------------------------------------------------
# EntroAdv
# ----------------------------------------------------------------------------------------------


def test_entroadv_adds_a_clipped_detached_entropy_term():
    # alpha = 0.4, kappa = 2: psi = min(0.4 H, |A| / 2)
    #   row 0, A = 1   (cap 0.5):  H 0.5 -> 0.2 -> 1.2;   H 3.0 -> min(1.2, 0.5) = 0.5 -> 1.5
    #   row 1, A = -0.5 (cap 0.25): H 0.5 -> 0.2 -> -0.3;  H 1.0 -> min(0.4, 0.25) = 0.25 -> -0.25
    # (a negative advantage never changes sign); the interpreter column keeps its A
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    A = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, 0.0]])
    H = torch.tensor([[0.5, 3.0, 7.0], [0.5, 1.0, 7.0]], requires_grad=True)
    shaped, metrics = entroadv_advantages(A, H, mask)
    assert torch.allclose(shaped, torch.tensor([[1.2, 1.5, 0.0], [-0.3, -0.25, 0.0]]))
    assert not shaped.requires_grad  # H is detached: an offset, not a gradient path
    # sum psi = 0.2 + 0.5 + 0.2 + 0.25 = 1.15 over 4 tokens; sum |A| = 3
    assert metrics["entroadv/psi_mean"] == pytest.approx(1.15 / 4)
    assert metrics["entroadv/psi_ratio"] == pytest.approx(1.15 / 3)
    with pytest.raises(ValueError, match="kappa > 1"):
        entroadv_advantages(A, H, mask, kappa=1.0)


# ----------------------------------------------------------------------------------------------
# The first-order weighting (ours)
# ----------------------------------------------------------------------------------------------

# Every position has p = (0.7, 0.2, 0.1): H = 0.801819, moments (sum p^2, sum p^2 log p) =
# (0.54, -0.262174), and S = sum_j p_j^2 (log p_j + H) = 0.170808, so c = p_o (log p_o + H) - S:
#   o = 0.7: 0.7 * 0.445144 - S =  0.140793
#   o = 0.2: 0.2 * -0.807619 - S = -0.332332
#   o = 0.1: 0.1 * -1.500767 - S = -0.320885
# Row 0, A = +1, samples 0.7, 0.1: e = -A c = -0.140793, +0.320885
# Row 1, A = -1, samples 0.7, 0.2, 0.1: e = c = +0.140793, -0.332332, -0.320885
# F+ = 0.320885 + 0.140793 = 0.461677;  F- = 0.140793 + 0.332332 + 0.320885 = 0.794010
# lam = (F- - F+) / (F- + F+) = 0.332332 / 1.255687 = 0.264662
P = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
H0 = float(-(P * P.log()).sum())
FO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
FO_A = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
FO_LOGP = torch.tensor([[0.7, 0.1, 0.2], [0.7, 0.2, 0.1]], dtype=torch.float64).log()
FO_H = torch.full((2, 3), H0, dtype=torch.float64)
FO_M = torch.stack([(P * P).sum(), (P * P * P.log()).sum()]).expand(2, 3, 2)  # [2, 3, 2]


def test_c_t_by_hand():
    c = first_order_entropy_effect(FO_LOGP, FO_H, FO_M)
    assert torch.allclose(
        c[1], torch.tensor([0.140793, -0.332332, -0.320885], dtype=torch.float64), atol=1e-6
    )


def test_first_order_weights_balance_the_flows_up_to_lambda_max():
    # lambda_max 0.5 > 0.264662: the raising tokens weigh 1.264662, the lowering ones 0.735338, and
    # the weighted flow 1.264662 * 0.461677 - 0.735338 * 0.794010 = 0.583866 - 0.583866 = 0
    w, metrics = first_order_weights(FO_A, FO_LOGP, FO_H, FO_M, FO_MASK, gate_on=True, lambda_max=0.5)
    up, down = 1 + 0.264662, 1 - 0.264662
    assert torch.allclose(
        w, torch.tensor([[down, up, 1.0], [up, down, down]], dtype=torch.float64), atol=1e-6
    )
    assert metrics["first_order/lambda"] == pytest.approx(0.264662, abs=1e-6)
    assert metrics["first_order/flow"] == pytest.approx((0.461677 - 0.794010) / 5, abs=1e-6)
    assert metrics["first_order/flow_weighted"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["first_order/frac_raising"] == pytest.approx(2 / 5)
    # the default bound 0.1: weights 1.1 and 0.9, flow (1.1 * 0.461677 - 0.9 * 0.794010) / 5 = -0.041353
    w, metrics = first_order_weights(FO_A, FO_LOGP, FO_H, FO_M, FO_MASK, gate_on=True)
    assert torch.allclose(w, torch.tensor([[0.9, 1.1, 1.0], [1.1, 0.9, 0.9]], dtype=torch.float64))
    assert metrics["first_order/flow_weighted"] == pytest.approx(-0.041353, abs=1e-6)


def test_first_order_weights_are_one_with_the_gate_off_or_the_flow_already_raising():
    w, _ = first_order_weights(FO_A, FO_LOGP, FO_H, FO_M, FO_MASK, gate_on=False)
    assert torch.equal(w, torch.ones(2, 3, dtype=torch.float64))
    # row 0 alone: F+ = 0.320885 > F- = 0.140793, lam = max(negative, 0) = 0
    w, _ = first_order_weights(
        FO_A, FO_LOGP, FO_H, FO_M, FO_MASK, gate_on=True, scope="micro_batch", micro_batches=[[0], [1]]
    )
    assert w[0].tolist() == [1.0, 1.0, 1.0] and w[1].tolist() == pytest.approx([1.1, 0.9, 0.9])


# ----------------------------------------------------------------------------------------------
# The adaptive entropy coefficient
# ----------------------------------------------------------------------------------------------


def test_the_adaptive_entropy_coefficient_steps_toward_the_target():
    ctl = AdaptiveEntropyCoefficient(coef=0.0, target=0.3, delta=0.001, max_coef=0.0025)
    assert ctl.beta == 0.0  # c starts at 0
    # below the target three times: c = 0.001, 0.002, then min(0.003, 0.0025) = 0.0025; enabled
    for H, c in ((0.2, 0.001), (0.1, 0.002), (0.25, 0.0025)):
        metrics = ctl.update(H)
        assert ctl.coef == pytest.approx(c) and ctl.beta == pytest.approx(c)
        assert metrics == {"adaptive_entropy/coef": pytest.approx(c), "adaptive_entropy/enabled": 1.0}
    # above it: c = 0.0015, then 0.0005, then max(-0.0005, 0) = 0; the bonus is off (beta 0)
    for H, c in ((0.5, 0.0015), (0.4, 0.0005), (0.3, 0.0)):
        ctl.update(H)
        assert ctl.coef == pytest.approx(c) and ctl.beta == 0.0
    restored = AdaptiveEntropyCoefficient(coef=0.0, target=1.0, delta=0.0, max_coef=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored == ctl


def test_the_config_names_each_method_with_its_sources_defaults():
    alg = load_config(None, ["algorithm.name=stapo"]).algorithm
    assert (alg.steer_w_min, alg.steer_w_max) == (0.8, 1.2)  # STEER's scripts
    assert (alg.stapo_tau_p, alg.stapo_q) == (0.002, 0.75)  # STAPO §4.1
    assert (alg.entroadv_alpha, alg.entroadv_kappa) == (0.4, 2.0)  # Cheng et al. §4, GRPO
    assert (alg.adaptive_entropy_delta, alg.adaptive_entropy_init, alg.adaptive_entropy_max) == (
        1e-4,
        0.0,
        0.005,
    )
    assert alg.adaptive_entropy_target is None and alg.first_order_lambda_max == 0.1  # ours
    ctl = AdaptiveEntropyCoefficient.from_config(alg)
    assert ctl.target == alg.H_tgt == 0.3  # a null target is STARE's H_tgt
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.steer_w_min=1.5"])
    assert str(info.value) == (
        "algorithm: STEER needs 0 < w_min <= w_max (got 1.5, 1.2): its released scripts use 0.8 and 1.2"
    )
    with pytest.raises(ConfigError, match="first-order lambda_max=1.0 must lie in"):
        load_config(None, ["algorithm.first_order_lambda_max=1.0"])
