"""EntroAdv (Cheng et al. 2025, arXiv 2506.14758, Eq. 5-6): an entropy term added to the advantage.

    A_t <- A_t + min(alpha H_t, |A_t| / kappa)        H_t detached

(``algorithms.token_weighting.entroadv_advantages``).
"""

from stare_agent.algorithms.token_weighting import entroadv_advantages
from stare_agent.methods.base import Batch, Method, Selection


class EntroAdv(Method):
    pre_update = True

    def select(self, batch: Batch) -> Selection:
        pre = batch.pre
        shaped, metrics = entroadv_advantages(
            pre.advantages,
            pre.entropy,
            pre.mask,
            alpha=self.config.entroadv_alpha,
            kappa=self.config.entroadv_kappa,
        )
        return Selection(advantages=shaped, metrics=metrics, diagnosed={"advantages": shaped})
