"""Dual-clip PPO policy loss times the STARE token weights (GRPO-ds when the weights are 1).

STARE (arXiv 2606.19236, docs/algorithm.md step 8), per model-generated token t (mask_t = 1):

    rho_t = exp(clamp(logp_t - logp_old_t, -20, 20))
    l1    = -A_t * rho_t
    l2    = -A_t * clip(rho_t, 1 - eps_low, 1 + eps_high)          eps_low = 0.2, eps_high = 0.28
    lc    = max(l1, l2)
    l_t   = min(-A_t * c, lc)  if A_t < 0  else  lc                 dual clip, c = 10
    loss  = sum_t mask_t * w_t * l_t / sum_t mask_t                 "token-mean" (the paper's choice)

w_t are the STARE weights (W on L+, M on L-, 1 elsewhere; see stare.py), or the 0/1 weights of
Clip-Cov and the forking-token update (entropy_control.py); ``weights=None`` is GRPO-ds, and
all-one weights give the same loss bit for bit. KL-Cov adds ``kl_coef_t * |logp_t - logp_old_t|``
and the entropy bonus ``-beta * H_t`` to l_t (both after w_t; entropy_control.py). Other aggregations (verl's names):

    seq-mean-token-sum       mean_i  sum_t mask * w * l                     over rows with a mask-1 token
    seq-mean-token-mean      mean_i (sum_t mask * w * l / sum_t mask)       over rows with a mask-1 token
    seq-mean-token-sum-norm  sum_i sum_t mask * w * l / norm_length        Dr. GRPO; norm_length constant
"""

from __future__ import annotations

import torch
from torch import Tensor

from stare_agent.options import Aggregation, check_loss_options

LOG_RATIO_CLAMP = 20.0


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    weights: Tensor | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clip_c: float = 10.0,
    agg: Aggregation = "token-mean",
    token_count: float | None = None,
    norm_length: int | None = None,
    kl_coef: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Dual-clip PPO surrogate times ``w_t``, aggregated over mask-1 tokens (formulas above).

    Args:
        logp: [B, T] log pi_theta(o_t), with gradient.
        logp_old: [B, T] log-probs of the sampling policy (on-policy: ``logp.detach()``).
        advantages: [B, T] token advantages A_t.
        response_mask: [B, T], 1 = model-generated token; mask-0 entries are never read.
        weights: [B, T] STARE weights w_t, or None for GRPO-ds.
        eps_low, eps_high: asymmetric clip range of rho (clip-higher).
        clip_c: dual-clip bound c > 1 for A < 0.
        agg: aggregation mode (see the module docstring).
        token_count: token-mean denominator to use instead of this call's ``sum(mask)``, e.g. the
            mask-1 count of the whole batch when it is split into micro-batches.
        norm_length: the constant divisor of "seq-mean-token-sum-norm" (the generation budget);
            required for that mode so that padding width never changes the loss.
        kl_coef: [B, T] KL-Cov's per-token coefficients (``entropy_control.kl_cov_coefficients``):
            ``l_t += kl_coef_t * |logp_t - logp_old_t|`` after the weights; None adds nothing.
        entropy, entropy_coef: [B, T] full-vocabulary entropy H_t WITH its gradient, and the entropy
            bonus coefficient: ``l_t -= entropy_coef * H_t`` (:func:`entropy_bonus`); the
            aggregation then subtracts ``entropy_coef`` times the token-mean entropy. None adds nothing.

    Returns:
        (scalar loss, metrics).
    """
    check_loss_options(agg=agg, eps_low=eps_low, eps_high=eps_high, clip_c=clip_c)
    if not logp.shape == logp_old.shape == advantages.shape == response_mask.shape:
        raise ValueError(
            "logp, logp_old, advantages and response_mask must share one [B, T] shape: pad them alike"
        )
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    A = torch.where(mask, advantages, zero)  # mask-0 entries are never read
    log_ratio = torch.where(mask, logp - logp_old, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    rho = torch.exp(log_ratio)
    l1 = -A * rho
    l2 = -A * torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high)
    lc = torch.maximum(l1, l2)
    l_t = torch.where(A < 0, torch.minimum(-A * clip_c, lc), lc)
    if weights is not None:
        l_t = weights * l_t
    if kl_coef is not None:  # KL-Cov (Cui et al. 2025): |log ratio| on the selected tokens
        l_t = l_t + kl_coef * torch.where(mask, logp - logp_old, zero).abs()
    if entropy is not None:  # entropy bonus: -beta * H_t, with H_t's gradient
        l_t = l_t + entropy_bonus(entropy, mask, entropy_coef)
    l_t = torch.where(mask, l_t, zero)

    loss = _aggregate(l_t, mask, agg, token_count, norm_length)
    metrics = _loss_metrics(log_ratio, rho, A, l1, l2, lc, mask, eps_low, eps_high, clip_c, loss)
    return loss, metrics


def _aggregate(
    l_t: Tensor, mask: Tensor, agg: str, token_count: float | None, norm_length: int | None
) -> Tensor:
    """Reduce masked per-token losses [B, T] (already 0 on mask-0) to a scalar."""
    if agg == "token-mean":
        denominator = mask.sum() if token_count is None else token_count
        return l_t.sum() / max(float(denominator), 1.0)
    tokens_per_seq = mask.sum(dim=-1)
    has_tokens = tokens_per_seq > 0
    n_seqs = max(int(has_tokens.sum()), 1)
    if agg == "seq-mean-token-sum":
        return l_t.sum(dim=-1).sum() / n_seqs
    if agg == "seq-mean-token-mean":
        return (l_t.sum(dim=-1) / tokens_per_seq.clamp(min=1)).sum() / n_seqs
    if norm_length is None or norm_length < 1:
        raise ValueError(
            "agg='seq-mean-token-sum-norm' divides by a constant: pass norm_length=<max response tokens>"
        )
    return l_t.sum() / norm_length


def _loss_metrics(
    log_ratio: Tensor,
    rho: Tensor,
    A: Tensor,
    l1: Tensor,
    l2: Tensor,
    lc: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    clip_c: float,
    loss: Tensor,
) -> dict[str, float]:
    """Clip fractions and the approximate KL over mask-1 tokens (detached)."""
    with torch.no_grad():
        n = max(int(mask.sum()), 1)
        clipped = (l2 > l1) & mask
        dual_clipped = (A < 0) & (-A * clip_c < lc) & mask
        return {
            "actor/pg_loss": float(loss.detach()),
            "actor/pg_clipfrac": float(clipped.sum()) / n,
            "actor/pg_clipfrac_lower": float(dual_clipped.sum()) / n,
            "actor/ppo_kl": float((-log_ratio)[mask].sum()) / n,
            "actor/ratio_mean": float(rho[mask].sum()) / n,
            "actor/eps_low": eps_low,
            "actor/eps_high": eps_high,
        }


def entropy_bonus(entropy: Tensor, response_mask: Tensor, coef: float) -> Tensor:
    """Per-token bonus term ``-coef * H_t`` on mask-1 tokens (0 elsewhere), to add to ``l_t``.

    ``entropy`` must carry the gradient of the full-vocabulary entropy; summed and divided by the
    token-mean denominator it is ``-coef * (token-mean entropy of model tokens)``.
    """
    mask = response_mask.bool()
    return torch.where(mask, -coef * entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
