"""The product's trainer with this project's variants and instruments, as ``config.research`` says.

Variants (not the paper's), each in :class:`ResearchMethod`, the method the trainer runs in place of the
registered one (``Trainer(..., method=...)``):

- ``research.gate_batch=drawn``: the gate reads every group drawn this step, kept or dropped
  (:meth:`ResearchMethod.gate`; one more log-prob pass over this rank's share of the dropped ones);
- ``research.L_plus_rule=top_k_raising``: of the paper's L+, only the tokens whose reinforcement raises
  entropy at first order get W (:meth:`ResearchMethod.select`, through ``stare_weights``'
  ``L_plus_filter``);
- ``research.L_minus_rule=random``: C2's placebo, M on a seeded random subset of T- of L-'s size in each
  selection block (``stare_research.placebo``);
- ``research.L_plus_rule=random``: L+'s placebo, W on a seeded random subset of T+ of L+'s size in each
  selection block (the same method and module).

Instruments, as diagnostics hooks: the mechanism metrics (``research.mechanism_metrics``) and the
held-out entropy bank (``research.entropy_bank``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stare_agent.algorithms import entropy_gate
from stare_agent.algorithms.selection import selection_blocks
from stare_agent.config import RunConfig
from stare_agent.methods import make_method
from stare_agent.methods.base import Batch, Gate, Method, Selection
from stare_agent.methods.stare import Stare
from stare_agent.train.diagnostics import PreUpdate
from stare_agent.train.trainer import Trainer
from stare_research.config import ResearchSection
from stare_research.diagnostics import EntropyBank, MechanismMetrics
from stare_research.entropy_effect import raising_tokens
from stare_research.placebo import placebo_seed, random_subset


class ResearchTrainer(Trainer):
    """``Trainer`` for a :class:`~stare_research.config.ResearchRunConfig` (a plain ``RunConfig`` runs
    with the research section's defaults). Takes ``Trainer``'s arguments; ``diagnostics`` are added to
    the section's own."""

    def __init__(self, config: RunConfig, **kwargs: Any) -> None:
        self.research: ResearchSection = getattr(config, "research", None) or ResearchSection()
        hooks = list(kwargs.pop("diagnostics", ()))
        if self.research.mechanism_metrics:
            hooks.append(MechanismMetrics())
        self.bank = EntropyBank(self.research.entropy_bank) if self.research.entropy_bank else None
        if self.bank is not None:
            hooks.append(self.bank)
        method = kwargs.pop("method", None) or make_method(config.algorithm)
        super().__init__(config, diagnostics=hooks, method=ResearchMethod(method, self.research), **kwargs)


class ResearchMethod(Method):
    """``inner`` (the method ``algorithm.name`` names) with the research section's variants."""

    def __init__(self, inner: Method, research: ResearchSection) -> None:
        super().__init__(inner.config)
        self.inner, self.research = inner, research
        self.pre_update = inner.pre_update  # type: ignore[misc]
        self.gated = inner.gated  # type: ignore[misc]
        self.needs_moments = inner.needs_moments or research.L_plus_rule == "top_k_raising"  # type: ignore[misc]

    def gate(self, pre: PreUpdate, dropped_entropy: Callable[[], torch.Tensor]) -> Gate:
        """``research.gate_batch=drawn``: the gate on the whole draw, the kept tokens' entropies and
        those of this rank's share of the dropped groups; the mean is global over ranks as in
        ``entropy_gate``. ``stare/entropy_kept`` logs the paper's Hbar."""
        gated = self.inner.gate(pre, dropped_entropy)
        if self.research.gate_batch == "kept":
            return gated
        H_all = torch.cat([pre.entropy[pre.mask.bool()], dropped_entropy().to(pre.entropy)])[None]
        gate_on, Hbar, metrics = entropy_gate(
            H_all, torch.ones_like(H_all, dtype=torch.bool), self.config.H_tgt
        )
        return gate_on, Hbar, {**metrics, "stare/entropy_kept": gated[1]}

    def select(self, batch: Batch) -> Selection:
        """STARE's weights with ``research.L_plus_rule=top_k_raising`` (L+ keeps only its first-order
        entropy raisers) and the placebos: with ``research.L_minus_rule=random``
        (``L_plus_rule=random``) M (W) moves from L- (L+) to the placebo's tokens, which the
        diagnostics read as L- (L+), and ``stare/L_minus_placebo_overlap``
        (``stare/L_plus_placebo_overlap``) logs the share of them that L- (L+) holds too."""
        if not isinstance(self.inner, Stare):
            return self.inner.select(batch)
        pre, options = batch.pre, {}
        if self.research.L_plus_rule == "top_k_raising":
            assert pre.moments is not None  # needs_moments
            options["L_plus_filter"] = raising_tokens(pre.logprobs, pre.entropy, pre.moments)
        selection = self.inner.select(batch, **options)
        assert batch.gate is not None and selection.weights is not None
        weights, chosen = selection.weights, dict(selection.diagnosed)
        placebos = (
            ("L_plus", pre.advantages > 0, batch.W, self.research.L_plus_rule),
            ("L_minus", pre.advantages < 0, batch.M, self.research.L_minus_rule),
        )
        for name, sign, weight, rule in placebos:
            if rule != "random":
                continue
            selected = chosen[name]
            # the config allows a placebo only in the micro_batch scope: blocks are this rank's
            blocks = selection_blocks(
                selected.shape[0], "micro_batch", batch.micro_batches, None, selected.device
            )
            placebo = random_subset(
                selected, pre.mask.bool() & sign, blocks, placebo_seed(batch.seed, batch.step)
            )
            if batch.gate[0]:
                weights = weights.clone()
                weights[selected] = 1.0
                weights[placebo] = weight
            n = int(placebo.sum())
            selection.metrics[f"stare/{name}_placebo_overlap"] = (
                int((placebo & selected).sum()) / n if n else float("nan")
            )
            chosen[name] = placebo
        chosen["weights"] = weights
        selection.weights, selection.L_plus, selection.diagnosed = weights, weights > 1.0, chosen
        return selection

    def entropy_coef(self) -> float:
        return self.inner.entropy_coef()

    def after_update(self, Hbar: float) -> dict[str, float]:
        return self.inner.after_update(Hbar)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
