"""The first-order bank-entropy response of a token subset, checked by hand on a 3-token softmax."""

from __future__ import annotations

import math

import torch

from stare_agent.algorithms.entropy_effect import first_order_entropy_effect
from stare_agent.algorithms.entropy_response import (
    directional_derivative,
    response_subsets,
    subset_responses,
    token_influence,
)


def _entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_tabular_softmax_by_hand() -> None:
    # One position, logits z = log p with p = (0.7, 0.2, 0.1); the bank is that position, sampled o = 0.
    # H = 0.8018; grad_z H_j = -p_j (log p_j + H) = (-0.3116, 0.1616, 0.1501) (sums to 0);
    # d = <grad H, e_o - p> = -0.3116 - (0.7 * -0.3116 + 0.2 * 0.1616 + 0.1 * 0.1501) = -0.1408 = -c.
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    z = p.log().clone().requires_grad_(True)
    H = _entropy(z)
    (u,) = torch.autograd.grad(H, z)
    assert torch.allclose(u, torch.tensor([-0.31159, 0.16157, 0.15013], dtype=torch.float64), atol=1e-4)
    d = directional_derivative(lambda: torch.log_softmax(z, -1)[0], [z], [u], eps=1e-4)
    assert math.isclose(float(d), -0.1408, abs_tol=1e-4)
    Hd = H.detach()
    moments = torch.stack([(p * p).sum(), (p * p * p.log()).sum()])
    assert math.isclose(float(d), -float(first_order_entropy_effect(p[0].log(), Hd, moments)), rel_tol=1e-6)
    # A = +1 on the one token, N = 1: I = A d / N = -0.1408, so an SGD step of lr lowers H by 0.1408 lr
    # (reinforcing the argmax sharpens); check against a real step.
    infl = token_influence(torch.ones(1, 1), d.view(1, 1), torch.ones(1, 1))
    lr = 1e-3
    with torch.no_grad():
        z_new = z + lr * 1.0 * (torch.nn.functional.one_hot(torch.tensor(0), 3) - p)  # -lr grad(-A log p_o)
        measured = float(_entropy(z_new) - Hd)
    assert math.isclose(lr * float(infl.sum()), measured, rel_tol=1e-2)
    assert measured < 0


def test_subsets_and_random_expectation() -> None:
    # Two rows of 4 tokens; row 0 has A = +1, row 1 A = -1; last token of row 1 is padding.
    A = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-0.1, -2.0, -0.5, -3.0], [-1.0, -0.2, -4.0, 0.0]])
    d = torch.tensor([[0.4, -2.0, 1.0, 3.0], [1.0, 1.0, 1.0, 9.0]])
    infl = token_influence(A, d, mask)  # N = 7
    assert torch.allclose(infl[0], torch.tensor([0.4, -2.0, 1.0, 3.0], dtype=torch.float64) / 7)
    assert float(infl[1, 3]) == 0.0
    subsets = response_subsets(A, logp, mask, infl, P=0.5)  # k = 2 of |T+| = 4, 2 of |T-| = 3
    assert subsets["L+"][0].tolist() == [False, True, False, True]  # surprisal 2.0 and 3.0
    assert subsets["bottom"][0].tolist() == [True, False, True, False]  # surprisal 0.1 and 0.5
    assert subsets["oracle"][0].tolist() == [False, False, True, True]  # influence 1.0 and 3.0
    assert subsets["L-"][1].tolist() == [True, False, True, False]  # surprisal 1.0 and 4.0
    out = subset_responses(infl, subsets, P=0.5)
    assert math.isclose(out["L+"], 1.0 / 7, rel_tol=1e-6)
    assert math.isclose(out["oracle"], 4.0 / 7, rel_tol=1e-6)
    assert math.isclose(out["random"], 0.5 * 2.4 / 7, rel_tol=1e-6)  # k / |T+| * sum_{T+} I
    assert math.isclose(out["all"], (2.4 - 3.0) / 7, rel_tol=1e-6)
