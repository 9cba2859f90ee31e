"""Rollout correction: the engine that sampled a token is not the learner that trains on it.

An engine with kernels of its own (vLLM, SGLang, an OpenAI-compatible server; bf16, other
batching) gives a sampled token another probability mu(o_t) than the learner's forward pi_old(o_t)
at the same weights. A policy gradient on tokens drawn from mu, taken as if pi_old drew them, is
biased, and most where STARE acts: a token the engine sampled at mu = 0.02 that the learner gives
0.01 has surprisal 4.6, lands in L+ and gets weight W. Decoupled PPO (Hilton et al. 2022; AReaL)
keeps the PPO ratio on the proximal policy pi_old (the learner before the update) and corrects
for the behaviour policy mu with a detached importance weight on each model-generated token
(mask_t = 1):

    d_t       = log pi_old(o_t) - log mu(o_t)
    token_tis:  c_t = min(exp(d_t), C)                          truncated IS, C = 2 (Yao et al. 2025;
                                                                verl's TIS)
    seq_tis:    c_t = min(exp(sum_s d_s), C)                     the sequence's ratio, on each token
    token_mis:  c_t = exp(d_t) * 1[lo <= exp(d_t) <= hi]        masked IS: out-of-range tokens
    seq_mis:    c_t = exp(D) * 1[lo <= exp(D) <= hi], D = sum_s d_s      or whole sequences leave
    loss_t    = c_t * w_t * l_t                                 w_t: STARE's weight, l_t: the PPO term

A masked token keeps its place in the loss's denominator (its term is 0), so the estimate stays
one of the token-mean objective. STARE's surprisal, its gate and its top-k read pi_old, the
learner's own log-probs: they are statistics of the policy being trained, and the learner's
are the ones its update moves.

``mismatch_sums`` measures the gap (summed, so ranks and micro-batches add up; ``mismatch_metrics``
turns the sums into the logged means):

    mismatch/kl                 token mean of exp(d) - 1 - d: the k3 estimate of KL(mu || pi_old)
                                from mu's own samples (unbiased, never negative)
    mismatch/abs_logp_mean      token mean of |d|;  mismatch/abs_logp_max: its max
    mismatch/L_plus_abs_logp_mean    the mean of |d| over L+ alone
    mismatch/seq_log_ratio_mean, _std   over sequences of D = sum_t d_t
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stare_agent.options import check_rollout_correction

LOG_RATIO_CLAMP = 20.0


def correction_weights(
    logp: Tensor,
    logp_sampler: Tensor,
    response_mask: Tensor,
    *,
    mode: str,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Detached importance weights c_t [B, T] (formulas above; 0 on mask-0 entries) and their counts.

    Args:
        logp: [B, T] the learner's log-probs of the sampled tokens (pi_old; detached here).
        logp_sampler: [B, T] the engine's log-probs of the same tokens (mu).
        response_mask: [B, T], 1 = model-generated token.
        mode: one of ``stare_agent.options.ROLLOUT_CORRECTION_MODES`` (``none``: all ones on mask-1 tokens).

    Returns:
        (c, metrics): ``rollout_correction/weight_mean`` (over mask-1 tokens), and
        ``rollout_correction/capped_frac`` (TIS: tokens whose weight the cap cut) or
        ``rollout_correction/masked_frac`` (MIS: tokens taken out).
    """
    check_rollout_correction(mode=mode, cap=cap, low=low, high=high)
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    d = torch.where(mask, logp.detach().float() - logp_sampler.float(), zero)
    if mode.startswith("seq"):
        d = torch.where(mask, d.sum(dim=-1, keepdim=True).expand_as(d), zero)
    ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    n = max(int(mask.sum()), 1)
    metrics: dict[str, float] = {}
    if mode == "none":
        c = torch.ones_like(ratio)
    elif mode.endswith("tis"):
        c = ratio.clamp(max=cap)
        metrics["rollout_correction/capped_frac"] = float(((ratio > cap) & mask).sum()) / n
    else:
        kept = (ratio >= low) & (ratio <= high)
        c = torch.where(kept, ratio, zero)
        metrics["rollout_correction/masked_frac"] = float((~kept & mask).sum()) / n
    c = torch.where(mask, c, zero).to(logp.dtype)
    metrics["rollout_correction/weight_mean"] = float(c.float().sum()) / n
    return c, metrics


def mismatch_sums(
    logp: Tensor, logp_sampler: Tensor, response_mask: Tensor, l_plus: Tensor | None = None
) -> dict[str, float]:
    """Sums over mask-1 tokens of the gap between learner and sampler log-probs (see the module
    docstring), to add over micro-batches and ranks (``abs_max`` by max) and pass to
    :func:`mismatch_metrics`. ``l_plus``: [B, T] bool, STARE's L+ tokens, or None."""
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    d = torch.where(mask, logp.detach().double() - logp_sampler.double(), zero)
    r = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq = d.sum(dim=-1)[mask.any(dim=-1)]
    sums = {
        "tokens": float(mask.sum()),
        "abs_sum": float(d.abs().sum()),
        "abs_max": float(d.abs().max()) if mask.any() else 0.0,
        "k3_sum": float(torch.where(mask, torch.exp(r) - 1.0 - r, zero).sum()),
        "seqs": float(seq.numel()),
        "seq_sum": float(seq.sum()),
        "seq_sq_sum": float((seq * seq).sum()),
        "l_plus_tokens": 0.0,
        "l_plus_abs_sum": 0.0,
    }
    if l_plus is not None:
        chosen = l_plus.bool() & mask
        sums["l_plus_tokens"] = float(chosen.sum())
        sums["l_plus_abs_sum"] = float(torch.where(chosen, d.abs(), zero).sum())
    return sums


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged means of :func:`mismatch_sums`' (added-up) sums; NaN where nothing was counted,
    and no ``mismatch/L_plus_abs_logp_mean`` where there was no L+ (GRPO-ds, a gate that is off)."""
    tokens, seqs, chosen = sums["tokens"], sums["seqs"], sums["l_plus_tokens"]
    seq_mean = sums["seq_sum"] / seqs if seqs else math.nan
    seq_var = sums["seq_sq_sum"] / seqs - seq_mean**2 if seqs else math.nan
    metrics = {
        "mismatch/kl": sums["k3_sum"] / tokens if tokens else math.nan,
        "mismatch/abs_logp_mean": sums["abs_sum"] / tokens if tokens else math.nan,
        "mismatch/abs_logp_max": sums["abs_max"] if tokens else math.nan,
        "mismatch/seq_log_ratio_mean": seq_mean,
        "mismatch/seq_log_ratio_std": math.sqrt(max(seq_var, 0.0)) if seqs else math.nan,
    }
    if chosen:
        metrics["mismatch/L_plus_abs_logp_mean"] = sums["l_plus_abs_sum"] / chosen
    return metrics
