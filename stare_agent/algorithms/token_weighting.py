"""The field's token-weighting methods beside STARE, each a pure function of what the learner has.

Each reads the detached pre-update pass (log-probs, full-vocabulary entropy H_t and, for the
first-order weighting, each position's moments) over model-written tokens only (``response_mask = 1``:
interpreter output and template glue are never weighted, counted or averaged) and returns per-token
tensors that :func:`stare_agent.algorithms.losses.policy_loss` multiplies into its dual-clip token-mean
loss (``weights``, applied after the clip as in the sources) or trains with as the advantage
(EntroAdv). docs/algorithm.md, "The field's token-weighting methods", sets each formula beside its
config fields and the source of its defaults. p_t = pi(o_t) is the pre-update probability.

**STEER** (Hao et al. 2025, "Rethinking Entropy Interventions in RLVR: An Entropy Change Perspective",
arXiv 2510.10150; the authors' ``compute_token_weights``, github.com/zz-haooo/STEER): the first-order
estimate Omega of the token's entropy change, mapped linearly and inversely onto [w_min, w_max]:

    Omega_t = A_t / pi_old(o_t) * p_t (1 - p_t) (log p_t + H_t)     p_t clamped to [1e-8, 1 - 1e-8]
    w_t     = w_max - (|Omega_t| - lo) (w_max - w_min) / (hi - lo)    lo, hi = min, max |Omega| of the block
    w_t     = (w_min + w_max) / 2 where hi = lo                        w_min = 0.8, w_max = 1.2

(a non-finite Omega counts as 0). The largest |Omega| gets w_min, the smallest w_max. On-policy
pi_old = p, so Omega_t = A_t (1 - p_t)(log p_t + H_t).

**STAPO** (Liu et al. 2026, "STAPO: Stabilizing Reinforcement Learning for LLMs by Silencing Rare
Spurious Tokens", arXiv 2602.15620): the S2T mask silences positive-advantage tokens that are both
improbable and low-entropy, and the loss averages over the tokens left (the exact opposite of STARE's
L+, which amplifies rare tokens of positive advantage):

    C     = {t : A_t > 0, p_t < tau_p}                 the improbable tokens of correct responses
    tau_h = the q-quantile of {H_t : t in C}           linear interpolation; tau_p = 0.002, q = 0.75
    S     = {t in C : H_t < tau_h}                      the silenced ("spurious") tokens
    w_t   = 0 on S,  N / (N - |S|) on the other mask-1 tokens of the block

With the token-mean loss over one block (the global scope, one optimizer step), the second weight is
exactly the paper's renormalisation: ``sum_{t not in S} l_t / (N - |S|)``.

**EntroAdv** (Cheng et al. 2025, "Reasoning with Exploration: An Entropy Perspective",
arXiv 2506.14758, Eq. 5-6), the advantage itself:

    A_t <- A_t + min(alpha H_t, |A_t| / kappa)          H_t detached; alpha = 0.4 (GRPO), kappa = 2

**First-order weighting** (ours). STARE ranks by surprisal as a stand-in for c_t, the first-order
entropy effect of a token's own update (``first_order_entropy_effect``; dH_t = -eta A_t c_t, own
position, logit space); this weighting reads c_t itself. OPEFO (arXiv 2605.11491) balances the
entropy-raising and -lowering flows of an update; its coefficients are unpublished, so this rule and
its bound are our own design:

    e_t = -A_t c_t                                      > 0: the token's update raises entropy
    F+  = sum_{e_t > 0} e_t,  F- = sum_{e_t < 0} -e_t    over the block
    lam = min(max((F- - F+) / (F- + F+), 0), lambda_max) while the gate is on (Hbar < H_tgt), else 0
    w_t = 1 + lam where e_t > 0,  1 - lam where e_t < 0,  1 elsewhere     lambda_max = 0.1 (ours)

Unbounded, lam makes the weighted flow ``sum_t w_t e_t`` zero; bounded, it moves it toward zero. With
the gate off (or F+ >= F-) every weight is 1: GRPO-ds.

**Adaptive entropy coefficient** (He et al. 2025, Skywork-OR1, arXiv 2505.22312):
:class:`AdaptiveEntropyCoefficient`, an entropy bonus whose coefficient steps toward a target.

Selection blocks follow ``stare_weights``' scopes (STEER's lo and hi, STAPO's quantile and counts, the
first-order flows): ``global`` over the whole batch on all data-parallel ranks, ``micro_batch`` inside
each of the learner's micro-batches (STEER's released loss maps the micro-batch it sees).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from stare_agent.algorithms.selection import gather_cat, scope_group, selection_blocks
from stare_agent.options import (
    Scope,
    check_adaptive_entropy_options,
    check_entroadv_options,
    check_first_order_options,
    check_stapo_options,
    check_steer_options,
)

if TYPE_CHECKING:
    from stare_agent.config import AlgorithmConfig

P_CLAMP = 1e-8  # STEER's clamp of p to [1e-8, 1 - 1e-8] and of pi_old to >= 1e-8


def first_order_entropy_effect(logp: Tensor, entropy: Tensor, moments: Tensor) -> Tensor:
    """``c_t = p_o (log p_o + H_t) - (sum_j p_j^2 log p_j + H_t sum_j p_j^2)``, so that ``dH_t = -eta A_t c_t``.

    Args:
        logp: [...] log p_o of the sampled tokens (detached here).
        entropy: [...] H_t.
        moments: [..., 2] ``(sum_j p_j^2, sum_j p_j^2 log p_j)`` of each position (the log-prob pass's
            ``with_moments``).

    Returns:
        c [...] in float64 (a difference of nearly equal terms for a near-certain token).

    Example:
        >>> p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
        >>> H = -(p * p.log()).sum()
        >>> m = torch.stack([(p * p).sum(), (p * p * p.log()).sum()])
        >>> round(float(first_order_entropy_effect(p[0].log(), H, m)), 4)
        0.1408
    """
    lp, H, m = logp.detach().double(), entropy.detach().double(), moments.detach().double()
    return lp.exp() * (lp + H) - (m[..., 1] + H * m[..., 0])


def steer_weights(
    advantages: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    response_mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    w_min: float = 0.8,
    w_max: float = 1.2,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """STEER's weights: |Omega_t| mapped inversely onto [w_min, w_max] in each block (module docstring).

    Args:
        advantages, logprobs, entropy, response_mask: [B, T] (detached here); logprobs give p_t.
        old_logprobs: [B, T] log pi_old of the ratio; None: ``logprobs`` (on-policy).
        w_min, w_max: the range (the authors' scripts: 0.8, 1.2).
        scope, micro_batches, process_group: as for ``stare_weights``.

    Returns:
        (weights [B, T] in [w_min, w_max], 1 on mask-0; metrics ``steer/weight_mean``,
        ``steer/abs_omega_mean``).
    """
    check_steer_options(w_min=w_min, w_max=w_max)
    mask = _check(response_mask, advantages=advantages, logprobs=logprobs, entropy=entropy, old=old_logprobs)
    A, lp, H = (t.detach().double() for t in (advantages, logprobs, entropy))
    old = lp if old_logprobs is None else old_logprobs.detach().double()
    p = lp.exp().clamp(P_CLAMP, 1.0 - P_CLAMP)
    omega = A / old.exp().clamp(min=P_CLAMP) * p * (1.0 - p) * (p.log() + H)
    omega = torch.where(torch.isfinite(omega) & mask, omega, 0.0).abs()
    comm = scope_group(scope, process_group)
    weights = torch.ones_like(omega)
    for rows in selection_blocks(mask.shape[0], scope, micro_batches, None, mask.device):
        m, o = mask[rows], omega[rows]
        bounds = torch.stack([torch.where(m, -o, -math.inf).max(), torch.where(m, o, -math.inf).max()])
        if comm is not None:
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=comm)
        lo, hi = -float(bounds[0]), float(bounds[1])
        if not math.isfinite(hi):  # no model token in the block
            continue
        if hi > lo:
            w = (w_max - (o - lo) * ((w_max - w_min) / (hi - lo))).clamp(w_min, w_max)
        else:
            w = torch.full_like(o, (w_min + w_max) / 2)
        weights[rows] = torch.where(m, w, 1.0)
    n, w_sum, o_sum = _sums(process_group, mask.sum(), weights[mask].sum(), omega[mask].sum())
    metrics = {"steer/weight_mean": w_sum / max(n, 1.0), "steer/abs_omega_mean": o_sum / max(n, 1.0)}
    return weights.to(logprobs.dtype), metrics


def stapo_weights(
    advantages: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    response_mask: Tensor,
    *,
    tau_p: float = 0.002,
    q: float = 0.75,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """STAPO's S2T weights: 0 on the silenced tokens S, ``N / (N - |S|)`` on the block's other model
    tokens (module docstring; the paper: tau_p = 0.002, q = 0.75).

    Returns:
        (weights [B, T], 1 on mask-0; metrics ``stapo/frac_silenced``, ``stapo/frac_candidates``: of the
        model tokens, the share silenced and the share improbable with A > 0).
    """
    check_stapo_options(tau_p=tau_p, q=q)
    mask = _check(response_mask, advantages=advantages, logprobs=logprobs, entropy=entropy)
    A, lp, H = (t.detach().double() for t in (advantages, logprobs, entropy))
    candidates = mask & (A > 0) & (lp.exp() < tau_p)
    comm = scope_group(scope, process_group)
    silenced = torch.zeros_like(mask)
    weights = torch.ones_like(H)
    for rows in selection_blocks(mask.shape[0], scope, micro_batches, None, mask.device):
        cand, h = candidates[rows], H[rows]
        pool = gather_cat(h[cand], comm)
        s = cand & (h < torch.quantile(pool, q)) if pool.numel() else torch.zeros_like(cand)
        counts = torch.stack([mask[rows].sum(), s.sum()]).double()
        if comm is not None:
            dist.all_reduce(counts, group=comm)
        n, k = counts.tolist()
        w = torch.ones_like(h)
        w[mask[rows]] = n / (n - k) if n > k else 1.0
        w[s] = 0.0
        weights[rows], silenced[rows] = w, s
    n, n_sil, n_cand = _sums(process_group, mask.sum(), silenced.sum(), candidates.sum())
    metrics = {"stapo/frac_silenced": n_sil / max(n, 1.0), "stapo/frac_candidates": n_cand / max(n, 1.0)}
    return weights.to(logprobs.dtype), metrics


def entroadv_advantages(
    advantages: Tensor,
    entropy: Tensor,
    response_mask: Tensor,
    *,
    alpha: float = 0.4,
    kappa: float = 2.0,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """The entropy-shaped advantages ``A_t + min(alpha H_t, |A_t| / kappa)`` (H detached; module docstring).

    Returns:
        (advantages [B, T], unchanged on mask-0; metrics ``entroadv/psi_mean``, the token mean of the
        added term, and ``entroadv/psi_ratio``, its sum over the sum of |A_t|, the paper's Figure 7).
    """
    check_entroadv_options(alpha=alpha, kappa=kappa)
    mask = _check(response_mask, advantages=advantages, entropy=entropy)
    A = advantages.detach()
    psi = torch.minimum(alpha * entropy.detach().to(A.dtype), A.abs() / kappa)
    psi = torch.where(mask, psi, torch.zeros((), dtype=A.dtype, device=A.device))
    n, psi_sum, a_sum = _sums(process_group, mask.sum(), psi.double().sum(), A.double().abs()[mask].sum())
    metrics = {
        "entroadv/psi_mean": psi_sum / max(n, 1.0),
        "entroadv/psi_ratio": psi_sum / a_sum if a_sum else math.nan,
    }
    return A + psi, metrics


def first_order_weights(
    advantages: Tensor,
    logprobs: Tensor,
    entropy: Tensor,
    moments: Tensor,
    response_mask: Tensor,
    *,
    gate_on: bool,
    lambda_max: float = 0.1,
    scope: Scope = "global",
    micro_batches: Sequence[Sequence[int]] | None = None,
    process_group: Any = None,
) -> tuple[Tensor, dict[str, float]]:
    """Our first-order weighting: ``1 +- lam`` on the entropy-raising / -lowering tokens by ``e_t = -A_t
    c_t``, lam balancing the block's two flows up to ``lambda_max`` while ``gate_on`` (module docstring).

    Args:
        advantages, logprobs, entropy, response_mask: [B, T]; moments: [B, T, 2] (the log-prob pass's).
        gate_on: The closed loop's gate (``entropy_gate``: Hbar < H_tgt); off: every weight is 1.
        lambda_max: The bound on lam, in [0, 1) (ours: 0.1, STARE's W - 1 and 1 - M).
        scope, micro_batches, process_group: as for ``stare_weights``.

    Returns:
        (weights [B, T], 1 on mask-0; metrics ``first_order/lambda`` (the mean over this rank's
        blocks), ``first_order/frac_raising``, ``first_order/flow`` and ``first_order/flow_weighted``:
        ``(1/N) sum_t e_t`` before and ``(1/N) sum_t w_t e_t`` after the weights).
    """
    check_first_order_options(lambda_max=lambda_max)
    mask = _check(response_mask, advantages=advantages, logprobs=logprobs, entropy=entropy)
    if moments.shape != (*mask.shape, 2):
        raise ValueError(
            f"moments {tuple(moments.shape)} must be [B, T, 2]: pass with_moments=True's third output"
        )
    c = first_order_entropy_effect(logprobs, entropy, moments)
    e = torch.where(mask, -advantages.detach().double() * c, 0.0)
    comm = scope_group(scope, process_group)
    weights = torch.ones_like(e)
    lams = []
    for rows in selection_blocks(mask.shape[0], scope, micro_batches, None, mask.device):
        eb = e[rows]
        flows = torch.stack([eb.clamp(min=0.0).sum(), (-eb).clamp(min=0.0).sum()])
        if comm is not None:
            dist.all_reduce(flows, group=comm)
        up, down = flows.tolist()
        lam = min(max((down - up) / (down + up), 0.0), lambda_max) if gate_on and down + up > 0 else 0.0
        weights[rows] = 1.0 + lam * torch.sign(eb)  # 1 + lam raising, 1 - lam lowering, 1 at e = 0
        lams.append(lam)
    n, n_up, flow, flow_w = _sums(process_group, mask.sum(), (e > 0).sum(), e.sum(), (weights * e).sum())
    metrics = {
        "first_order/lambda": sum(lams) / max(len(lams), 1),
        "first_order/frac_raising": n_up / max(n, 1.0),
        "first_order/flow": flow / max(n, 1.0),
        "first_order/flow_weighted": flow_w / max(n, 1.0),
    }
    return weights.to(logprobs.dtype), metrics


@dataclass
class AdaptiveEntropyCoefficient:
    """An entropy bonus whose coefficient steps toward a target entropy, once per step (Skywork-OR1's
    adaptive entropy control, its released ``EntController``):

        c    <- clip(c + delta, 0, c_max)  if Hbar < target,  clip(c - delta, 0, c_max)  otherwise
        beta  = c * 1[Hbar < target]       the bonus coefficient of the next step (c itself at the start)

    Hbar is the step's token-mean entropy of the model's tokens. The loss is then the entropy bonus's,
    ``l_t - beta H_t`` with H_t's gradient (``losses.entropy_bonus``). Save ``state_dict()`` with
    checkpoints and restore it with ``load_state_dict``; a run builds it with :meth:`from_config`.

    Attributes:
        coef: c, the running coefficient (Skywork-OR1's initial value: 0).
        target: The target entropy (Skywork-OR1's scripts: 0.2).
        delta: The step of c (Skywork-OR1's scripts: 1e-4).
        max_coef: c_max (Skywork-OR1's scripts: 0.005; the floor is 0).
        enabled: Whether the bonus applies next step: the last step's entropy was below the target.
    """

    coef: float
    target: float
    delta: float
    max_coef: float
    enabled: bool = True

    def __post_init__(self) -> None:
        check_adaptive_entropy_options(
            target=self.target, delta=self.delta, init=self.coef, max_coef=self.max_coef
        )

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig) -> AdaptiveEntropyCoefficient:
        """The controller of an ``algorithm`` section (``adaptive_entropy_*``; a null target is ``H_tgt``)."""
        target = algorithm.adaptive_entropy_target
        return cls(
            coef=algorithm.adaptive_entropy_init,
            target=algorithm.H_tgt if target is None else target,
            delta=algorithm.adaptive_entropy_delta,
            max_coef=algorithm.adaptive_entropy_max,
        )

    @property
    def beta(self) -> float:
        """The bonus coefficient of the next step: c while enabled, else 0."""
        return self.coef if self.enabled else 0.0

    def update(self, Hbar: float) -> dict[str, float]:
        """Step c on this step's Hbar (after its update); returns ``adaptive_entropy/coef`` and ``/enabled``."""
        below = Hbar < self.target
        self.coef = min(max(self.coef + (self.delta if below else -self.delta), 0.0), self.max_coef)
        self.enabled = below
        return {"adaptive_entropy/coef": self.coef, "adaptive_entropy/enabled": float(below)}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restored = AdaptiveEntropyCoefficient(**state)  # validates
        for key, value in asdict(restored).items():
            setattr(self, key, value)


# ----------------------------------------------------------------------------------------------


def _check(response_mask: Tensor, **tensors: Tensor | None) -> Tensor:
    """``response_mask`` as bool, after checking every given tensor is [B, T] like it."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if response_mask.dim() != 2 or any(s != tuple(response_mask.shape) for s in shapes.values()):
        raise ValueError(
            f"{', '.join(f'{k} {v}' for k, v in shapes.items())} and response_mask "
            f"{tuple(response_mask.shape)} must all be [B, T]: pad them to one shape"
        )
    return response_mask.bool()


def _sums(process_group: Any, *values: Tensor) -> list[float]:
    """The values summed over every data-parallel rank (``process_group``, or the world), as floats."""
    stacked = torch.stack([v.detach().double().reshape(()) for v in values])
    everyone = scope_group("global", process_group)
    if everyone is not None:
        dist.all_reduce(stacked, group=everyone)
    return stacked.tolist()
