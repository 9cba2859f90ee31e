"""STARE token weights, the closed-loop entropy gate and the adaptive W/M schedule.

Paper: "STARE: Surprisal-Guided Token-Level Advantage Reweighting for Policy Entropy Stability",
arXiv 2606.19236 (as implemented: docs/algorithm.md). Over model-generated tokens only (mask = 1):

    s_t    = -log pi_theta(o_t)                          surprisal, detached
    T+     = {t : mask_t = 1, A_t > 0}                   T- = {t : mask_t = 1, A_t < 0}   (A = 0: neither)
    L+     = top ceil(P * |T+|) tokens of T+ by s        L- = top ceil(P * |T-|) of T- by s   (C2 only)
    Hbar   = sum_t mask_t * H_t / sum_t mask_t           over the whole batch on all ranks
    gate   = Hbar < H_tgt                                strictly less; on/off
    w_t    = W on L+,  M on L- (C2),  1 elsewhere;       w = 1 everywhere when the gate is off
    W     <- clip(W + alpha * sign(H_tgt - Hbar), 1, W_max)     (adaptive schedule, optional)
    M     <- clip(M - alpha * sign(H_tgt - Hbar), M_min, 1)

Defaults: P = 0.10, W = 1.1, M = 0.9, H_tgt = 0.3. Variants: O1 = L+ only, C2 = L+ and L-.

Scopes: ``micro_batch`` selects L+/L- inside each micro-batch (the authors' released code);
``global`` is an exact top-k over the whole on-policy batch across data-parallel ranks.

Ties in s are broken by a stable key, (sequence key, token position) ascending, where the
sequence key is ``sequence_ids`` when given (e.g. a global episode index) or else the global row
index. So the selection is deterministic, and with ``sequence_ids`` exactly invariant to permuting
sequences; without them, permuting can only swap which of several equal-surprisal tokens is chosen.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from stare_agent.algorithms.selection import (
    POSITION_BITS,
    gather_cat,
    is_distributed,
    selection_blocks,
    sequence_keys,
    top_k,
)
from stare_agent.options import (
    Scope,
    Variant,
    check_adaptive_options,
    check_stare_options,
)

if TYPE_CHECKING:
    from stare_agent.config import AlgorithmConfig

# ----------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------


def entropy_gate(
    entropy: Tensor, response_mask: Tensor, H_tgt: float = 0.3, *, process_group: Any = None
) -> tuple[bool, float, dict[str, float]]:
    """Closed-loop gate: ``gate_on = Hbar < H_tgt`` with ``Hbar = sum(mask * H) / sum(mask)``.

    Hbar is the masked token-mean over all mask-1 tokens of the batch on ALL ranks (all_reduce
    of the sum and the count when torch.distributed is initialized), so every rank gets the same
    gate. Mask-0 entries are never read (NaN there is harmless).

    Args:
        entropy: [B, T] full-vocabulary entropy H_t of each token (detached here).
        response_mask: [B, T], 1 = model-generated token.
        H_tgt: target entropy (default 0.3).
        process_group: optional process group (default: the world).

    Returns:
        (gate_on, Hbar, metrics). Raises ValueError when no rank has a mask-1 token.
    """
    mask = response_mask.bool()
    stats = torch.stack([entropy.detach()[mask].double().sum(), mask.sum().double()])
    if is_distributed():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    total, count = stats.tolist()
    if count == 0:
        raise ValueError(
            "entropy_gate got no mask-1 tokens on any rank: the batch holds no model-generated token"
        )
    Hbar = total / count
    gate_on, metrics = gate(Hbar, H_tgt)
    return gate_on, Hbar, metrics


def gate(Hbar: float, H_tgt: float) -> tuple[bool, dict[str, float]]:
    """``gate_on = Hbar < H_tgt`` for an Hbar already reduced over the batch, and its metrics."""
    gate_on = Hbar < H_tgt
    return gate_on, {"stare/gate_on": float(gate_on), "stare/entropy": Hbar, "stare/H_tgt": H_tgt}


@dataclass
class AdaptiveController:
    """Optional adaptive schedule for W and M, stepped once per optimizer step (off by default).

    ``W <- clip(W + alpha * sign(H_tgt - Hbar), 1, W_max)``,
    ``M <- clip(M - alpha * sign(H_tgt - Hbar), M_min, 1)``.
    Call ``update(Hbar)`` right after the gate, then use ``W``/``M`` for this step's weights.
    Save ``state_dict()`` with checkpoints and restore it with ``load_state_dict``. A run builds it
    with :meth:`from_config`; the defaults are ``AlgorithmConfig``'s (stated there once).
    """

    W: float
    M: float
    H_tgt: float
    alpha: float
    W_max: float
    M_min: float

    def __post_init__(self) -> None:
        check_adaptive_options(W=self.W, M=self.M, alpha=self.alpha, W_max=self.W_max, M_min=self.M_min)

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig) -> AdaptiveController:
        """The controller of an ``algorithm`` config section. Without ``algorithm.adaptive`` its step
        is 0 (W and M stay fixed) and its bounds widen to hold any W and M the config allows."""
        return cls(
            W=algorithm.W,
            M=algorithm.M,
            H_tgt=algorithm.H_tgt,
            alpha=algorithm.alpha if algorithm.adaptive else 0.0,
            W_max=max(algorithm.W_max, algorithm.W),
            M_min=min(algorithm.M_min, algorithm.M),
        )

    def update(self, Hbar: float) -> dict[str, float]:
        """Step W and M toward raising entropy when Hbar < H_tgt (lowering it when above)."""
        direction = float(math.copysign(1.0, self.H_tgt - Hbar)) if Hbar != self.H_tgt else 0.0
        self.W = min(max(self.W + self.alpha * direction, 1.0), self.W_max)
        self.M = min(max(self.M - self.alpha * direction, self.M_min), 1.0)
        return {"stare/W": self.W, "stare/M": self.M}

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        restored = AdaptiveController(**state)  # validates
        for key, value in asdict(restored).items():
            setattr(self, key, value)


# ----------------------------------------------------------------------------------------------
# The weights
# ----------------------------------------------------------------------------------------------


def stare_weights(
    advantages: Tensor,
    logprobs: Tensor,
    response_mask: Tensor,
    *,
    gate_on: bool,
    variant: Variant = "O1",
    P: float = 0.10,
    W: float = 1.1,
    M: float = 0.9,
    scope: Scope = "micro_batch",
    micro_batches: Sequence[Sequence[int]] | None = None,
    micro_batch_size: int | None = None,
    sequence_ids: Tensor | None = None,
    Hbar: float | None = None,
    L_plus_filter: Tensor | None = None,
    process_group: Any = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, float]]:
    """STARE token weights ``w_t`` (see the module docstring for the formulas).

    Args:
        advantages: [B, T] token advantages A_t (GRPO advantage broadcast to mask-1 tokens).
        logprobs: [B, T] log pi_theta(o_t); the surprisal is ``s = -logprobs.detach()``.
        response_mask: [B, T], 1 = model-generated token; only these are ranked or counted.
        gate_on: output of ``entropy_gate``; when False every weight is 1 (the loss is GRPO-ds).
        variant: "O1" (W on L+) or "C2" (W on L+, M on L-).
        P, W, M: fraction selected, amplification of L+, attenuation of L-.
        scope: "micro_batch" selects inside each micro-batch (the whole input when neither
            ``micro_batches`` nor ``micro_batch_size`` is given); "global" selects over all rows on
            all ranks (all_gather).
        micro_batches: the learner's split of the rows (lists of row indices that cover each row
            exactly once), for the micro_batch scope.
        micro_batch_size: shorthand for consecutive micro-batches of this many rows.
        sequence_ids: optional [B] distinct non-negative int ids (global across ranks) used as
            the tie-break key; default: the global row index.
        Hbar: the batch entropy of ``entropy_gate``; when given, the metrics add
            ``stare/L_plus_s_above_Hbar``, the fraction of L+ whose surprisal exceeds the batch-mean
            entropy. It does NOT say whether reinforcing them raises entropy (that depends on each
            position's own distribution: the research floor's mechanism metrics measure that).
        L_plus_filter: optional [B, T] bool: L+ keeps only its tokens where this is True, after the
            top-k (whose count stays ``ceil(P * |T+|)``); for variants of the L+ rule, e.g. the research
            floor's ``top_k_raising``. None: the paper's L+.
        process_group: optional process group (default: the world) of the global selection and of the
            metrics.

    Returns:
        (weights [B, T] in {1, W, M} (1 on mask-0), L+ mask [B, T], L- mask [B, T] (all False
        for O1), metrics). L+/L- are computed even when the gate is off, for logging. The metrics
        describe the whole batch on all ranks in both scopes (counts summed, surprisal quantiles
        over every rank's mask-1 tokens): with torch.distributed initialized every rank of
        ``process_group`` calls this once per batch.
    """
    check_stare_options(variant=variant, scope=scope, P=P, W=W, M=M)
    if not (advantages.shape == logprobs.shape == response_mask.shape and advantages.dim() == 2):
        raise ValueError(
            f"advantages {tuple(advantages.shape)}, logprobs {tuple(logprobs.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must all be [B, T]: pad them to one shape"
        )
    mask = response_mask.bool()
    s = -logprobs.detach()  # surprisal
    if s.dtype not in (torch.float32, torch.float64):
        s = s.float()
    if torch.isnan(s).logical_and_(mask).any():
        raise ValueError("NaN log-prob on a mask-1 token: recompute log-probs (check the model's forward)")
    B, T = s.shape
    if T >= 1 << POSITION_BITS:
        raise ValueError(f"sequence length {T} exceeds 2**{POSITION_BITS}: split the sequences")
    A = advantages.detach()
    T_plus, T_minus = mask & (A > 0), mask & (A < 0)

    # --- selection: exact top-k by s (ties: smaller key first) inside each selection block
    # the process group of the metrics, and of the selection in the global scope (None: no communication)
    everyone = (
        (process_group if process_group is not None else dist.group.WORLD) if is_distributed() else None
    )
    comm = everyone if scope == "global" else None
    seq_key = sequence_keys(B, sequence_ids, s.device, comm)
    L_plus = torch.zeros_like(mask)
    L_minus = torch.zeros_like(mask)
    for rows in selection_blocks(B, scope, micro_batches, micro_batch_size, s.device):
        L_plus[rows] = top_k(s[rows], T_plus[rows], seq_key[rows], P, comm)
        if variant == "C2":
            L_minus[rows] = top_k(s[rows], T_minus[rows], seq_key[rows], P, comm)
    if L_plus_filter is not None:
        L_plus &= L_plus_filter.to(L_plus.device, torch.bool)

    # --- weights: W on L+, M on L- (C2), 1 elsewhere; all 1 when the gate is off
    weights = torch.ones_like(s, dtype=logprobs.dtype)
    if gate_on:
        weights[L_plus] = W
        weights[L_minus] = M

    # --- metrics over the whole batch on all ranks (one all_reduce, one all_gather)
    above = L_plus & (s > Hbar) if Hbar is not None else torch.zeros_like(mask)
    counts = torch.stack([m.sum() for m in (mask, T_plus, T_minus, L_plus, L_minus, above)]).to(torch.int64)
    if everyone is not None:
        dist.all_reduce(counts, group=everyone)
    n_tokens, n_plus, n_minus, k_plus, k_minus, k_above = (int(c) for c in counts)
    sizes = {"T+": n_plus, "T-": n_minus, "L+": k_plus, "L-": k_minus}
    s_all = gather_cat(s[mask], everyone)
    metrics = weight_metrics(s_all, torch.ones_like(s_all, dtype=torch.bool), sizes, n_tokens, gate_on, W, M)
    if Hbar is not None:
        metrics["stare/L_plus_s_above_Hbar"] = k_above / k_plus if k_plus else float("nan")
    return weights, L_plus, L_minus, metrics


def weight_metrics(
    s: Tensor, mask: Tensor, sizes: dict[str, int], n_tokens: int, gate_on: bool, W: float, M: float
) -> dict[str, float]:
    """The metrics of ``stare_weights`` from its counts and the surprisals ``s[mask]``.

    ``sizes`` holds ``|T+|, |T-|, |L+|, |L-|`` under the keys ``T+``, ``T-``, ``L+``, ``L-``;
    surprisal quantiles are nearest-rank (``ceil(q * n)``-th smallest).
    """
    n = max(n_tokens, 1)
    n_plus, n_minus = (sizes["L+"], sizes["L-"]) if gate_on else (0, 0)
    weight_sum = n_tokens - n_plus - n_minus + W * n_plus + M * n_minus  # = sum_t mask_t * w_t
    metrics = {
        "stare/gate_on": float(gate_on),
        "stare/W": W,
        "stare/M": M,
        "stare/frac_T_plus": sizes["T+"] / n,
        "stare/frac_T_minus": sizes["T-"] / n,
        "stare/T_plus": float(sizes["T+"]),
        "stare/T_minus": float(sizes["T-"]),
        "stare/L_plus": float(sizes["L+"]),
        "stare/L_minus": float(sizes["L-"]),
        "stare/frac_reweighted": (n_plus + n_minus) / n,
        "stare/mean_weight": weight_sum / n if n_tokens else 1.0,
    }
    s_tok = torch.masked_select(s, mask).float().cpu().numpy()
    ranks = [max(1, math.ceil(q * s_tok.size)) - 1 for q in (0.5, 0.9, 0.99)]  # nearest-rank quantiles
    values = np.partition(s_tok, ranks)[ranks] if s_tok.size else np.zeros(3)  # selection, no full sort
    for name, value in zip(("p50", "p90", "p99"), values, strict=True):
        metrics[f"stare/surprisal_{name}"] = float(value)
    return metrics
