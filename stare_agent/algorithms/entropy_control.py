"""The field's other entropy-control methods, as token selections beside STARE's weights.

Each function reads detached statistics of the pre-update policy over model-written tokens only
(``response_mask = 1``; interpreter output and template glue are never ranked, counted or
averaged) and returns per-token tensors that :func:`stare_agent.algorithms.losses.policy_loss`
multiplies into (``weights``) or adds to (``kl_coef``) its dual-clip token-mean loss. A token taken
out of the gradient keeps its place in the token-mean denominator, as in the sources.

**Entropy bonus** (the classic regulariser, e.g. verl's ``entropy_coeff``), a coefficient beta on the
token-mean entropy of model tokens, with gradient through the full-vocabulary entropy H_t:

    loss = sum_t mask_t * (w_t * l_t - beta * H_t) / sum_t mask_t              (``losses.entropy_bonus``)

**KL-Cov** (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, Eq. 13; verl ``compute_policy_loss_kl_cov``). Per token, the centred
product of log-prob and advantage, means over the mask-1 tokens of the selection block:

    cov_t  = (logp_t - mean logp) * (A_t - mean A)
    I_KL   = the top max(1, floor(k * N)) tokens by cov_t      N = mask-1 tokens of the block
    l_t   += beta * |logp_t - logp_old_t|   on I_KL                    k = 0.002 (0.2 %), beta = 1

(:func:`kl_cov_coefficients` returns ``beta * 1[t in I_KL]``). verl's KL-Cov path drops the PPO
clip (``-A * rho``); ours keeps the dual clip so that the penalty is the only change from GRPO-ds.
On-policy with one optimizer step per batch (this package's setting), ``logp = logp_old`` at the
step, so the penalty and its gradient are 0 (torch's |x| has gradient 0 at 0): KL-Cov acts only
from the second optimizer step on one batch (the paper's runs take several mini-batch steps).

**Clip-Cov** (same paper, Eq. 12; verl ``compute_policy_loss_clip_cov``): of the tokens whose
covariance lies in (omega_low, omega_high), a random max(1, floor(r * N)) are detached from the
gradient (weight 0):

    I_clip = random max(1, floor(r * N)) of {t : omega_low < cov_t < omega_high}
    w_t    = 0 on I_clip, 1 elsewhere                           r = 2e-4, omega_low = 1, omega_high = 5

(:func:`clip_cov_weights`). verl also leaves out of the candidates the tokens the PPO clip already
clipped; the selection here runs before the update, where rho = 1 and none is clipped.

**Forking tokens** (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning", arXiv 2506.01939, Eq. 4): the policy gradient
only on the top rho = 20 % of tokens by the policy's entropy at their position:

    I_H = the top ceil(rho * N) tokens by H_t;  w_t = 1 on I_H, 0 elsewhere     (:func:`forking_token_weights`)

The paper thresholds at the batch's entropy quantile; a top-k by count is the same set except for
ties, which are broken by (sequence key, position) as STARE's are.

Selection blocks follow ``stare_weights``' scopes: ``global`` over the whole batch on all
data-parallel ranks (the means of cov_t too: a global top fraction is global), ``micro_batch``
inside each of the learner's micro-batches (verl computes per micro-batch on each GPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from stare_agent.algorithms.selection import (
    POSITION_BITS,
    gather_cat,
    scope_group,
    selection_blocks,
    sequence_keys,
    top_k,
)
from stare_agent.options import Scope


def token_covariance(advantages: Tensor, logprobs: Tensor, rows: Tensor, mask: Tensor, comm: Any) -> Tensor:
    """``cov_t = (logp_t - mean logp) * (A_t - mean A)`` on the block ``rows``, means over its mask-1
    tokens (on all ranks of ``comm``); 0 on mask-0 entries."""
    m = mask[rows]
    A, lp = advantages[rows].detach().double(), logprobs[rows].detach().double()
    zero = torch.zeros((), dtype=torch.float64, device=A.device)
    sums = torch.stack([torch.where(m, A, zero).sum(), torch.where(m, lp, zero).sum(), m.sum().double()])
    if comm is not None:
        dist.all_reduce(sums, group=comm)
    n = max(float(sums[2]), 1.0)
    cov = (lp - sums[1] / n) * (A - sums[0] / n)
    return torch.where(m, cov, zero)


def kl_cov_coefficients(
    advantages: Tensor,
    logprobs: Tensor,
    response_mask: Tensor,
    *,
    k: float = 0.002,
    coef: float = 1.0,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    sequence_ids: Tensor | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov's per-token penalty coefficients: ``coef`` on the top ``max(1, floor(k * N))`` tokens
    by ``cov_t`` of each selection block, 0 elsewhere (module docstring).

    Args:
        advantages, logprobs, response_mask: [B, T], as for ``stare_weights`` (detached here).
        k: fraction of the block's N mask-1 tokens penalised (paper, 7B: 0.2 %).
        coef: beta, the penalty coefficient (paper: 1).
        scope, micro_batches, sequence_ids, process_group: as for ``stare_weights``.

    Returns:
        (kl_coef [B, T], metrics ``kl_cov/frac_selected``, ``kl_cov/cov_selected_mean``).
    """
    _check(advantages, logprobs, response_mask, k, "KL-Cov k")
    selected, cov = _cov_top(
        advantages, logprobs, response_mask, k, scope, micro_batches, sequence_ids, process_group
    )
    coefs = torch.where(selected, coef, 0.0).to(logprobs.dtype)
    return coefs, _selection_metrics("kl_cov", selected, response_mask, cov, process_group)


