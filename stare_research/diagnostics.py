"""The research floor's instruments on a training run, as the product's diagnostics hooks
(``stare_agent.train.diagnostics``): they read a step, they change nothing it computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stare_agent.train.diagnostics import Diagnostics, PreUpdate
from stare_envs.trajectory import Trajectory
from stare_research.entropy_bank import (
    BANK_METRIC,
    EntropyBankError,
    bank_config,
    bank_entropy,
    bank_of,
    read_bank,
    write_bank,
)
from stare_research.entropy_effect import first_order_response, mechanism_metrics


class MechanismMetrics(Diagnostics):
    """What each update does to entropy to first order (``entropy_effect``): STARE's
    :func:`~stare_research.entropy_effect.mechanism_metrics` (``stare/L_plus_raising``, ...), and
    ``entropy_control/dH_first_order`` for KL-Cov, Clip-Cov and forking tokens, over the whole batch
    on all ranks."""

    needs_moments = True

    def on_pre_update(self, batch: PreUpdate) -> dict[str, float]:
        assert batch.moments is not None  # needs_moments
        if batch.algorithm == "stare":
            assert batch.weights is not None and batch.L_plus is not None and batch.L_minus is not None
            return mechanism_metrics(
                batch.advantages,
                batch.weights,
                batch.L_plus,
                batch.L_minus,
                batch.mask,
                batch.logprobs,
                batch.entropy,
                batch.moments,
                process_group=batch.process_group,
            )
        dH = first_order_response(
            batch.advantages,
            batch.weights,
            batch.mask,
            batch.logprobs,
            batch.entropy,
            batch.moments,
            process_group=batch.process_group,
        )
        return {"entropy_control/dH_first_order": dH}


class EntropyBank(Diagnostics):
    """The held-out entropy bank of ``research.entropy_bank`` (``stare_research.entropy_bank``): read at
    the start of the run, or sampled from the starting policy and written when a fresh run finds no
    file; each evaluation logs the policy's mean entropy on it (``eval/bank_entropy``).

    Args:
        path: The bank's JSONL file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.episodes: list[Trajectory] = []

    def on_fit_start(self, trainer: Any) -> None:
        self.load(trainer)

    def load(self, trainer: Any) -> list[Trajectory]:
        """The bank's episodes: read, or sampled now by a run that has not trained yet.

        Raises:
            EntropyBankError: the file is missing after the run trained (a bank sampled now would not be
                the starting policy's), or it is empty.
        """
        if self.episodes:
            return self.episodes
        if self.path.is_file():
            self.episodes = read_bank(self.path)
        elif trainer.step == 0 and trainer.policy_version == 0:
            report = trainer.evaluate(config=bank_config(trainer.config), keep_trajectories=True)
            self.episodes = bank_of(report.trajectories)
            if trainer.rank == 0:
                write_bank(self.path, self.episodes)
        else:
            raise EntropyBankError(
                f"research.entropy_bank={self.path}: no such file, and this run has trained {trainer.step} steps, "
                "so a bank sampled now would not be its starting policy's: restore the file, or set "
                "research.entropy_bank='' (or a new path, whose bank then comes from the current policy in a fresh run)"
            )
        return self.episodes

    def entropy(self, trainer: Any) -> float:
        """The current policy's teacher-forced mean entropy on the bank."""
        return bank_entropy(trainer.learner.module, self.load(trainer), trainer.tokenizer.pad_token_id or 0)

    def on_evaluation(self, trainer: Any) -> dict[str, float]:
        return {BANK_METRIC: self.entropy(trainer)}
