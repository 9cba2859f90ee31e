"""The product's trainer with this project's variants and instruments, as ``config.research`` says.

Variants (not the paper's), each a small override of one step of ``Trainer``:

- ``research.gate_batch=drawn``: the gate reads every group drawn this step, kept or dropped
  (:meth:`ResearchTrainer._gate`; one more log-prob pass over this rank's share of the dropped ones);
- ``research.L_plus_rule=top_k_raising``: of the paper's L+, only the tokens whose reinforcement raises
  entropy at first order get W (:meth:`ResearchTrainer._stare_weights`, through ``stare_weights``'
  ``L_plus_filter``);
- ``research.L_minus_rule=random``: C2's placebo, M on a seeded random subset of T- of L-'s size in each
  selection block (:meth:`ResearchTrainer._stare_weights`, ``stare_research.placebo``);
- ``research.L_plus_rule=random``: L+'s placebo, W on a seeded random subset of T+ of L+'s size in each
  selection block (the same method and module).

Instruments, as diagnostics hooks: the mechanism metrics (``research.mechanism_metrics``) and the
held-out entropy bank (``research.entropy_bank``).
"""

from __future__ import annotations

from typing import Any

import torch

from stare_agent.algorithms import entropy_gate
from stare_agent.algorithms.selection import selection_blocks
from stare_agent.config import RunConfig
from stare_agent.train.batch import collate
from stare_agent.train.diagnostics import PreUpdate
from stare_agent.train.rollout_phase import Group
from stare_agent.train.trainer import Trainer
from stare_envs.trajectory import Trajectory
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
        super().__init__(config, diagnostics=hooks, **kwargs)

    @property
    def _with_moments(self) -> bool:
        return super()._with_moments or self.research.L_plus_rule == "top_k_raising"

    def _gate(
        self, drawn: list[Group], kept: list[Group], pre: PreUpdate
    ) -> tuple[bool, float, dict[str, float]]:
        """``research.gate_batch=drawn``: the gate on the whole draw, the kept tokens' entropies and
        those of this rank's share of the dropped groups (drawn group n on rank n mod world); the mean
        is global over ranks as in ``entropy_gate``. ``stare/entropy_kept`` logs the paper's Hbar."""
        gated = super()._gate(drawn, kept, pre)
        if self.research.gate_batch == "kept":
            return gated
        trained = {id(g) for g in kept}
        dropped: list[Trajectory] = [
            t
            for n, g in enumerate(drawn)
            if id(g) not in trained and n % self.world == self.rank
            for t in g.trajectories
        ]
        H = [pre.entropy[pre.mask.bool()]]
        if dropped:
            _, H_dropped = self.learner.compute_logprobs_and_entropy(dropped)
            dropped_mask = collate(dropped, self.learner.pad_id)["response_mask"].to(H_dropped.device)
            H.append(H_dropped[dropped_mask.bool()].to(pre.entropy.device))
        H_all = torch.cat(H)[None]
        gate_on, Hbar, metrics = entropy_gate(
            H_all, torch.ones_like(H_all, dtype=torch.bool), self.config.algorithm.H_tgt
        )
        return gate_on, Hbar, {**metrics, "stare/entropy_kept": gated[1]}

    def _stare_weights(
        self,
        pre: PreUpdate,
        gate_on: bool,
        Hbar: float,
        trajectories: list[Trajectory],
        sequence_ids: torch.Tensor,
        **options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """``research.L_plus_rule=top_k_raising``: L+ keeps only its first-order entropy raisers.
        ``research.L_minus_rule=random`` (``L_plus_rule=random``): M (W) moves from L- (L+) to the
        placebo's tokens, returned as L- (L+), and ``stare/L_minus_placebo_overlap``
        (``stare/L_plus_placebo_overlap``) logs the share of them that L- (L+) holds too."""
        if self.research.L_plus_rule == "top_k_raising":
            assert pre.moments is not None  # _with_moments
            options["L_plus_filter"] = raising_tokens(pre.logprobs, pre.entropy, pre.moments)
        weights, L_plus, L_minus, metrics = super()._stare_weights(
            pre, gate_on, Hbar, trajectories, sequence_ids, **options
        )
        placebos = (
            ("L_plus", L_plus, pre.advantages > 0, self.controller.W, self.research.L_plus_rule),
            ("L_minus", L_minus, pre.advantages < 0, self.controller.M, self.research.L_minus_rule),
        )
        chosen = {"L_plus": L_plus, "L_minus": L_minus}
        for name, selected, sign, weight, rule in placebos:
            if rule != "random":
                continue
            # the config allows a placebo only in the micro_batch scope: blocks are this rank's
            split = self.learner.micro_batches(trajectories)
            blocks = selection_blocks(selected.shape[0], "micro_batch", split, None, selected.device)
            seed = placebo_seed(self.config.trainer.seed, self.step)
            placebo = random_subset(selected, pre.mask.bool() & sign, blocks, seed)
            if gate_on:
                weights = weights.clone()
                weights[selected] = 1.0
                weights[placebo] = weight
            n = int(placebo.sum())
            metrics[f"stare/{name}_placebo_overlap"] = (
                int((placebo & selected).sum()) / n if n else float("nan")
            )
            chosen[name] = placebo
        return weights, chosen["L_plus"], chosen["L_minus"], metrics
