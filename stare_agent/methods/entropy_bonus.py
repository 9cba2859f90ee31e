"""The entropy bonus, fixed or adaptive: the loss subtracts beta times the token-mean entropy.

    loss = sum_t mask_t (l_t - beta H_t) / sum_t mask_t         (``algorithms.losses.entropy_bonus``)

``entropy_bonus``: beta = ``algorithm.entropy_coef``. ``adaptive_entropy`` (Skywork-OR1, arXiv
2505.22312): beta steps toward a target entropy once a step
(``algorithms.token_weighting.AdaptiveEntropyCoefficient``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stare_agent.algorithms.token_weighting import AdaptiveEntropyCoefficient
from stare_agent.methods.base import Method

if TYPE_CHECKING:
    from stare_agent.config import AlgorithmConfig


class EntropyBonus(Method):
    def entropy_coef(self) -> float:
        return self.config.entropy_coef


class AdaptiveEntropy(Method):
    def __init__(self, config: AlgorithmConfig) -> None:
        super().__init__(config)
        self.controller = AdaptiveEntropyCoefficient.from_config(config)

    def entropy_coef(self) -> float:
        return self.controller.beta

    def after_update(self, Hbar: float) -> dict[str, float]:
        """The coefficient this step trained with, then its step on this step's entropy."""
        return {"adaptive_entropy/beta": self.controller.beta, **self.controller.update(Hbar)}

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.controller.load_state_dict(state)
