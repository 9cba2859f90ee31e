"""STARE (arXiv 2606.19236): W on L+, M on L- (C2), 1 elsewhere, while the batch entropy is below H_tgt.

    L+  = top ceil(P |T+|) of T+ by surprisal -log pi(o_t)     L- likewise of T- (C2 only)
    w_t = W on L+, M on L-, 1 elsewhere  if  Hbar < H_tgt,  else 1

(``algorithms.stare.stare_weights``, with the formulas; the gate is ``Method.gate``).
"""

from __future__ import annotations

from typing import Any, cast

from stare_agent.algorithms.stare import stare_weights
from stare_agent.methods.base import Batch, Method, Selection
from stare_agent.options import Variant


class Stare(Method):
    """STARE's weights on the pre-update pass, gated by it."""

    pre_update = True
    gated = True

    def select(self, batch: Batch, **options: Any) -> Selection:
        """STARE's weights; ``options`` go on to ``stare_weights`` (e.g. ``L_plus_filter``)."""
        assert batch.gate is not None  # gated
        gate_on, Hbar, _ = batch.gate
        pre, alg = batch.pre, self.config
        weights, L_plus, L_minus, metrics = stare_weights(
            pre.advantages,
            pre.logprobs,
            pre.mask,
            gate_on=gate_on,
            variant=cast("Variant", alg.variant),  # the config checked variant and scope
            P=alg.P,
            W=batch.W,
            M=batch.M,
            scope=batch.scope,
            micro_batches=batch.micro_batches,
            sequence_ids=batch.sequence_ids.to(pre.logprobs.device),
            Hbar=Hbar,
            **options,
        )
        diagnosed = {"weights": weights, "L_plus": L_plus, "L_minus": L_minus, "Hbar": Hbar}
        return Selection(weights, L_plus=weights > 1.0, metrics=metrics, diagnosed=diagnosed)
