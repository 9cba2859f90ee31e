"""KL-Cov (Cui et al. 2025, arXiv 2505.22617, Eq. 13): a |log ratio| penalty on the top-covariance tokens.

    cov_t = (logp_t - mean logp)(A_t - mean A);  l_t += beta |logp_t - logp_old_t|  on the top k of cov_t

(``algorithms.entropy_control.kl_cov_coefficients``; 0 with one on-policy optimizer step per batch).
"""

from stare_agent.algorithms.entropy_control import kl_cov_coefficients
from stare_agent.methods.base import Batch, Method, Selection


class KLCov(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        kl_coef, metrics = kl_cov_coefficients(
            pre.advantages,
            pre.logprobs,
            pre.mask,
            k=self.config.kl_cov_k,
            coef=self.config.kl_cov_coef,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
            sequence_ids=batch.sequence_ids.to(pre.logprobs.device),
        )
        return Selection(kl_coef=kl_coef, metrics=metrics)
