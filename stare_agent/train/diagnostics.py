"""The one hook through which instruments above the product read a training run.

The trainer calls every hook of ``Trainer(config, diagnostics=[...])`` at three fixed points and logs
what each returns; a hook reads, it changes nothing a step computes. The research floor's held-out
entropy bank and first-order mechanism metrics (``stare_research.diagnostics``) are such hooks; so
can a user's own probe be::

    class LogitMass(Diagnostics):
        def on_pre_update(self, batch):
            return {"probe/L_plus_share": float(batch.L_plus.sum() / batch.mask.sum())}

Nothing here imports torch at module level, so a hook can be defined where torch is optional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class PreUpdate:
    """One step's batch on this rank after the pre-update pass and the token weights (steps 5-7),
    before the update: what an instrument of the update reads. Tensors are [B, T] over this rank's
    rows (column t scores response token t+1), detached.

    Attributes:
        step: The step being trained.
        algorithm: ``algorithm.name``, a method with a pre-update pass (``Method.pre_update``: STARE and
            the other selections; GRPO-ds and the entropy bonuses have none).
        advantages: Token advantages A_t (0 on mask-0 entries); EntroAdv's shaped ones for ``entroadv``.
        logprobs: Pre-update log pi(o_t).
        entropy: Full-vocabulary entropy H_t.
        moments: ``(sum_j p_j^2, sum_j p_j^2 log p_j)`` [B, T, 2] when a hook asked for them
            (``needs_moments``), else None.
        mask: 1 = model-generated token.
        weights: The token weights of the update (STARE's, Clip-Cov's, forking tokens', STEER's,
            STAPO's or the first-order ones); None for KL-Cov and EntroAdv (weights 1).
        L_plus, L_minus: STARE's selections (also when its gate is off); None for the others.
        Hbar: The gate's batch entropy (STARE), else None.
        process_group: The data-parallel group to reduce a batch-wide metric over (None: one process
            or the world; reduce only when ``torch.distributed`` is initialized).
    """

    step: int
    algorithm: str
    advantages: Tensor
    logprobs: Tensor
    entropy: Tensor
    moments: Tensor | None
    mask: Tensor
    weights: Tensor | None
    L_plus: Tensor | None
    L_minus: Tensor | None
    Hbar: float | None
    process_group: Any = None


class Diagnostics:
    """A hook's three calls; each default does nothing. Every rank calls every hook (a hook whose
    metric reduces over ranks must reduce on all of them); the trainer logs rank 0's metrics.

    Attributes:
        needs_moments: The pre-update pass also returns the moments of each position (two more
            reductions over the vocabulary, no second forward); off unless a hook asks.
    """

    needs_moments: bool = False

    def on_fit_start(self, trainer: Any) -> None:
        """Once, after a resumed run restored its checkpoint and before the first step."""

    def on_pre_update(self, batch: PreUpdate) -> dict[str, float]:
        """Every step with a pre-update pass, between the weights and the update: metrics to log."""
        return {}

    def on_evaluation(self, trainer: Any) -> dict[str, float]:
        """After each held-out evaluation (``trainer.eval_every``): metrics to log with it."""
        return {}
