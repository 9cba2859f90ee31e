"""RL checkpoints: ``run_dir/checkpoints/step-NNNNNN``, written atomically, the newest one resumed.

A checkpoint holds the learner (model, optimizer, scheduler: ``learner/``), the Hugging Face model and
tokenizer (``hf/``), the trainer's state (step, data position, W/M controller:
``trainer_state.json`` and the learner's client state) and every rank's RNG states
(``rng-rank{r}.pt``). It is written into a temporary directory and renamed into place, so a
directory named ``step-*`` is complete by construction.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from stare_agent.errors import StareError

if TYPE_CHECKING:
    from stare_agent.train.learner import Learner

CHECKPOINT_PREFIX = "step-"


def save_checkpoint(run_dir: Path, learner: Learner, state: dict[str, Any], *, keep: int) -> Path:
    """Write ``run_dir/checkpoints/step-N`` (N = ``state["step"]``) atomically: into a temporary
    directory, then rename; keep the newest ``keep``. Collective: every rank calls it."""
    root = run_dir / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{state['step']:06d}"
    tmp = root / f".tmp-{final.name}"
    if learner.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(learner)
    try:
        learner.save_checkpoint(tmp / "learner", client_state={"trainer": state})
        learner.export_hf(tmp / "hf")
        torch.save(_rng_state(), tmp / f"rng-rank{learner.rank}.pt")
    except BaseException:  # a full disk, a signal: no half checkpoint stays to fill the disk further
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(learner)
    if learner.rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        if final.exists():  # a resumed run redoing this step
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in all_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(learner)
    return final


def load_checkpoint(run_dir: Path, learner: Learner) -> dict[str, Any] | None:
    """Load the newest checkpoint of ``run_dir`` into ``learner`` and this rank's RNGs, drop the
    metrics of later steps, and return the trainer's state; None when there is none. A checkpoint
    that cannot be read (a damaged copy) is named and the one before it loaded.

    Raises:
        CheckpointError: there are checkpoints, and none can be read."""
    found = all_checkpoints(run_dir)[::-1]
    for n, last in enumerate(found):
        try:
            state = learner.load_checkpoint(last / "learner")["trainer"]
            _set_rng_state(torch.load(last / f"rng-rank{learner.rank}.pt", weights_only=False))
        except Exception as exc:  # noqa: BLE001 - a damaged copy of any kind: the one before it
            if learner.rank == 0:
                after = f"trying {found[n + 1].name}" if n + 1 < len(found) else "none is left"
                print(
                    f"checkpoint {last} could not be read ({type(exc).__name__}: "
                    f"{(str(exc).splitlines() or [''])[0][:200]}): {after}",
                    flush=True,
                )
            continue
        if learner.rank == 0:
            _truncate_metrics(run_dir / "metrics.jsonl", int(state["step"]))
            print(f"resumed from {last} (step {int(state['step'])})")
        return state
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoints in {run_dir}/checkpoints could be read (see above): start "
            "the run again with --overwrite instead of --resume"
        )
    if learner.rank == 0:
        # the steps logged before a crash that saved no checkpoint are trained again: log each once
        _truncate_metrics(run_dir / "metrics.jsonl", 0)
        print(f"no checkpoint in {run_dir}/checkpoints: starting from step 0")
    return None


class CheckpointError(StareError, RuntimeError):
    """No checkpoint of a run can be read; the message names the fix."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (renamed into place, so complete by construction), or None."""
    found = all_checkpoints(run_dir)
    return found[-1] if found else None


def all_checkpoints(run_dir: str | Path) -> list[Path]:
    """The checkpoints of ``run_dir``, oldest first."""
    return sorted((Path(run_dir) / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*"))


def _barrier(learner: Learner) -> None:
    if learner.world_size > 1:
        dist.barrier()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after ``step``: they belong to work the checkpoint does not hold."""
    if not path.is_file():
        return
    kept = [
        line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(line + "\n" for line in kept))


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (every device's), as ``transformers.set_seed``
    does, without importing ``transformers.trainer_utils`` (it imports peft: seconds for each process)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # CUDA's generators too


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
