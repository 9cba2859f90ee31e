"""STEER (Hao et al. 2025, arXiv 2510.10150): weights mapped inversely from the first-order entropy change.

    Omega_t = A_t / pi_old(o_t) p_t (1 - p_t)(log p_t + H_t);  w_t linear in |Omega_t| from w_max down to w_min

(``algorithms.token_weighting.steer_weights``).
"""

from stare_agent.algorithms.token_weighting import steer_weights
from stare_agent.methods.base import Batch, Method, Selection


class Steer(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        weights, metrics = steer_weights(
            pre.advantages,
            pre.logprobs,
            pre.entropy,
            pre.mask,
            old_logprobs=batch.old_logprobs,
            w_min=self.config.steer_w_min,
            w_max=self.config.steer_w_max,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
        )
        return Selection(weights, metrics=metrics, diagnosed={"weights": weights})
