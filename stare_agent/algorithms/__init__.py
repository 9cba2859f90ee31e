"""The algorithm as pure tensor functions: GRPO advantages, dynamic sampling, STARE, the loss, log-probs,
the field's other entropy controls (entropy bonus, KL-Cov, Clip-Cov, forking tokens) and its
token-weighting methods (STEER, STAPO, EntroAdv, the adaptive entropy coefficient, our first-order weighting).

Every function takes tensors (padded [B, T] with a ``response_mask``, 1 = model-generated token)
and returns tensors plus a metrics dict; docs/algorithm.md maps the paper's formulas to them.
"""

from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from stare_agent.algorithms.dynamic_sampling import (
    DynamicSamplingShortfall,
    RewardedGroup,
    dynamic_sampling,
    has_reward_variance,
)
from stare_agent.algorithms.entropy_control import (
    clip_cov_weights,
    forking_token_weights,
    kl_cov_coefficients,
    token_covariance,
)
from stare_agent.algorithms.logprobs import (
    causal_lm_logprobs_and_entropy,
    chunked_logprobs_and_entropy,
    logprobs_and_entropy_from_logits,
)
from stare_agent.algorithms.losses import entropy_bonus, policy_loss
from stare_agent.algorithms.selection import top_k_count
from stare_agent.algorithms.stare import AdaptiveController, entropy_gate, gate, stare_weights
from stare_agent.algorithms.token_weighting import (
    AdaptiveEntropyCoefficient,
    entroadv_advantages,
    first_order_entropy_effect,
    first_order_weights,
    stapo_weights,
    steer_weights,
)
from stare_agent.options import (
    AGGREGATIONS,
    SCOPES,
    VARIANTS,
    Aggregation,
    Scope,
    Variant,
    check_stare_options,
)

__all__ = [
    "AGGREGATIONS",
    "SCOPES",
    "VARIANTS",
    "AdaptiveController",
    "AdaptiveEntropyCoefficient",
    "Aggregation",
    "DynamicSamplingShortfall",
    "RewardedGroup",
    "Scope",
    "Variant",
    "broadcast_to_tokens",
    "causal_lm_logprobs_and_entropy",
    "check_stare_options",
    "chunked_logprobs_and_entropy",
    "clip_cov_weights",
    "dynamic_sampling",
    "entroadv_advantages",
    "entropy_bonus",
    "entropy_gate",
    "first_order_entropy_effect",
    "first_order_weights",
    "forking_token_weights",
    "gate",
    "grpo_advantages",
    "has_reward_variance",
    "kl_cov_coefficients",
    "logprobs_and_entropy_from_logits",
    "policy_loss",
    "stapo_weights",
    "stare_weights",
    "steer_weights",
    "token_covariance",
    "top_k_count",
]
