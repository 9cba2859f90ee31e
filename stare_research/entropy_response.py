"""The one-step entropy response of a token subset of an update, exact to first order in a network.

``entropy_effect`` reads each position's OWN entropy change under a tabular logit step. In a network
the positions share parameters, so a step on one batch moves the entropy of every other sequence.
This module measures that: the change, to first order, of the mean entropy ``H_bank`` of a fixed
held-out bank of teacher-forced tokens, caused by the policy-gradient step of any token subset S.

With the on-policy (rho = 1) token-mean GRPO-ds loss ``l = -(1/N) sum_t w_t A_t log p_t`` (N = mask-1
tokens of the batch), a preconditioned step ``dtheta = -lr * D grad l_S`` (D diagonal, e.g. D = I
for SGD) changes the bank's entropy by

    dH_S = <grad H_bank, dtheta> = lr * sum_{t in S} I_t,     I_t = w_t A_t d_t / N,
    d_t  = <D grad H_bank, grad log p_t> = d/de log p_t(theta + e u) at e = 0,   u = D grad H_bank

so one direction u (one backward through the bank) and the directional derivative of every batch
token's log-prob along it (here: a central difference, two forwards of the batch) give every
subset's first-order response at once. Sign: dH_S > 0 means the subset's step raises the bank's
entropy. For a single softmax position with the bank = that position (tabular logits, D = I),
``d_t = -c_t`` of ``entropy_effect.first_order_entropy_effect`` and ``dH = -lr A c / N``.

Subsets (all over mask-1 tokens; k = ceil(P |T+|) as in STARE): ``L+``/``L-`` of ``stare_weights``,
``bottom`` (the k least surprising tokens of T+), ``oracle`` (the k tokens of T+ with the largest
I_t: the exact first-order raisers), and ``random`` (the EXPECTATION over uniformly random k-subsets
of T+: ``(k / |T+|) * sum_{T+} I_t``, no sampling noise).

Whole METHODS (issue 31: GRPO-ds, STARE, the entropy bonus, KL-Cov, Clip-Cov, forking tokens) are
losses ``l(logp, H)`` of the batch's log-probs and full-vocabulary entropies, so one SGD step of lr
changes the bank's entropy, to first order, by

    dH_l = -lr * sum_t (dl/dlogp_t * d_t + dl/dH_t * e_t),   e_t = d/de H_t(theta + e u) at e = 0

(:func:`loss_response`; the coefficients ``dl/dlogp_t`` are autograd's, of the method's own loss).
For GRPO-ds on-policy, ``dl/dlogp_t = -A_t / N``, so its logp part is ``sum_t I_t``; a method that
reweights tokens by ``w_t`` gives ``sum_t w_t I_t``; KL-Cov's penalty ``|logp - logp_old|`` has
gradient 0 at ``logp = logp_old`` (the first step on a batch), so its coefficients are GRPO-ds's
exactly; the entropy bonus (``l -= beta * mean_t H_t``) adds ``dl/dH_t = -beta / N``, i.e.
``lr * beta * (directional derivative of the samples' token-mean entropy along u)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from stare_agent.algorithms.selection import top_k, top_k_count
from stare_agent.algorithms.stare import stare_weights


@torch.no_grad()
def directional_derivative(
    fn: Callable[[], Tensor], params: Sequence[Tensor], direction: Sequence[Tensor], eps: float
) -> Tensor:
    """``(fn(theta + eps u) - fn(theta - eps u)) / (2 eps)`` in float64, restoring ``params`` after.

    ``fn`` reads the parameters in place (e.g. a model forward); the error is O(eps^2) plus float
    rounding over 2 eps, so pick eps so that ``eps * |u|`` is about the size of a real step.
    """
    for p, u in zip(params, direction, strict=True):
        p.add_(u, alpha=eps)
    try:
        plus = fn().double()
        for p, u in zip(params, direction, strict=True):
            p.add_(u, alpha=-2 * eps)
        minus = fn().double()
    finally:
        for p, u in zip(params, direction, strict=True):
            p.add_(u, alpha=eps)
    return (plus - minus) / (2 * eps)


def token_influence(
    advantages: Tensor, d: Tensor, response_mask: Tensor, token_count: float | None = None
) -> Tensor:
    """``I_t = A_t d_t / N`` on mask-1 tokens (0 elsewhere), float64: ``dH_S = lr * sum_{t in S} I_t``.

    Args:
        advantages: [B, T] A_t; d: [B, T] directional derivative of log p_t along u.
        response_mask: [B, T]; token_count: N (default: the mask-1 count).
    """
    mask = response_mask.bool()
    n = float(mask.sum()) if token_count is None else float(token_count)
    value = advantages.detach().double() * d.detach().double() / max(n, 1.0)
    return torch.where(mask, value, torch.zeros((), dtype=torch.float64, device=value.device))


def response_subsets(
    advantages: Tensor,
    logprobs: Tensor,
    response_mask: Tensor,
    influence: Tensor,
    P: float,
    raising: Tensor | None = None,
) -> dict[str, Tensor]:
    """Bool masks [B, T] of ``L+``, ``L-`` (STARE's selection, ``stare_weights`` C2 over the whole
    batch), ``bottom`` (the k least surprising of T+) and ``oracle`` (the k of T+ with the largest
    influence), k = ceil(P |T+|); also ``T+``, ``T-`` and ``all`` (every mask-1 token). Given
    ``raising`` (``entropy_effect.raising_tokens``: own-position, logit-space first order), also
    ``L+ raising``: the L+ of this project's rule ``research.L_plus_rule=top_k_raising``."""
    mask = response_mask.bool()
    A = advantages.detach()
    _, L_plus, L_minus, _ = stare_weights(A, logprobs.detach(), mask, gate_on=False, variant="C2", P=P)
    T_plus = mask & (A > 0)
    keys = torch.arange(mask.shape[0], device=mask.device)
    bottom = top_k(logprobs.detach().double(), T_plus, keys, P, None)  # largest log p = smallest s
    oracle = top_k(influence.detach().double(), T_plus, keys, P, None)
    subsets = {
        "all": mask,
        "T+": T_plus,
        "T-": mask & (A < 0),
        "L+": L_plus,
        "L-": L_minus,
        "bottom": bottom,
        "oracle": oracle,
    }
    if raising is not None:
        subsets["L+ raising"] = L_plus & raising.bool()
    return subsets


