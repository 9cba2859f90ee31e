"""The first-order bank-entropy response of a token subset, checked by hand on a 3-token softmax."""

from __future__ import annotations

import math

import torch

from stare_agent.algorithms.entropy_control import (
    clip_cov_weights,
    forking_token_weights,
    kl_cov_coefficients,
)
from stare_agent.algorithms.losses import policy_loss
from stare_research.entropy_effect import first_order_entropy_effect
from stare_research.entropy_response import (
    directional_derivative,
    loss_response,
    response_subsets,
    sign_agreement,
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
    assert "L+ raising" not in subsets and "random (raising size)" not in out


def test_the_raising_rules_L_plus_and_its_sign_agreement_by_hand() -> None:
    """The rule ``top_k_raising`` keeps the L+ tokens its own-position first order calls raisers; the
    matched random subset and the sign agreement with the bank's influence, worked by hand."""
    A = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-0.1, -2.0, -0.5, -3.0], [-1.0, -0.2, -4.0, 0.0]])
    infl = token_influence(A, torch.tensor([[0.4, -2.0, 1.0, 3.0], [1.0, 1.0, 1.0, 9.0]]), mask)
    raising = torch.tensor([[True, True, False, False], [True, False, False, False]])
    subsets = response_subsets(A, logp, mask, infl, P=0.5, raising=raising)
    # L+ is tokens 1 and 3 (surprisal 2.0, 3.0); the rule keeps token 1 only
    assert subsets["L+ raising"].tolist() == [[False, True, False, False], [False] * 4]
    out = subset_responses(infl, subsets, P=0.5)
    assert math.isclose(out["L+ raising"], -2.0 / 7, rel_tol=1e-6)  # the one kept token LOWERS the bank
    assert math.isclose(out["random (raising size)"], 1 / 4 * 2.4 / 7, rel_tol=1e-6)
    # T+ = row 0: raising (T, T, F, F) against influence > 0 (T, F, T, T): they agree on token 0 only
    assert sign_agreement(raising, infl, subsets["T+"]) == 0.25
    assert sign_agreement(raising, infl, subsets["L+"]) == 0.0  # token 1 (T vs F), token 3 (F vs T)
    assert math.isnan(sign_agreement(raising, infl, torch.zeros_like(mask)))


def test_entropy_bonus_response_by_hand() -> None:
    # The bonus loss l = -beta * H on the one position of the first test, bank = that position:
    # e = dH/de along u = grad H is |u|^2 = 0.3116^2 + 0.1615^2 + 0.1501^2 = 0.1457, and dl/dH = -beta,
    # so one SGD step of lr changes H by lr * beta * 0.1457 (checked against a real step).
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    z = p.log().clone().requires_grad_(True)
    (u,) = torch.autograd.grad(_entropy(z), z)
    e = directional_derivative(lambda: _entropy(z), [z], [u], eps=1e-4)
    assert math.isclose(float(e), 0.1457, abs_tol=1e-4)
    beta, lr = 0.5, 1e-3
    resp = loss_response(
        lambda lp, H: -beta * H.sum(),
        p[:1].log().view(1, 1),
        _entropy(z).view(1, 1),
        torch.zeros(1, 1),
        e.view(1, 1),
    )
    assert resp.logp_part == 0.0 and math.isclose(resp.entropy_part, beta * 0.1457, abs_tol=1e-4)
    with torch.no_grad():
        measured = float(_entropy(z + lr * beta * u) - _entropy(z))  # -lr grad(-beta H) = +lr beta u
    assert math.isclose(lr * resp.total, measured, rel_tol=1e-2)


def test_method_responses_on_three_tokens() -> None:
    # Three one-token rows: A = (1, 1, -2), logp = (-0.1, -3.1, -0.4), H = (0.3, 2.0, 0.9),
    # d = (0.5, 2.0, -1.0), e = (0.2, -0.4, 0.9); N = 3. GRPO-ds: sum A d / N = (0.5 + 2 + 2) / 3 = 1.5.
    A = torch.tensor([[1.0], [1.0], [-2.0]])
    logp = torch.tensor([[-0.1], [-3.1], [-0.4]])
    H = torch.tensor([[0.3], [2.0], [0.9]])
    d = torch.tensor([[0.5], [2.0], [-1.0]])
    e = torch.tensor([[0.2], [-0.4], [0.9]])
    mask = torch.ones(3, 1, dtype=torch.bool)

    def respond(weights=None, kl_coef=None, beta=0.0):
        def loss(lp, h):
            return policy_loss(
                lp, lp.detach(), A.double(), mask, weights, kl_coef=kl_coef, entropy=h, entropy_coef=beta
            )[0]

        return loss_response(loss, logp, H, d, e)

    grpo = respond()
    assert math.isclose(grpo.total, 1.5, rel_tol=1e-9) and grpo.entropy_part == 0.0
    assert math.isclose(grpo.total, float(token_influence(A, d, mask).sum()), rel_tol=1e-9)
    # forking tokens, rho = 0.2: ceil(0.6) = 1 token, the highest entropy (row 1): 2.0 / 3
    w_fork, _ = forking_token_weights(H, mask, rho=0.2)
    assert math.isclose(respond(w_fork).total, 2.0 / 3, rel_tol=1e-9)
    # cov_t = (logp_t + 1.2) * (A_t - 0) = (1.1, -1.9, -1.6): Clip-Cov's only candidate in (1, 5) is
    # row 0, max(1, floor(2e-4 * 3)) = 1 of them is detached: (2 + 2) / 3
    w_clip, _ = clip_cov_weights(A, logp, mask, generator=torch.Generator().manual_seed(0))
    assert math.isclose(respond(w_clip).total, 4.0 / 3, rel_tol=1e-9)
    # KL-Cov penalises row 0 (the top 1 by cov), but |logp - logp_old| has gradient 0 at the first step:
    # its coefficients are GRPO-ds's exactly, so its response is 1.5
    kl, _ = kl_cov_coefficients(A, logp, mask)
    assert kl[0, 0] == 1.0 and float(kl.sum()) == 1.0
    kl_resp = respond(kl_coef=kl.double())
    assert torch.equal(kl_resp.dl_dlogp, grpo.dl_dlogp) and kl_resp.total == grpo.total
    # entropy bonus, beta = 0.1: dl/dH_t = -0.1 / 3, so + 0.1 * mean(e) = 0.1 * 0.7 / 3 on top of GRPO-ds
    bonus = respond(beta=0.1)
    assert math.isclose(bonus.logp_part, 1.5, rel_tol=1e-9)
    assert math.isclose(bonus.entropy_part, 0.1 * 0.7 / 3, rel_tol=1e-6)  # e is float32
