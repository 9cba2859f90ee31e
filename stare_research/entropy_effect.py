"""What an update does to entropy, token by token, to first order (this project's diagnostics).

At one position with next-token distribution p, entropy ``H = -sum_j p_j log p_j`` and sampled
token o, a policy-gradient step on the logits z, ``dz = eta * w * A * (e_o - p)`` (the gradient of
``w * A * log p_o``), changes the entropy by, to first order (``dH/dz_j = -p_j (log p_j + H)``):

    dH  = -eta * w * A * c,      c = p_o (log p_o + H) - sum_j p_j^2 (log p_j + H)

and moves the logits by ``eta * w * |A| * g`` with ``g = |e_o - p| = sqrt(1 - 2 p_o + sum_j p_j^2)``.
For A > 0 the step raises entropy iff c < 0 (``s = -log p_o > H`` is sufficient; the argmax token
always has c >= 0); for A < 0 it lowers entropy iff c < 0. Example, p = (0.7, 0.2, 0.1), o the argmax:
H = 0.802, c = 0.7 * 0.445 - (0.49 * 0.445 - 0.04 * 0.808 - 0.01 * 1.501) = 0.141 > 0, so
reinforcing it lowers entropy even though its surprisal 0.357 exceeds a batch entropy of 0.08.

The per-position moments ``(sum_j p_j^2, sum_j p_j^2 log p_j)`` come from the chunked log-prob pass
(``with_moments=True`` in ``stare_agent.algorithms.logprobs``): two extra reductions, no second forward.

The metrics of :func:`mechanism_metrics` read the update as a whole (N = number of mask-1 tokens):

    L_plus_raising    = |{t in L+ : c_t < 0}| / |L+|          L_minus_lowering = |{t in L- : c_t < 0}| / |L-|
    L_plus_s_above_H  = |{t in L+ : s_t > H_t}| / |L+|        (the sufficient condition, own position)
    mass_weight       = sum_t w_t |A_t| g_t / sum_t |A_t| g_t  (the update's gradient-mass-weighted mean weight)
    L_plus_mass_share = sum_{L+} |A_t| g_t / sum_{T+} |A_t| g_t (share of the T+ half's mass in L+)
    dH_first_order    = -(1/N) sum_t w_t A_t c_t              (per unit logit step eta; whole update)
    dH_first_order_L_plus = -(1/N) sum_{t in L+} w_t A_t c_t   (its L+ part)

``dH_first_order`` is the mean over tokens of each position's own first-order change when every
position's logits take the step above with eta = 1 (as in a tabular softmax policy); in a network the
positions share parameters, so it is a per-position reading, not a prediction of the next batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from stare_agent.algorithms.token_weighting import first_order_entropy_effect

__all__ = [
    "first_order_entropy_effect",
    "first_order_response",
    "logit_grad_norm",
    "mechanism_metrics",
    "raising_tokens",
]


def logit_grad_norm(logp: Tensor, moments: Tensor) -> Tensor:
    """``g_t = |e_o - p| = sqrt(1 - 2 p_o + sum_j p_j^2)``, the size of the logit gradient of log p_o (float64)."""
    p_o = logp.detach().double().exp()
    return (1.0 - 2.0 * p_o + moments.detach().double()[..., 0]).clamp_min(0.0).sqrt()


def mechanism_metrics(
    advantages: Tensor,
    weights: Tensor,
    L_plus: Tensor,
    L_minus: Tensor,
    response_mask: Tensor,
    logp: Tensor,
    entropy: Tensor,
    moments: Tensor,
    *,
    process_group: Any = None,
) -> dict[str, float]:
    """The metrics of the module docstring over the whole batch (summed over ``process_group``'s ranks).

    Args:
        advantages: [B, T] A_t; weights: [B, T] w_t of this update (1 when the gate is off).
        L_plus, L_minus: [B, T] bool selections of ``stare_weights``.
        response_mask: [B, T], 1 = model-generated token; nothing else is read.
        logp, entropy: [B, T]; moments: [B, T, 2] from the log-prob pass.
        process_group: the group to all_reduce over when torch.distributed is initialized (None: the world).

    Returns:
        ``stare/L_plus_raising``, ``stare/L_minus_lowering``, ``stare/L_plus_s_above_H``,
        ``stare/mass_weight``, ``stare/L_plus_mass_share``, ``stare/dH_first_order``,
        ``stare/dH_first_order_L_plus`` (NaN for a ratio over an empty set).
    """
    mask = response_mask.bool()
    c = first_order_entropy_effect(logp, entropy, moments)
    g = logit_grad_norm(logp, moments)
    A, w = advantages.detach().double(), weights.detach().double()
    L_plus, L_minus = L_plus & mask, L_minus & mask
    mass = torch.where(mask, A.abs() * g, 0.0)
    dH = torch.where(mask, -w * A * c, 0.0)
    s_above_H = -logp.detach().double() > entropy.detach().double()
    sums = torch.stack(
        [
            mask.sum().double(),
            L_plus.sum().double(),
            (L_plus & (c < 0)).sum().double(),
            (L_plus & s_above_H).sum().double(),
            L_minus.sum().double(),
            (L_minus & (c < 0)).sum().double(),
            mass.sum(),
            (w * mass).sum(),
            mass[L_plus].sum(),
            mass[mask & (A > 0)].sum(),
            dH.sum(),
            dH[L_plus].sum(),
        ]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, group=process_group)
    n, k_plus, k_raising, k_above, k_minus, k_lowering, m, wm, m_plus, m_T_plus, dH_all, dH_plus = (
        sums.tolist()
    )

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        "stare/L_plus_raising": ratio(k_raising, k_plus),
        "stare/L_minus_lowering": ratio(k_lowering, k_minus),
        "stare/L_plus_s_above_H": ratio(k_above, k_plus),
        "stare/mass_weight": ratio(wm, m),
        "stare/L_plus_mass_share": ratio(m_plus, m_T_plus),
        "stare/dH_first_order": ratio(dH_all, n),
        "stare/dH_first_order_L_plus": ratio(dH_plus, n),
    }


def first_order_response(
    advantages: Tensor,
    weights: Tensor | None,
    response_mask: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    moments: Tensor,
    *,
    process_group: Any = None,
) -> float:
    """The update's one-step entropy response to first order, per unit logit step, as STARE's
    ``stare/dH_first_order``: ``-(1/N) sum_t mask_t w_t A_t c_t`` over the whole batch on all ranks
    (``c_t`` of :func:`first_order_entropy_effect`; ``weights`` None is all 1). It covers the
    policy-gradient term only (KL-Cov's penalty is 0 at an on-policy step; the entropy bonus's own
    push is not in it)."""
    mask = response_mask.bool()
    c = first_order_entropy_effect(logprobs, entropy, moments)
    w = weights.detach().double() if weights is not None else torch.ones_like(c)
    zero = torch.zeros((), dtype=torch.float64, device=c.device)
    term = torch.where(mask, w * advantages.detach().double() * c, zero)
    stats = torch.stack([-term.sum(), mask.sum().double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, group=process_group)
    return float(stats[0] / stats[1]) if float(stats[1]) else 0.0


def raising_tokens(logp: Tensor, entropy: Tensor, moments: Tensor) -> Tensor:
    """[B, T] bool: the tokens whose reinforcement raises their position's entropy at first order
    (c_t < 0). This project's L+ rule ``top_k_raising`` passes it to ``stare_weights`` as
    ``L_plus_filter``: of the paper's L+, only these get W."""
    return first_order_entropy_effect(logp, entropy, moments) < 0
