"""Forking tokens (Wang et al. 2025, arXiv 2506.01939, Eq. 4): the gradient only on high-entropy tokens.

    I_H = the top ceil(rho N) tokens by H_t;  w_t = 1 on I_H, 0 elsewhere

(``algorithms.entropy_control.forking_token_weights``).
"""

from stare_agent.algorithms.entropy_control import forking_token_weights
from stare_agent.methods.base import Batch, Method, Selection


class ForkingTokens(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        weights, metrics = forking_token_weights(
            pre.entropy,
            pre.mask,
            rho=self.config.forking_rho,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
            sequence_ids=batch.sequence_ids.to(pre.logprobs.device),
        )
        return Selection(weights, metrics=metrics, diagnosed={"weights": weights})
