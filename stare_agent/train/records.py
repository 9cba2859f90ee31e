"""What a training run writes of its episodes besides its metrics: ``rollouts/<name>.jsonl`` and
``run.json`` (rank 0 only; the callers check)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stare_envs.trajectory import Trajectory


def model_texts(tokenizer: Any, trajectories: list[Trajectory]) -> list[str]:
    """The model-written text of each episode (its mask-1 tokens)."""
    texts = []
    for t in trajectories:
        ids = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def save_rollouts(
    run_dir: Path,
    tokenizer: Any,
    name: str,
    trajectories: list[Trajectory],
    fields: list[dict[str, Any]] | None = None,
) -> None:
    """``run_dir/rollouts/<name>.jsonl``, one episode per line, each with its ``fields`` (see
    ``TrainerConfig.save_rollouts``) and everything ``stare-agent replay`` needs to train on it
    token-exactly."""
    out = run_dir / "rollouts"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.jsonl", "w") as f:
        for n, t in enumerate(trajectories):
            record = {
                **(fields[n] if fields else {}),
                "problem_id": t.info.get("problem_id"),
                "reward": t.reward,
                "response": tokenizer.decode(t.response_ids),
                "response_ids": t.response_ids,
                "info": t.info,
                "prompt_ids": t.prompt_ids,
                "loss_mask": t.loss_mask,
                "logprobs": t.logprobs,
                "turn_spans": t.turn_spans,
                "turn_versions": t.turn_versions,
                "version_switches": t.version_switches,
            }
            f.write(json.dumps(record, default=str) + "\n")


def save_run_record(run_dir: Path, *, pool: Any, engine: Any, step: int) -> None:
    """``run_dir/run.json``: this fit's command, start, versions and commit, the sandbox backend its
    pool resolved (``auto`` never means ``local``: a local one was named; None: the env's tools run no
    code) and its engine; one record per fit, a resumed run's appended (``runs``)."""
    from stare_agent.provenance import engine_settings, run_record

    path = run_dir / "run.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs.append(
        run_record(
            sandbox_backend=pool.backend if pool is not None else None,
            engine=engine_settings(engine),
            resumed_at_step=step,
        )
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"runs": runs}, indent=2, default=str))
    tmp.replace(path)
