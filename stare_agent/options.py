"""The algorithm's options and their rules, with no torch: the floor under the config and the algorithms.

``stare_agent.config`` validates a run with these functions, and the tensor functions of
``stare_agent.algorithms`` validate their arguments with the same ones, so each rule is written once
and loading a config imports no torch. Each error names the rule and the fix.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from stare_agent.errors import StareError

Variant = Literal["O1", "C2"]
Scope = Literal["micro_batch", "global"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
VARIANTS: tuple[str, ...] = get_args(Variant)
SCOPES: tuple[str, ...] = get_args(Scope)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
ROLLOUT_CORRECTION_MODES = (
    "none",
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "token_mask",
    "geo_rs",
    "geo_rs_token_tis",
    "geo_rs_seq_tis",
    "bypass",
)

ENGINE_NAMES = ("auto", "transformers", "vllm", "sglang", "openai")
"""What ``stare_agent.engines.start_engine`` starts: ``env.engine``'s choices (``stare_agent.config.ENGINES``),
and ``openai``, a served model (``stare-agent eval --engine openai --base-url ...``)."""


def check_stare_options(*, variant: str, scope: str, P: float, W: float, M: float) -> None:
    """Validate the STARE options once (``stare_weights`` and the config use it)."""
    if variant not in VARIANTS:
        raise ValueError(
            f"STARE variant {variant!r} is unknown: use 'O1' (amplify L+) or 'C2' (amplify L+, attenuate L-)"
        )
    if scope not in SCOPES:
        raise ValueError(
            f"STARE scope {scope!r} is unknown: use 'micro_batch' (authors' code) or 'global' (whole batch)"
        )
    if not 0.0 < P <= 1.0:
        raise ValueError(f"STARE P={P} must satisfy 0 < P <= 1 (fraction of T+/T- reweighted): e.g. P=0.10")
    if not W >= 1.0:
        raise ValueError(f"STARE W={W} must be >= 1 (it amplifies L+): e.g. W=1.1")
    if not 0.0 < M <= 1.0:
        raise ValueError(
            f"STARE M={M} must satisfy 0 < M <= 1 (it attenuates L-, never flips a sign): e.g. M=0.9"
        )


def check_adaptive_options(*, W: float, M: float, alpha: float, W_max: float, M_min: float) -> None:
    """Validate the adaptive W/M schedule once (``AdaptiveController`` and the config use it)."""
    if not 1.0 <= W <= W_max:
        raise ValueError(
            f"adaptive W={W} must lie in [1, W_max={W_max}]: lower W or raise W_max (paper: 1.5)"
        )
    if not 0.0 < M_min <= M <= 1.0:
        raise ValueError(
            f"adaptive M={M} must lie in [M_min={M_min}, 1] with M_min > 0: fix M or M_min (paper: 0.5)"
        )
    if not alpha >= 0.0:
        raise ValueError(f"adaptive alpha={alpha} must be >= 0: e.g. alpha=0.01")


def check_loss_options(*, agg: str, eps_low: float, eps_high: float, clip_c: float) -> None:
    """Validate the loss options once (``policy_loss`` and the config use it)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {agg!r} is unknown: use one of {', '.join(AGGREGATIONS)}")
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0 and clip_c > 1.0):
        raise ValueError(
            f"need 0 <= eps_low < 1, eps_high >= 0 and clip_c > 1 (got {eps_low}, {eps_high}, {clip_c}): "
            "use the paper's 0.2, 0.28, 10"
        )


def check_rollout_correction(
    *,
    mode: str,
    cap: float,
    low: float,
    high: float,
    geo_low: float = 0.999,
    geo_high: float = 1.001,
    token_veto_threshold: float | None = None,
    batch_normalize: bool = False,
) -> None:
    """Validate the rollout-correction options once (the config and ``correction_weights`` use it)."""
    if mode not in ROLLOUT_CORRECTION_MODES:
        raise ValueError(
            f"rollout correction mode {mode!r} is unknown: use one of {', '.join(ROLLOUT_CORRECTION_MODES)} (or auto)"
        )
    if not cap >= 1.0:
        raise ValueError(
            f"rollout correction cap={cap} must be >= 1 (a weight below 1 everywhere): the usual C is 2"
        )
    if not 0.0 <= low < 1.0 < high:
        raise ValueError(
            f"need 0 <= low < 1 < high for masked IS (got low={low}, high={high}): e.g. 0.5 and 2"
        )
    if not 0.0 < geo_low < 1.0 < geo_high:
        raise ValueError(
            f"need 0 < geo_low < 1 < geo_high for geometric-mean rejection (got geo_low={geo_low}, "
            f"geo_high={geo_high}): a per-token mean ratio, so close to 1: verl's 0.999 and 1.001"
        )
    if token_veto_threshold is not None and not 0.0 < token_veto_threshold < 1.0:
        raise ValueError(
            f"rollout correction token_veto_threshold={token_veto_threshold} must lie in (0, 1) (a token "
            "ratio below it rejects its sequence) or be null (off): e.g. 1e-4"
        )
    if mode == "none" and (token_veto_threshold is not None or batch_normalize):
        raise ValueError(
            "rollout correction mode none applies nothing, so token_veto_threshold and batch_normalize "
            "would do nothing: pick a mode (bypass for the veto alone) or drop them"
        )


