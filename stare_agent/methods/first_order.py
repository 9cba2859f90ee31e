"""First-order weighting (ours, after OPEFO arXiv 2605.11491): the entropy-raising flow balanced, gated.

    e_t = -A_t c_t;  lam = min(max((F- - F+) / (F- + F+), 0), lambda_max) while Hbar < H_tgt
    w_t = 1 + lam where e_t > 0,  1 - lam where e_t < 0

(``algorithms.token_weighting.first_order_weights``; c_t from the pre-update pass's moments).
"""

from stare_agent.algorithms.token_weighting import first_order_weights
from stare_agent.methods.base import Batch, Method, Selection


class FirstOrder(Method):
    pre_update = True
    gated = True
    needs_moments = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        assert batch.gate is not None and pre.moments is not None  # gated, needs_moments
        weights, metrics = first_order_weights(
            pre.advantages,
            pre.logprobs,
            pre.entropy,
            pre.moments,
            pre.mask,
            gate_on=batch.gate[0],
            lambda_max=self.config.first_order_lambda_max,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
        )
        return Selection(weights, metrics=metrics, diagnosed={"weights": weights})
