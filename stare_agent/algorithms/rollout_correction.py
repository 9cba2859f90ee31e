"""Rollout correction: the engine that sampled a token is not the learner that trains on it.

An engine with kernels of its own (vLLM, SGLang, an OpenAI-compatible server; bf16, other
batching) gives a sampled token another probability mu(o_t) than the learner's forward pi_old(o_t)
at the same weights. A policy gradient on tokens drawn from mu, taken as if pi_old drew them, is
biased, and most where STARE acts: a token the engine sampled at mu = 0.02 that the learner gives
0.01 has surprisal 4.6, lands in L+ and gets weight W. Decoupled PPO (Hilton et al. 2022; AReaL)
keeps the PPO ratio on the proximal policy pi_old (the learner before the update) and corrects
for the behaviour policy mu with a detached importance weight on each model-generated token
(mask_t = 1):

    d_t       = log pi_old(o_t) - log mu(o_t)        D = sum_s d_s,  G = D / n  (n: the sequence's tokens)
    token_tis:  c_t = min(exp(d_t), C)                          truncated IS, C = 2 (Yao et al. 2025;
                                                                verl's TIS)
    seq_tis:    c_t = min(exp(D), C)                            the sequence's ratio, on each token
    token_mis:  c_t = exp(d_t) * 1[lo <= exp(d_t) <= hi]        masked IS: out-of-range tokens
    seq_mis:    c_t = exp(D) * 1[lo <= exp(D) <= hi]            or whole sequences leave (verl's
                                                                seq_is_rs when C >= hi; TRL's
                                                                sequence_mask, its default)
    token_mask: c_t = exp(d_t) * 1[exp(d_t) <= C]               AReaL's token_mask: a token token_tis
                                                                would truncate leaves the loss instead
    geo_rs:     c_t = 1[glo <= exp(G) <= ghi]                   verl's geo_rs: rejects a sequence whose
                                                                geometric-mean ratio leaves [glo, ghi];
                                                                no weight (length-free, unlike seq_mis)
    geo_rs_token_tis:  c_t = min(exp(d_t), C) * 1[glo <= exp(G) <= ghi]     verl's combinations of
    geo_rs_seq_tis:    c_t = min(exp(D), C)   * 1[glo <= exp(G) <= ghi]     IS and rejection
    bypass:     c_t = 1                                         no correction, but the metrics below
    loss_t    = c_t * w_t * l_t                                 w_t: STARE's weight, l_t: the PPO term

and on top of any mode but ``none`` (which the learner never calls this for):

    veto:       c_t <- c_t * 1[min_s exp(d_s) >= tau]           verl's rollout_token_veto_threshold: one
                                                                token ratio below tau rejects the sequence
    batch_normalize:  c_t <- c_t / mean_{mask=1}(c)             weights of mean 1 over the call's tokens

``bypass`` is not verl's bypass_mode, which drops the learner's pi_old and puts the engine's log-probs
into the PPO ratio itself: here the ratio stays on pi_old and the loss is the uncorrected one (as
with ``none``); what ``bypass`` adds over ``none`` is the ``rollout_correction/*`` metrics (and a veto,
if one is set), to watch the mismatch before choosing a correction.

``correction_weights`` counts, over its call's mask-1 tokens (n) and sequences (the learner calls it
once per micro-batch and token-weights the calls' metrics):

    rollout_correction/weight_mean       mean of c over the n tokens (before batch_normalize)
    rollout_correction/eff_sample_size   (sum c)^2 / (n sum c^2): 1 for equal weights, 1/n for one
                                         token carrying them all (verl's rollout_is_eff_sample_size)
    rollout_correction/chi2_token        mean_t exp(d_t)^2 - 1, and chi2_seq: mean_i exp(D_i)^2 - 1:
                                         chi^2(pi_old || mu) from mu's samples, whatever the mode
    rollout_correction/capped_frac       TIS modes: tokens whose ratio passed C
    rollout_correction/masked_frac       rejecting modes and the veto: tokens taken out
    rollout_correction/seq_rejected      seq_mis, geo_rs* and the veto: sequences taken out whole
                                         (a count), and seq_rejected_frac (a fraction)
    rollout_correction/veto_seq_frac     the veto: sequences it rejected; veto_token_frac: tokens < tau
    rollout_correction/batch_norm_factor batch_normalize: the mean divided by

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
    geo_low: float = 0.999,
    geo_high: float = 1.001,
    token_veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Detached importance weights c_t [B, T] (formulas above; 0 on mask-0 entries) and their counts.

    Args:
        logp: [B, T] the learner's log-probs of the sampled tokens (pi_old; detached here).
        logp_sampler: [B, T] the engine's log-probs of the same tokens (mu).
        response_mask: [B, T], 1 = model-generated token.
        mode: one of ``stare_agent.options.ROLLOUT_CORRECTION_MODES`` (``none``: all ones on mask-1
            tokens and no metrics; ``bypass``: all ones and the metrics).
        cap: C of the TIS modes and of ``token_mask``.
        low, high: The ratio range of ``token_mis`` / ``seq_mis``.
        geo_low, geo_high: The range of the geometric-mean ratio exp(G) of the ``geo_rs*`` modes.
        token_veto_threshold: tau of the veto (any mode but ``none``), or None (off).
        batch_normalize: Divide the weights by their mean over the mask-1 tokens of this call.

    Returns:
        (c, metrics), over this call's mask-1 tokens and its sequences with at least one:
        ``rollout_correction/weight_mean`` (before ``batch_normalize``), ``eff_sample_size``
        ((sum c)^2 / (n sum c^2): 1 when every weight is equal, 1/n when one token carries them all;
        0 when every token is out), ``chi2_token`` (token mean of exp(d)^2, less 1) and ``chi2_seq``
        (sequence mean of exp(D)^2, less 1: the raw ratios' chi-square divergences, whatever the
        mode); ``capped_frac`` (TIS modes: tokens whose ratio passed the cap); ``masked_frac``
        (modes that take tokens out, and the veto: tokens taken out); ``seq_rejected`` and
        ``seq_rejected_frac`` (``seq_mis``, ``geo_rs*`` and the veto: sequences taken out whole, a
        count and a fraction); ``veto_seq_frac`` and ``veto_token_frac`` (the veto: sequences it
        rejected, tokens below tau); ``batch_norm_factor`` (the mean divided by).
    """
    check_rollout_correction(
        mode=mode,
        cap=cap,
        low=low,
        high=high,
        geo_low=geo_low,
        geo_high=geo_high,
        token_veto_threshold=token_veto_threshold,
        batch_normalize=batch_normalize,
    )
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    n = max(int(mask.sum()), 1)
    if mode == "none":
        c = torch.where(mask, torch.ones_like(logp, dtype=torch.float32), zero).to(logp.dtype)
        return c, {"rollout_correction/weight_mean": float(c.float().sum()) / n}
    d = torch.where(mask, logp.detach().float() - logp_sampler.float(), zero)  # d_t
    D = d.sum(dim=-1, keepdim=True)  # D = sum_t d_t, [B, 1]
    token_ratio = torch.exp(d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # exp(d_t)
    seq_ratio = torch.exp(torch.where(mask, D.expand_as(d), zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    metrics: dict[str, float] = {}
    kept: Tensor | None = None  # [B, T] False: taken out by a rejection (the mode's or the veto)
    seq_out: Tensor | None = None  # [B] True: the sequence is taken out whole
    if mode in ("bypass", "geo_rs"):
        c = torch.ones_like(d)
    elif mode in ("token_tis", "geo_rs_token_tis"):
        c = token_ratio.clamp(max=cap)  # min(exp(d_t), C)
    elif mode in ("seq_tis", "geo_rs_seq_tis"):
        c = seq_ratio.clamp(max=cap)  # min(exp(D), C)
    elif mode == "token_mis":
        kept = (token_ratio >= low) & (token_ratio <= high)  # 1[lo <= exp(d_t) <= hi]
        c = torch.where(kept, token_ratio, zero)
    elif mode == "seq_mis":
        kept = (seq_ratio >= low) & (seq_ratio <= high)  # 1[lo <= exp(D) <= hi]
        c = torch.where(kept, seq_ratio, zero)
        ratio = torch.exp(D.squeeze(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        seq_out = ~((ratio >= low) & (ratio <= high))
    else:  # token_mask
        kept = token_ratio <= cap  # 1[exp(d_t) <= C]
        c = torch.where(kept, token_ratio, zero)
    if mode.endswith("tis"):
        ratio = token_ratio if mode.endswith("token_tis") else seq_ratio
        metrics["rollout_correction/capped_frac"] = float(((ratio > cap) & mask).sum()) / n
    if mode.startswith("geo_rs"):
        G = D.squeeze(-1) / mask.sum(dim=-1).clamp(min=1)  # G = D / n, the sequence's mean log ratio
        geo = torch.exp(G.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        seq_out = ~((geo >= geo_low) & (geo <= geo_high))  # not 1[glo <= exp(G) <= ghi]
        kept = ~seq_out[:, None].expand_as(mask)
        c = torch.where(kept, c, zero)
    if token_veto_threshold is not None:
        below = (token_ratio < token_veto_threshold) & mask  # exp(d_t) < tau
        vetoed = below.any(dim=-1)  # not 1[min_s exp(d_s) >= tau]
        metrics["rollout_correction/veto_token_frac"] = float(below.sum()) / n
        metrics["rollout_correction/veto_seq_frac"] = float(vetoed.sum()) / max(
            int(mask.any(dim=-1).sum()), 1
        )
        seq_out = vetoed if seq_out is None else seq_out | vetoed
        kept = ~vetoed[:, None].expand_as(mask) if kept is None else kept & ~vetoed[:, None]
        c = torch.where(kept, c, zero)
    if kept is not None:
        metrics["rollout_correction/masked_frac"] = float((~kept & mask).sum()) / n
    if seq_out is not None:
        real = mask.any(dim=-1)
        rejected = int((seq_out & real).sum())
        metrics["rollout_correction/seq_rejected"] = float(rejected)
        metrics["rollout_correction/seq_rejected_frac"] = rejected / max(int(real.sum()), 1)
    c = torch.where(mask, c, zero).to(logp.dtype)
    metrics["rollout_correction/weight_mean"] = float(c.float().sum()) / n
    total, squares = float(c.double().sum()), float(c.double().square().sum())
    # ESS = (sum c)^2 / (n sum c^2), a fraction of the n tokens
    metrics["rollout_correction/eff_sample_size"] = total * total / (n * squares) if squares > 0 else 0.0
    metrics.update(_chi_square(d, D, mask))
    if batch_normalize:
        factor = float(c.float().sum()) / n  # mean_{mask=1}(c)
        metrics["rollout_correction/batch_norm_factor"] = factor
        if factor > 0:
            c = (c.float() / factor).to(logp.dtype)
    return c, metrics


def _chi_square(d: Tensor, D: Tensor, mask: Tensor) -> dict[str, float]:
    """chi2_token = mean_t exp(d_t)^2 - 1 over mask-1 tokens; chi2_seq = mean_i exp(D_i)^2 - 1 over the
    sequences with a mask-1 token (verl's rollout_corr/chi2_token, chi2_seq: chi^2(pi_old || mu)
    estimated from mu's samples, each log ratio clamped to +-20 as the weights' are)."""
    real = mask.any(dim=-1)
    rho2 = torch.exp(2.0 * d.double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq_rho2 = torch.exp(2.0 * D.squeeze(-1).double().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[real]
    tokens = int(mask.sum())
    return {
        "rollout_correction/chi2_token": float(rho2[mask].sum()) / tokens - 1.0 if tokens else math.nan,
        "rollout_correction/chi2_seq": float(seq_rho2.mean()) - 1.0 if seq_rho2.numel() else math.nan,
    }


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
