"""What a method is given and what it returns: one signature from the pre-update pass to the loss.

A step (``Trainer.learn``) hands a method one :class:`Batch` per selection (the whole batch, or each
mini-batch with ``algorithm.selection=per_mini_batch``) and trains with the :class:`Selection` it
returns; between steps it asks for the entropy bonus's coefficient and reports the step's entropy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from stare_agent.algorithms.stare import entropy_gate

if TYPE_CHECKING:
    from torch import Tensor

    from stare_agent.config import AlgorithmConfig
    from stare_agent.options import Scope
    from stare_agent.train.diagnostics import PreUpdate

Gate = tuple[bool, float, dict[str, float]]
"""(gate_on, Hbar, metrics) of ``algorithms.stare.entropy_gate``."""


@dataclass(frozen=True)
class Batch:
    """One selection's rows on this rank after the pre-update pass (tensors [B, T], detached).

    Attributes:
        pre: The pre-update pass: advantages, log-probs, entropy, moments (when asked), mask.
        sequence_ids: Each row's global episode index (the selection's tie-break key).
        micro_batches: The learner's micro-batches of these rows under ``algorithm.scope=micro_batch``,
            else None (the global scope).
        W, M: STARE's weights this step (the adaptive schedule's when ``algorithm.adaptive``).
        gate: The gate of the pre-update pass for a method that reads it (``Method.gated``), else None.
        old_logprobs: The ratio's old policy on these rows when it is not ``pre``'s (a later
            mini-batch); None: ``pre.logprobs``.
        seed, step, key: The run's seed, the step and (epoch, mini-batch) of a re-selection, which a
            method's random draw is seeded with (the same draw on every rank).
    """

    pre: PreUpdate
    sequence_ids: Tensor
    micro_batches: list[list[int]] | None
    W: float
    M: float
    gate: Gate | None = None
    old_logprobs: Tensor | None = None
    seed: int = 0
    step: int = 0
    key: tuple[int, int] | None = None

    @property
    def scope(self) -> Scope:
        return "global" if self.micro_batches is None else "micro_batch"


@dataclass
class Selection:
    """What the loss takes from a method on a batch's rows; None everywhere is GRPO-ds.

    Attributes:
        weights: Token weights [B, T] multiplied into the loss (None: 1).
        kl_coef: KL-Cov's per-token coefficients of ``|logp - logp_old|`` (None: none).
        advantages: Token advantages to train with instead of the GRPO ones (EntroAdv's).
        L_plus: The tokens STARE amplifies this step (its weight-W tokens), for the learner's
            ``mismatch/L_plus_*`` and ``rollout_correction/weight_mean_L_plus``; None: none.
        metrics: The selection's metrics, logged with the step.
        diagnosed: What the diagnostics hooks read of it (``PreUpdate`` fields).
    """

    weights: Tensor | None = None
    kl_coef: Tensor | None = None
    advantages: Tensor | None = None
    L_plus: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    diagnosed: dict[str, Any] = field(default_factory=dict)

    def rows(self, cut: Callable[[Tensor], Tensor]) -> Selection:
        """The selection on some rows: ``cut`` applied to each tensor (metrics left out)."""
        tensors = ("weights", "kl_coef", "advantages", "L_plus")
        return dataclasses.replace(
            self,
            **{k: None if getattr(self, k) is None else cut(getattr(self, k)) for k in tensors},
            metrics={},
            diagnosed={},
        )


class Method:
    """An advantage or token-weighting method; the default is GRPO-ds (no selection, no bonus).

    Class attributes:
        pre_update: The method reads a pre-update pass of the batch (a selection); without one, GRPO-ds
            with one optimizer step per batch takes the gate's entropy from its update's forward pass.
        gated: Its selection reads the gate of the pre-update pass (STARE's closed loop).
        needs_moments: The pre-update pass also returns each position's moments (the first-order
            entropy effect).
    """

    pre_update: ClassVar[bool] = False
    gated: ClassVar[bool] = False
    needs_moments: ClassVar[bool] = False

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.config.name

    def gate(self, pre: PreUpdate, dropped_entropy: Callable[[], Tensor]) -> Gate:
        """The gate on the pre-update pass: ``Hbar < H_tgt`` over the kept tokens of all ranks.
        ``dropped_entropy()`` gives the entropies of this rank's share of the groups dynamic sampling
        dropped, for a gate that reads the whole draw."""
        return entropy_gate(pre.entropy, pre.mask, self.config.H_tgt)

    def select(self, batch: Batch) -> Selection:
        """The weights, coefficients or advantages of ``batch``'s rows (only when ``pre_update``)."""
        return Selection()

    def entropy_coef(self) -> float:
        """The loss's entropy-bonus coefficient beta this step (0: no bonus)."""
        return 0.0

    def after_update(self, Hbar: float) -> dict[str, float]:
        """Called once a step after its update with its entropy; returns metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps (a method that adapts across steps has some)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state."""
