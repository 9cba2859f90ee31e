"""First-order entropy effect of a token's update: hand values, autograd, and the metrics of an update."""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.algorithms.logprobs import chunked_logprobs_and_entropy, logprobs_and_entropy_from_logits
from stare_agent.algorithms.stare import stare_weights
from stare_research.entropy_effect import (
    first_order_entropy_effect,
    first_order_response,
    logit_grad_norm,
    mechanism_metrics,
    raising_tokens,
)

# The issue's example: p = (0.7, 0.2, 0.1), worked out by hand.
#   H        = -(0.7 ln 0.7 + 0.2 ln 0.2 + 0.1 ln 0.1) = 0.24967 + 0.32189 + 0.23026 = 0.80182
#   sum p^2  = 0.49 + 0.04 + 0.01 = 0.54
#   sum p^2 ln p = 0.49 (-0.35667) + 0.04 (-1.60944) + 0.01 (-2.30259) = -0.26217
#   sum p^2 (ln p + H) = -0.26217 + 0.80182 * 0.54 = 0.17081
#   argmax (o = 0): c = 0.7 (-0.35667 + 0.80182) - 0.17081 = 0.31160 - 0.17081 = +0.14079 (A > 0 lowers H)
#   rare  (o = 2): c = 0.1 (-2.30259 + 0.80182) - 0.17081 = -0.15008 - 0.17081 = -0.32088 (A > 0 raises H)
#   g = sqrt(1 - 2 p_o + 0.54): argmax sqrt(0.14) = 0.37417, rare sqrt(1.34) = 1.15758
P3 = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
H3, M3 = 0.80182, (0.54, -0.26217)
C_ARGMAX, C_RARE = 0.14079, -0.32088
G_ARGMAX, G_RARE = 0.37417, 1.15758


def _inputs(tokens):
    logits = P3.log().expand(len(tokens), 3)
    return logits, torch.tensor(tokens)


def test_moments_and_effect_of_the_issues_example_by_hand():
    logits, targets = _inputs([0, 2])
    logp, entropy, moments = logprobs_and_entropy_from_logits(logits, targets, with_moments=True)
    assert entropy.tolist() == pytest.approx([H3, H3], abs=1e-5)
    assert moments.flatten().tolist() == pytest.approx([*M3, *M3], abs=1e-5)
    c = first_order_entropy_effect(logp, entropy, moments)
    assert c.tolist() == pytest.approx([C_ARGMAX, C_RARE], abs=1e-5)
    assert logit_grad_norm(logp, moments).tolist() == pytest.approx([G_ARGMAX, G_RARE], abs=1e-5)
    # the argmax's surprisal 0.357 exceeds a batch entropy of 0.08, yet reinforcing it lowers entropy
    assert -logp[0].item() > 0.08 and c[0] > 0


@pytest.mark.parametrize("A", [1.0, -1.0])
@pytest.mark.parametrize("o", [0, 1, 2])
def test_effect_is_the_first_order_entropy_change_of_a_logit_step(A, o):
    z = torch.tensor([0.3, -1.2, 0.9, 0.0], dtype=torch.float64)
    logp, entropy, moments = logprobs_and_entropy_from_logits(z[None], torch.tensor([o]), with_moments=True)
    c = first_order_entropy_effect(logp, entropy, moments).item()

    def H(z):
        return -(z.softmax(-1) * z.log_softmax(-1)).sum().item()

    eta = 1e-6
    step = eta * A * (torch.nn.functional.one_hot(torch.tensor(o), 4).double() - z.softmax(-1))
    assert (H(z + step) - H(z)) / eta == pytest.approx(-A * c, rel=1e-4, abs=1e-8)


def test_with_moments_leaves_logp_entropy_and_gradients_bit_identical():
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    logp, entropy = chunked_logprobs_and_entropy(hidden, weight, targets, chunk_size=5)
    (gh, gw) = torch.autograd.grad(logp.sum(), (hidden, weight))
    logp2, entropy2, moments = chunked_logprobs_and_entropy(
        hidden, weight, targets, chunk_size=5, with_moments=True
    )
    (gh2, gw2) = torch.autograd.grad(logp2.sum(), (hidden, weight))
    assert torch.equal(logp, logp2) and torch.equal(entropy, entropy2)
    assert torch.equal(gh, gh2) and torch.equal(gw, gw2)
    p = torch.nn.functional.linear(hidden, weight).softmax(-1).detach()
    torch.testing.assert_close(moments[:, 0], (p * p).sum(-1))
    torch.testing.assert_close(moments[:, 1], (p * p * p.log()).sum(-1))
    assert moments.shape == (13, 2) and not moments.requires_grad


def _two_sequences():
    """Row 0: A = +1, row 1: A = -1; each samples the argmax then the rare token of p = (0.7, 0.2, 0.1)."""
    logits, targets = _inputs([0, 2, 0, 2])
    logp, entropy, moments = logprobs_and_entropy_from_logits(logits, targets, with_moments=True)
    A = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    return A, logp.view(2, 2), mask, entropy.view(2, 2), moments.view(2, 2, 2)


