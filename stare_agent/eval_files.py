"""The files of an evaluation's output directory, and the check that a resume continues the same evaluation."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stare_agent.errors import StareError
from stare_envs.engine import SamplingParams
from stare_envs.problems import Problem


class EvaluationError(StareError, ValueError):
    """An evaluation that cannot go on as asked (a resume of another evaluation's results)."""


RESULTS_FILE, SUMMARY_FILE, EPISODES_FILE = "results.jsonl", "summary.json", "episodes.jsonl"
RUN_FILE = "run.json"
"""Beside the summary: one record per call that wrote to the directory (a resumed one adds its own)."""


def append_run(out: Path, run: dict[str, Any], *, complete: bool) -> None:
    """Add ``run`` (what produced this call's part of the evaluation) to ``out``'s run record."""
    if not run:
        return
    path = out / RUN_FILE
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs.append({**run, "complete": complete})
    replace_file(path, json.dumps({"runs": runs}, indent=2, default=str) + "\n")


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file, then an atomic rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed (a full disk) leaves no half file


# Settings that must agree for a resumed evaluation to continue the same evaluation.
RESUME_KEYS = (
    ("data", "sha256"),
    ("samples",),
    ("sampling",),
    ("max_response_tokens",),
    ("env",),
    ("model",),
)


def check_resume(out: str | Path, settings: dict[str, Any]) -> None:
    """Refuse to resume the evaluation in ``out`` with ``settings`` that differ from its own in one of
    :data:`RESUME_KEYS` (a key ``settings`` leaves out is not compared: :func:`config_resume_settings`
    gives those a run config fixes, before any model loads).

    Raises:
        EvaluationError: nothing to resume there, or settings that differ (named).
    """
    out = Path(out)
    path = out / RESULTS_FILE
    if not path.is_file():
        raise EvaluationError(f"{path} not found: nothing to resume (drop --resume to start the evaluation)")
    summary_path = out / SUMMARY_FILE
    before = json.loads(summary_path.read_text()).get("settings", {}) if summary_path.is_file() else {}
    settings = json.loads(json.dumps(settings, default=plain_setting))
    differ = []
    for keys in RESUME_KEYS:
        old, new = dig(before, keys), dig(settings, keys)
        if old is not None and new is not None and old != new:
            differ.append(".".join(keys))
    if differ:
        raise EvaluationError(
            f"{out} holds an evaluation with other settings ({', '.join(differ)} differ, see its "
            f"{SUMMARY_FILE}): pass the same settings to resume it, or another --out to start anew"
        )


def config_resume_settings(config: Any, problems: list[Problem], model: dict[str, Any]) -> dict[str, Any]:
    """The settings of :data:`RESUME_KEYS` that :func:`evaluate_config` records for ``config``'s
    evaluation of ``problems`` by ``model`` (``provenance.model_settings``): what
    ``stare-agent eval --resume`` checks before it loads a model."""
    from stare_agent.provenance import problems_sha256

    data, env = config.data, config.env
    sampling = SamplingParams(
        temperature=data.eval_temperature, top_p=data.eval_top_p, seed=config.trainer.seed
    )
    return {
        "data": {"sha256": problems_sha256(problems)},
        "samples": data.eval_samples,
        "sampling": asdict(sampling),
        "max_response_tokens": env.max_response_tokens,
        "env": {"id": env.id, "kwargs": env.env_kwargs(evaluation=True)},
        "model": model,
    }


def dig(tree: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """``tree[k1][k2]...``, or None where a key is missing."""
    for key in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)  # type: ignore[assignment]
    return tree


def plain_setting(value: Any) -> Any:
    """Settings as JSON: dataclasses as dicts, anything else by its str."""
    from dataclasses import is_dataclass

    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)