def check_steer_options(*, w_min: float, w_max: float) -> None:
    """Validate STEER's weight range once (``steer_weights`` and the config use it)."""
    if not 0.0 < w_min <= w_max:
        raise ValueError(
            f"STEER needs 0 < w_min <= w_max (got {w_min}, {w_max}): its released scripts use 0.8 and 1.2"
        )


def check_stapo_options(*, tau_p: float, q: float) -> None:
    """Validate STAPO's thresholds once (``stapo_weights`` and the config use it)."""
    if not (0.0 < tau_p <= 1.0 and 0.0 < q <= 1.0):
        raise ValueError(
            f"STAPO needs 0 < tau_p <= 1 (a probability) and 0 < q <= 1 (a quantile) (got {tau_p}, {q}): "
            "the paper uses 0.002 and 0.75"
        )


def check_entroadv_options(*, alpha: float, kappa: float) -> None:
    """Validate the entropy advantage's coefficients once (``entroadv_advantages`` and the config use it)."""
    if not (alpha > 0.0 and kappa > 1.0):
        raise ValueError(
            f"EntroAdv needs alpha > 0 and kappa > 1 (so that no advantage changes sign) (got {alpha}, {kappa}): "
            "the paper uses 0.4 (GRPO) and 2"
        )


def check_first_order_options(*, lambda_max: float) -> None:
    """Validate the first-order weighting's bound once (``first_order_weights`` and the config use it)."""
    if not 0.0 <= lambda_max < 1.0:
        raise ValueError(
            f"first-order lambda_max={lambda_max} must lie in [0, 1) (weights 1 +- lambda stay > 0): e.g. 0.1"
        )


def check_adaptive_entropy_options(
    *, target: float | None, delta: float, init: float, max_coef: float
) -> None:
    """Validate the adaptive entropy coefficient once (``AdaptiveEntropyCoefficient`` and the config use it)."""
    if target is not None and not target > 0.0:
        raise ValueError(f"adaptive entropy target={target} must be > 0 (nats) or null (H_tgt): e.g. 0.2")
    if not (delta >= 0.0 and 0.0 <= init <= max_coef):
        raise ValueError(
            f"adaptive entropy needs delta >= 0 and 0 <= init <= max (got {delta}, {init}, {max_coef}): "
            "Skywork-OR1's scripts use 1e-4, 0 and 0.005"
        )


# ----------------------------------------------------------------------------------------------
# The methods by name (``algorithm.name``): entry points, so that a config checks a name without torch
# ----------------------------------------------------------------------------------------------


class MethodRegistryError(StareError, ValueError):
    """A method name registered twice with another entry point, or an entry point that does not load."""


METHODS: dict[str, Any] = {
    "grpo": "stare_agent.methods.grpo:GRPO",
    "grpo_ds": "stare_agent.methods.grpo:GRPO",
    "stare": "stare_agent.methods.stare:Stare",
    "kl_cov": "stare_agent.methods.kl_cov:KLCov",
    "clip_cov": "stare_agent.methods.clip_cov:ClipCov",
    "entropy_bonus": "stare_agent.methods.entropy_bonus:EntropyBonus",
    "forking_tokens": "stare_agent.methods.forking_tokens:ForkingTokens",
    "steer": "stare_agent.methods.steer:Steer",
    "stapo": "stare_agent.methods.stapo:Stapo",
    "entroadv": "stare_agent.methods.entroadv:EntroAdv",
    "adaptive_entropy": "stare_agent.methods.entropy_bonus:AdaptiveEntropy",
    "first_order": "stare_agent.methods.first_order:FirstOrder",
}
"""``algorithm.name`` -> a ``"module:Class"`` entry point or the class (``stare_agent.methods``)."""


def register_method(name: str, entry_point: Any) -> None:
    """Register a method under ``name``: a ``"module:Class"`` string (imported when a run makes it) or
    the class. Registering the same entry point again is a no-op; another one under a taken name is an
    error naming both."""
    known = METHODS.get(name)
    if known is not None and entry_label(known) != entry_label(entry_point):
        raise MethodRegistryError(
            f"method {name!r} is already registered ({entry_label(known)}): pick another name for "
            f"{entry_label(entry_point)}"
        )
    METHODS[name] = entry_point


def method_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-in ones first)."""
    return tuple(METHODS)


def entry_label(entry: Any) -> str:
    """An entry point as ``module:Class``."""
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"