def test_metrics_of_an_o1_update_by_hand():
    A, logp, mask, entropy, moments = _two_sequences()
    # P = 0.5: L+ = the top 1 of T+ = {argmax, rare} by surprisal: the rare token of row 0
    weights, L_plus, L_minus, m = stare_weights(A, logp, mask, gate_on=True, P=0.5, W=1.1, Hbar=0.08)
    m |= mechanism_metrics(A, weights, L_plus, L_minus, mask, logp, entropy, moments)
    assert L_plus.tolist() == [[False, True], [False, False]]
    assert m["stare/L_plus_raising"] == 1.0 and m["stare/L_plus_s_above_H"] == 1.0
    assert math.isnan(m["stare/L_minus_lowering"])  # O1 selects no L-
    # mass |A| g: 0.37417, 1.15758 per row (sum 3.06350); weighted 3.06350 + 0.1 * 1.15758 = 3.17926
    assert m["stare/mass_weight"] == pytest.approx(3.17926 / 3.06350, abs=1e-5)  # 1.03779 > token mean 1.025
    assert m["stare/mean_weight"] == pytest.approx(4.1 / 4)
    assert m["stare/L_plus_mass_share"] == pytest.approx(1.15758 / (0.37417 + 1.15758), abs=1e-5)
    # dH = -w A c: row 0 -0.14079 + 1.1 * 0.32088, row 1 +0.14079 - 0.32088; sum 0.032088, mean over 4
    assert m["stare/dH_first_order"] == pytest.approx(0.1 * 0.32088 / 4, abs=1e-5)
    assert m["stare/dH_first_order_L_plus"] == pytest.approx(1.1 * 0.32088 / 4, abs=1e-5)


def test_the_batch_entropy_metric_and_the_first_order_one_disagree_on_the_argmax():
    A, logp, mask, entropy, moments = _two_sequences()
    # P = 1, C2: L+ = row 0 (argmax and rare), L- = row 1 (argmax and rare)
    weights, L_plus, L_minus, m = stare_weights(A, logp, mask, gate_on=True, variant="C2", P=1.0, Hbar=0.08)
    m |= mechanism_metrics(A, weights, L_plus, L_minus, mask, logp, entropy, moments)
    assert L_minus.tolist() == [[False, False], [True, True]]
    assert m["stare/L_plus_s_above_Hbar"] == 1.0  # both surprisals (0.357, 2.303) exceed 0.08 ...
    assert m["stare/L_plus_raising"] == 0.5  # ... but reinforcing the argmax lowers entropy
    assert m["stare/L_plus_s_above_H"] == 0.5  # 0.357 < H_t = 0.802
    assert m["stare/L_minus_lowering"] == 0.5  # punishing the rare token lowers entropy, the argmax not


def test_top_k_raising_keeps_only_the_entropy_raising_part_of_l_plus():
    A, logp, mask, entropy, moments = _two_sequences()
    raising = raising_tokens(logp, entropy, moments)
    assert raising.tolist() == [[False, True], [False, True]]  # the argmax (c = 0.141 > 0) lowers entropy
    weights, L_plus, L_minus, m = stare_weights(
        A, logp, mask, gate_on=True, P=1.0, W=2.0, L_plus_filter=raising
    )
    assert L_plus.tolist() == [[False, True], [False, False]]  # of the paper's L+ = row 0, the rare token
    assert weights.tolist() == [[1.0, 2.0], [1.0, 1.0]]
    assert m["stare/L_plus"] == 1.0 and m["stare/frac_reweighted"] == 0.25
    assert (
        mechanism_metrics(A, weights, L_plus, L_minus, mask, logp, entropy, moments)["stare/L_plus_raising"]
        == 1.0
    )


def test_first_order_response_by_hand():
    # p = (0.7, 0.2, 0.1), the sampled token the first: H = 0.8018186, sum p^2 = 0.54,
    # sum p^2 log p = -0.2621741, c = 0.7 (log 0.7 + H) - (-0.2621741 + 0.54 H) = 0.3116006 - 0.1708079
    # = 0.1407927; A = 2 on the one model token: dH = -2 c
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    H = -(p * p.log()).sum()
    moments = torch.stack([(p * p).sum(), (p * p * p.log()).sum()])
    logp = torch.tensor([[0.7, 0.5]], dtype=torch.float64).log()  # the second is mask 0
    entropy = torch.stack([H, torch.tensor(9.0, dtype=torch.float64)])[None]
    mom = torch.stack([moments, torch.tensor([9.0, 9.0], dtype=torch.float64)])[None]
    mask = torch.tensor([[1, 0]])
    A = torch.tensor([[2.0, 5.0]], dtype=torch.float64)
    assert first_order_response(A, None, mask, logp, entropy, mom) == pytest.approx(-2 * 0.1407927, abs=1e-6)
    w = torch.tensor([[0.0, 1.0]], dtype=torch.float64)  # the token out of the gradient: no response
    assert first_order_response(A, w, mask, logp, entropy, mom) == 0.0
