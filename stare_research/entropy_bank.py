"""The held-out entropy bank: the policy's entropy on FIXED tokens, not on its own latest samples.

The ``entropy`` a step logs (and the STARE gate reads) is the mean entropy on the tokens that step
sampled: it moves with the policy and with what the policy chose to write (and, for the gate, with
which groups dynamic sampling kept). The bank holds that still: episodes sampled ONCE from a run's
starting policy on held-out problems (``data.eval`` / ``data.eval_limit`` x ``data.eval_samples``,
at the RL sampling temperature and top-p, ``env.temperature`` / ``env.top_p``, seeded by
``trainer.seed``), saved to ``research.entropy_bank``; at each held-out evaluation the current policy
is teacher-forced on them and ``eval/bank_entropy`` is logged: the mean full-vocabulary entropy over
the bank's model-written (mask-1) tokens, in float32 (no autocast), the quantity
``benchmarks/entropy_response.py`` calls ``H_bank`` and the STARE gate's H-bar on other tokens.

A run resumed from a checkpoint, and every run of a study (``stare-agent study`` samples the bank
from the shared SFT model), read the same file, so their bank entropies are comparable step by step.
The file is JSONL, one episode a line (``Trajectory.to_dict``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from stare_agent.errors import StareError
from stare_envs.trajectory import Trajectory

BANK_METRIC = "eval/bank_entropy"
"""The logged name of the bank's mean entropy under the current policy."""


class EntropyBankError(StareError, ValueError):
    """A bank file that cannot be used (missing after the run started, empty, malformed)."""


def bank_config(config: Any) -> Any:
    """The run config the bank is sampled with: the held-out problems and count of the config's
    evaluation, sampled as RL samples (``env.temperature``, ``env.top_p``), not as validation."""
    data = replace(config.data, eval_temperature=config.env.temperature, eval_top_p=config.env.top_p)
    return replace(config, data=data)


def sample_bank(
    config: Any, *, engine: Any, tokenizer: Any, pool: Any = None, batch_size: int | None = None
) -> list[Trajectory]:
    """Episodes of ``engine``'s policy on the held-out problems of ``config`` (:func:`bank_config`),
    those with at least one model-written token."""
    from stare_agent.evaluation import evaluate_config

    report = evaluate_config(
        bank_config(config),
        engine=engine,
        tokenizer=tokenizer,
        pool=pool,
        batch_size=batch_size or config.sandbox.pool_size,
        progress=False,
        keep_trajectories=True,
    )
    return bank_of(report.trajectories)


def bank_of(episodes: Sequence[Trajectory]) -> list[Trajectory]:
    """The episodes of a bank: those with at least one model-written token.

    Raises:
        EntropyBankError: none has one.
    """
    bank = [t for t in episodes if any(t.loss_mask)]
    if not bank:
        raise EntropyBankError(
            "the entropy bank's episodes hold no model-written token: check data.eval and env.max_response_tokens"
        )
    return bank


def write_bank(path: str | Path, bank: Sequence[Trajectory]) -> None:
    """Write ``bank`` to ``path`` (JSONL) atomically: a killed run leaves no half-written bank."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for t in bank:
            f.write(json.dumps(t.to_dict(), default=str) + "\n")
    os.replace(tmp, path)


def read_bank(path: str | Path) -> list[Trajectory]:
    """The bank in ``path``.

    Raises:
        EntropyBankError: the file is missing or holds no episode.
    """
    path = Path(path)
    if not path.is_file():
        raise EntropyBankError(f"research.entropy_bank={path}: no such file")
    bank = [Trajectory.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    if not bank:
        raise EntropyBankError(
            f"research.entropy_bank={path} holds no episode: delete it so that a fresh run samples it again"
        )
    return bank


def bank_entropy(model: Any, bank: Sequence[Trajectory], pad_id: int) -> float:
    """Mean full-vocabulary entropy of ``model`` over the bank's model-written tokens, teacher-forced,
    in the model's own precision (float32 for the trainer's bf16-autocast learner: no autocast here)."""
    import torch

    from stare_agent.metrics import policy_entropy

    device = next(model.parameters()).device.type
    with torch.autocast(device, enabled=False):
        return policy_entropy(model, bank, pad_id)


__all__ = [
    "BANK_METRIC",
    "EntropyBankError",
    "bank_config",
    "bank_of",
    "bank_entropy",
    "read_bank",
    "sample_bank",
    "write_bank",
]