def subset_responses(influence: Tensor, subsets: dict[str, Tensor], P: float) -> dict[str, float]:
    """``sum_{t in S} I_t`` of each subset, plus ``random``: its expectation over random k-subsets of T+."""
    out = {name: float(influence[m].sum()) for name, m in subsets.items()}
    n_plus = int(subsets["T+"].sum())
    k = top_k_count(P, n_plus) if n_plus else 0
    out["random"] = k / n_plus * out["T+"] if n_plus else 0.0
    if "L+ raising" in subsets:  # the random T+ subset of the rule's (smaller) size, in expectation
        k_raising = int(subsets["L+ raising"].sum())
        out["random (raising size)"] = k_raising / n_plus * out["T+"] if n_plus else 0.0
    return out


def sign_agreement(raising: Tensor, influence: Tensor, within: Tensor) -> float:
    """The share of the tokens in ``within`` whose own-position, logit-space first order (``raising``:
    reinforcing them raises their own position's entropy) has the sign of their parameter-space
    effect on the held-out bank (``influence > 0``); NaN for an empty ``within``."""
    within = within.bool()
    n = int(within.sum())
    if not n:
        return math.nan
    return float((raising.bool() == (influence > 0))[within].sum()) / n


class LossResponse(NamedTuple):
    """First-order H_bank change per unit lr of one SGD step on a loss, split by the path it takes."""

    logp_part: float  # -sum_t dl/dlogp_t d_t
    entropy_part: float  # -sum_t dl/dH_t e_t (0 when the loss does not read H)
    dl_dlogp: Tensor  # [B, T] float64, the loss's per-token coefficients

    @property
    def total(self) -> float:
        return self.logp_part + self.entropy_part


def loss_response(
    loss_fn: Callable[[Tensor, Tensor], Tensor], logprobs: Tensor, entropy: Tensor, d: Tensor, e: Tensor
) -> LossResponse:
    """``-sum_t (dl/dlogp_t d_t + dl/dH_t e_t)`` for ``l = loss_fn(logp, H)`` (module docstring).

    Args:
        loss_fn: the method's loss of the batch's [B, T] log-probs and entropies (float64 leaves at the
            current values, so e.g. ``policy_loss(logp, logp.detach(), ...)`` is on-policy).
        logprobs, entropy: [B, T] current values (detached here).
        d, e: [B, T] directional derivatives of logp_t and H_t along u (0 off the mask).
    """
    lp = logprobs.detach().double().requires_grad_(True)
    H = entropy.detach().double().requires_grad_(True)
    with torch.enable_grad():
        g_lp, g_H = torch.autograd.grad(loss_fn(lp, H), (lp, H), allow_unused=True)
    g_lp = torch.zeros_like(lp) if g_lp is None else g_lp
    logp_part = -float((g_lp * d.detach().double()).sum())
    entropy_part = 0.0 if g_H is None else -float((g_H * e.detach().double()).sum())
    return LossResponse(logp_part, entropy_part, g_lp.detach())