def clip_cov_weights(
    advantages: Tensor,
    logprobs: Tensor,
    response_mask: Tensor,
    *,
    r: float = 2e-4,
    lb: float = 1.0,
    ub: float = 5.0,
    generator: torch.Generator | None = None,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    sequence_ids: Tensor | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov's weights: 0 on ``max(1, floor(r * N))`` random tokens with ``lb < cov_t < ub`` (fewer
    when fewer qualify) in each selection block, 1 elsewhere.

    ``generator`` draws the random subset; pass one seeded identically on every rank (the candidates
    are gathered and permuted in one global order, so every rank picks the same subset).

    Returns:
        (weights [B, T] in {0, 1}, metrics ``clip_cov/frac_selected``, ``clip_cov/cov_selected_mean``,
        ``clip_cov/frac_candidates``).
    """
    _check(advantages, logprobs, response_mask, r, "Clip-Cov r")
    if not lb < ub:
        raise ValueError(f"Clip-Cov needs lb < ub (got {lb}, {ub}): the paper uses 1 and 5")
    mask = response_mask.bool()
    B, T = mask.shape
    comm = scope_group(scope, process_group)
    seq_key = sequence_keys(B, sequence_ids, mask.device, comm)
    selected = torch.zeros_like(mask)
    candidates = torch.zeros_like(mask)
    cov = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    for rows in selection_blocks(B, scope, micro_batches, None, mask.device):
        cov[rows] = token_covariance(advantages, logprobs, rows, mask, comm)
        cand = mask[rows] & (cov[rows] > lb) & (cov[rows] < ub)
        candidates[rows] = cand
        idx = cand.flatten().nonzero().squeeze(1)
        keys = (seq_key[rows][idx // T] << POSITION_BITS) | (idx % T)
        all_keys = torch.sort(gather_cat(keys, comm)).values  # one global order on every rank
        take = min(_floor_count(r)(int(_count(mask[rows], comm))), all_keys.numel())
        chosen = all_keys[torch.randperm(all_keys.numel(), generator=generator)[:take].to(all_keys.device)]
        block = torch.zeros(cand.numel(), dtype=torch.bool, device=mask.device)
        block[idx[torch.isin(keys, chosen)]] = True
        selected[rows] = block.view_as(cand)
    weights = torch.where(selected, 0.0, 1.0).to(logprobs.dtype)
    metrics = _selection_metrics("clip_cov", selected, response_mask, cov, process_group)
    everyone = scope_group("global", process_group)
    metrics["clip_cov/frac_candidates"] = float(_count(candidates, everyone)) / max(
        float(_count(mask, everyone)), 1.0
    )
    return weights, metrics


def forking_token_weights(
    entropy: Tensor,
    response_mask: Tensor,
    *,
    rho: float = 0.2,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    sequence_ids: Tensor | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """The "forking token" update's weights: 1 on the top ``ceil(rho * N)`` tokens by H_t of each
    selection block, 0 on the other mask-1 tokens (module docstring; paper: rho = 0.2).

    Returns:
        (weights [B, T] in {0, 1} (1 on mask-0, which the loss never reads), metrics
        ``forking/frac_selected``, ``forking/H_selected_min``: the entropy threshold reached).
    """
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"forking-token rho={rho} must satisfy 0 < rho <= 1: the paper uses 0.2")
    mask = response_mask.bool()
    if entropy.shape != mask.shape or entropy.dim() != 2:
        raise ValueError(
            f"entropy {tuple(entropy.shape)} and response_mask {tuple(mask.shape)} must be one [B, T]"
        )
    B = mask.shape[0]
    comm = scope_group(scope, process_group)
    seq_key = sequence_keys(B, sequence_ids, mask.device, comm)
    H = entropy.detach().float() if entropy.dtype not in (torch.float32, torch.float64) else entropy.detach()
    selected = torch.zeros_like(mask)
    for rows in selection_blocks(B, scope, micro_batches, None, mask.device):
        selected[rows] = top_k(H[rows], mask[rows], seq_key[rows], rho, comm)
    weights = torch.where(selected | ~mask, 1.0, 0.0).to(entropy.dtype)
    everyone = scope_group("global", process_group)
    n_sel, n = _count(selected, everyone), _count(mask, everyone)
    h_min = H[selected].min() if selected.any() else torch.tensor(math.inf, device=H.device)
    h_min = h_min.to(torch.float64).reshape(1)
    if everyone is not None:
        dist.all_reduce(h_min, op=dist.ReduceOp.MIN, group=everyone)
    return weights, {
        "forking/frac_selected": float(n_sel) / max(float(n), 1.0),
        "forking/H_selected_min": float(h_min),
    }


# ----------------------------------------------------------------------------------------------


def _check(advantages: Tensor, logprobs: Tensor, response_mask: Tensor, fraction: float, name: str) -> None:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{name}={fraction} must satisfy 0 < {name.split()[-1]} <= 1 (a fraction of tokens)")
    if not (advantages.shape == logprobs.shape == response_mask.shape and advantages.dim() == 2):
        raise ValueError(
            f"advantages {tuple(advantages.shape)}, logprobs {tuple(logprobs.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must all be [B, T]: pad them to one shape"
        )


def _floor_count(k: float) -> Callable[[int], int]:
    """``n -> max(1, floor(k * n))`` (0 when n = 0), k read as the decimal it was written as."""
    exact = Fraction(repr(float(k)))
    return lambda n: max(1, math.floor(exact * n)) if n else 0


def _cov_top(
    advantages: Tensor,
    logprobs: Tensor,
    response_mask: Tensor,
    k: float,
    scope: Scope,
    micro_batches: Sequence[Sequence[int]] | None,
    sequence_ids: Tensor | None,
    process_group: Any,
) -> tuple[Tensor, Tensor]:
    mask = response_mask.bool()
    B = mask.shape[0]
    comm = scope_group(scope, process_group)
    seq_key = sequence_keys(B, sequence_ids, mask.device, comm)
    selected = torch.zeros_like(mask)
    cov = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    for rows in selection_blocks(B, scope, micro_batches, None, mask.device):
        cov[rows] = token_covariance(advantages, logprobs, rows, mask, comm)
        selected[rows] = top_k(cov[rows], mask[rows], seq_key[rows], k, comm, count=_floor_count(k))
    return selected, cov


def _count(mask: Tensor, comm: Any) -> Tensor:
    n = mask.sum().to(torch.int64).reshape(1)
    if comm is not None:
        dist.all_reduce(n, group=comm)
    return n[0]


def _selection_metrics(
    prefix: str, selected: Tensor, response_mask: Tensor, cov: Tensor, process_group: Any
) -> dict[str, float]:
    everyone = scope_group("global", process_group)
    mask = response_mask.bool()
    stats = torch.stack([selected.sum().double(), mask.sum().double(), cov[selected].sum()]).reshape(3)
    if everyone is not None:
        dist.all_reduce(stats, group=everyone)
    n_sel, n, cov_sum = stats.tolist()
    return {
        f"{prefix}/frac_selected": n_sel / max(n, 1.0),
        f"{prefix}/cov_selected_mean": cov_sum / n_sel if n_sel else float("nan"),
    }
