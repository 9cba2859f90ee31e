"""STAPO (Liu et al. 2026, arXiv 2602.15620): rare, low-entropy tokens of correct answers silenced.

    S = {t : A_t > 0, p_t < tau_p, H_t < q-quantile of their H};  w_t = 0 on S,  N / (N - |S|) elsewhere

(``algorithms.token_weighting.stapo_weights``).
"""

from stare_agent.algorithms.token_weighting import stapo_weights
from stare_agent.methods.base import Batch, Method, Selection


class Stapo(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        weights, metrics = stapo_weights(
            pre.advantages,
            pre.logprobs,
            pre.entropy,
            pre.mask,
            tau_p=self.config.stapo_tau_p,
            q=self.config.stapo_q,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
        )
        return Selection(weights, metrics=metrics, diagnosed={"weights": weights})
