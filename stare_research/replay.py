"""Frozen-rollout replay: train a learner variant on the batches a run saved.

    stare-agent replay --from RUN_DIR --out OUT [--model PATH] [--steps N] [algorithm.W=2.0 ...]

A run with ``trainer.save_rollouts=true`` writes every episode it drew at step N to
``RUN_DIR/rollouts/step_0000N.jsonl``, token-exactly: prompt and response ids, loss mask, the
engine's log-probs, turn spans, reward, group, global id, and whether dynamic sampling kept the
group (``trained``). A replay loads the run's config (``RUN_DIR/config.yaml``) with learner
overrides (``algorithm.*``, ``optim.*``, ``deepspeed.*``, ``model.*``, ``logger.*``, ``research.*``), starts from
the run's starting weights (``model.name_or_path``, or ``--model``) and trains on those batches,
step by step, through the trainer's own :meth:`~stare_agent.train.trainer.Trainer.learn`
(``stare_research.trainer.ResearchTrainer``, so the research variants replay too): advantages over
the kept groups, log-probs, the gate, STARE weights, rollout correction and the update. It plays no
episode, so learner ablations are paired (every variant trains on the same batches) and cost no
rollouts. What the run decided at rollout time stays as it was: which groups were drawn and kept,
the rewards, and the engine's log-probs (so a variant trains off-policy on the run's samples, which
``mismatch/*`` and ``algorithm.rollout_correction`` measure and correct as in a run).

Output, in ``OUT``: ``config.yaml`` (the replayed config), ``replay.json`` (the source run, the
overrides, the steps) and ``metrics.jsonl`` with a run's metric names (the rollout metrics
recomputed from the saved episodes, the draw's own counts, :data:`DRAW_METRICS`, copied from the
run's record; no ``eval/*`` but ``eval/bank_entropy`` on the run's bank where the run had
``research.entropy_bank``, at the run's evaluation steps and the last step; no rollout times). Deterministic: two replays of the same run and config
log identical metrics; a replay with the run's own config on the device and world size of the run
repeats the run's learner metrics.

Example:
    >>> from stare_research.replay import check_overrides
    >>> check_overrides(["algorithm.W=1.5", "optim.lr=1e-6"])
    >>> check_overrides(["data.samples_per_prompt=4"])
    Traceback (most recent call last):
    ...
    stare_research.replay.ReplayError: data.samples_per_prompt=4: a replay trains on the run's saved batches, so only learner settings can change (algorithm.*, optim.*, deepspeed.*, model.*, logger.*, research.*): make a new run with trainer.save_rollouts=true to change data.samples_per_prompt
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stare_agent.config import CONFIG_FILENAME
from stare_agent.errors import StareError
from stare_envs.trajectory import Trajectory
from stare_research.config import ResearchRunConfig, load_research_config

LEARNER_SECTIONS = ("algorithm", "optim", "deepspeed", "model", "logger", "research")
"""Config sections a replay may change: the rest decided how episodes were drawn, and they are frozen."""

SAVED_FIELDS = ("group", "trained", "global_id", "prompt_ids", "response_ids", "loss_mask", "logprobs")
"""What a replay reads from each saved episode (besides reward, turn spans and info)."""

DRAW_METRICS = ("ds/", "tools/", "failed_episodes", "dropped_groups")
"""Metrics (prefixes) of the draw itself, which the saved episodes cannot give (failed episodes are not
saved, nor how many batches dynamic sampling drew): copied from the run's record of the step."""

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


class ReplayError(StareError, ValueError):
    """A run that cannot be replayed (no saved rollouts, files of an older version, a gap) or a replay
    setting that would not change what it says. The message names the cause and the fix."""


class FrozenRollouts:
    """Stands where the trainer's rollout engine stands during a replay, so that none is started: the
    run's saved episodes are the rollouts, and nothing samples.

    Args:
        run_dir: The run whose episodes are replayed (named in the error of :meth:`generate`).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ReplayError(
            f"a replay of {self.run_dir} trains on its saved episodes and samples none: "
            "run `stare-agent train` to play new episodes"
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Nothing to hand the weights to: the saved episodes do not change with the policy."""


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse overrides outside :data:`LEARNER_SECTIONS` (a malformed one is left to ``load_config``).

    Raises:
        ReplayError: an override of a data, env, sandbox, trainer or sft field.
    """
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" in item and key.split(".")[0] not in LEARNER_SECTIONS:
            raise ReplayError(
                f"{item}: a replay trains on the run's saved batches, so only learner settings can change "
                f"({', '.join(s + '.*' for s in LEARNER_SECTIONS)}): make a new run with "
                f"trainer.save_rollouts=true to change {key}"
            )


def step_files(run_dir: str | Path, steps: int | None = None) -> list[tuple[int, Path]]:
    """The saved batches of a run, ``(step, path)`` from step 1 on, checked to be complete and of a
    version that saved everything the learner needs (:data:`SAVED_FIELDS`).

    Args:
        run_dir: A run directory (``trainer.run_dir``).
        steps: Only the first ``steps`` (default: every saved step).

    Raises:
        ReplayError: no run directory or config, no saved rollouts, a missing step, fewer steps than
            asked, or files that lack a field.
    """
    run_dir = Path(run_dir)
    if not (run_dir / CONFIG_FILENAME).is_file():
        raise ReplayError(
            f"{run_dir / CONFIG_FILENAME} not found: pass the trainer.run_dir of a run made with "
            "trainer.save_rollouts=true"
        )
    rollouts = run_dir / "rollouts"
    found = sorted(
        (int(m.group(1)), p)
        for p in (rollouts.iterdir() if rollouts.is_dir() else ())
        if (m := _STEP_FILE.fullmatch(p.name))
    )
    if not found:
        raise ReplayError(
            f"{run_dir} has no saved batches ({rollouts}/step_*.jsonl): the run was made without "
            "trainer.save_rollouts; rerun it with trainer.save_rollouts=true (configs/study.yaml sets it)"
        )
    numbers = [n for n, _ in found]
    if steps is not None and steps > len(found):
        raise ReplayError(
            f"--steps {steps}: {run_dir} saved {len(found)} steps: pass --steps {len(found)} or fewer"
        )
    found = found[: steps or len(found)]
    missing = sorted(set(range(1, found[-1][0] + 1)) - set(numbers))
    if missing:
        raise ReplayError(
            f"{rollouts}/step_{missing[0]:05d}.jsonl is missing: a replay trains every step from the start, "
            f"so pass --steps {missing[0] - 1} to replay the steps before it"
        )
    with open(found[0][1]) as f:
        first = next((json.loads(line) for line in f if line.strip()), None)
    absent = [k for k in SAVED_FIELDS if first is not None and k not in first]
    if absent:
        raise ReplayError(
            f"{found[0][1]} has no {', '.join(absent)} (saved by a version before `stare-agent replay`): "
            "rerun the run with this version and trainer.save_rollouts=true to replay it"
        )
    return found


def load_step(path: str | Path) -> tuple[list[Any], list[Any]]:
    """One saved step as the trainer's groups: ``(drawn, kept)``, both in draw order. A group number
    with no saved episode (every episode lost to the sandbox) is an empty group, as in the run."""
    from stare_agent.train.rollout_phase import Group

    by_group: dict[int, list[dict[str, Any]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_group[int(record["group"])].append(record)
    drawn = [
        Group(
            n,
            None,
            [float(r["reward"]) for r in by_group.get(n, [])],
            [Trajectory.from_dict(r) for r in by_group.get(n, [])],
            [int(r["global_id"]) for r in by_group.get(n, [])],
        )
        for n in range(max(by_group, default=-1) + 1)
    ]
    kept = [g for g in drawn if by_group.get(g.index) and by_group[g.index][0]["trained"]]
    return drawn, kept


def replay_config(
    run_dir: str | Path, out_dir: str | Path, overrides: Sequence[str] = (), *, model: str | None = None
) -> ResearchRunConfig:
    """The run's config with the replay's overrides, ``trainer.run_dir=out_dir`` and, for
    ``algorithm.rollout_correction.mode=auto``, the mode the run resolved (``token_tis`` when its
    metrics logged ``rollout_correction/*``, else ``none``), so that the saved config says it.

    Raises:
        ReplayError: an override outside :data:`LEARNER_SECTIONS`, ``out_dir`` that is the run's own
            directory or holds metrics already, or ``auto`` without the run's metrics to resolve it.
        ConfigError: a malformed or invalid override.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    check_overrides(overrides)
    if out_dir.resolve() == run_dir.resolve():
        raise ReplayError(f"--out {out_dir} is the run's own directory: pass a new directory for the replay")
    if (out_dir / "metrics.jsonl").exists():
        raise ReplayError(
            f"--out {out_dir} holds a metrics.jsonl already: pass a new directory for the replay"
        )
    items = [*overrides, f"trainer.run_dir={out_dir}", *([f"model.name_or_path={model}"] if model else [])]
    config = load_research_config(run_dir / CONFIG_FILENAME, items)
    if config.algorithm.rollout_correction.mode == "auto":
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            raise ReplayError(
                f"algorithm.rollout_correction.mode=auto: {metrics} is missing, so how the run resolved it is "
                "unknown: pass algorithm.rollout_correction.mode=none or token_tis"
            )
        corrected = any('"rollout_correction/' in line for line in metrics.read_text().splitlines())
        mode = "token_tis" if corrected else "none"
        config = load_research_config(
            run_dir / CONFIG_FILENAME, [*items, f"algorithm.rollout_correction.mode={mode}"]
        )
    return config


def replay(
    run_dir: str | Path,
    out_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    model: str | None = None,
    steps: int | None = None,
    policy: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Train on the saved batches of ``run_dir`` from the run's starting weights; log to ``out_dir``.

    Args:
        run_dir: A run made with ``trainer.save_rollouts=true``.
        out_dir: The replay's directory (``config.yaml``, ``replay.json``, ``metrics.jsonl``).
        overrides: Learner settings, e.g. ``["algorithm.W=2.0"]`` (see :func:`check_overrides`).
        model: Starting weights instead of the run's ``model.name_or_path``.
        steps: Replay only the first ``steps`` saved steps (the learning-rate schedule stays the run's).
        policy, tokenizer: An already loaded policy (e.g. the tiny test model), as ``Trainer`` takes.

    Returns:
        ``{"steps", "run_dir", "last"}`` like ``Trainer.fit``.
    """
    from stare_agent.metrics import StepLogger, rollout_metrics
    from stare_research.entropy_bank import BANK_METRIC
    from stare_research.trainer import ResearchTrainer

    check_overrides(overrides)
    files = step_files(run_dir, steps)
    logged = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in logged.read_text().splitlines()] if logged.is_file() else []
    drawn_metrics = {int(r["step"]): r for r in records}
    config = replay_config(run_dir, out_dir, overrides, model=model)
    trainer = ResearchTrainer(config, model=policy, tokenizer=tokenizer, engine=FrozenRollouts(run_dir))
    out = Path(config.trainer.run_dir)
    logger = None
    last: dict[str, Any] = {}
    try:
        if trainer.rank == 0:
            config.save(out)
            summary = {"source_run": str(run_dir), "overrides": list(overrides), "steps": len(files)}
            (out / "replay.json").write_text(
                json.dumps({**summary, "model": config.model.name_or_path}, indent=2)
            )
            logger = StepLogger(out, backends=config.logger.backends, job_type="replay", config=config)
        for step, path in files:
            t0 = time.perf_counter()
            trainer.step = step
            drawn, kept = load_step(path)
            episodes = [t for g in drawn for t in g.trajectories]
            last = rollout_metrics(episodes, trainer.model_texts(episodes))  # the run's rollout metrics
            last.update({k: v for k, v in drawn_metrics.get(step, {}).items() if k.startswith(DRAW_METRICS)})
            last.update(trainer.learn(drawn, kept))
            last["time/step_s"] = time.perf_counter() - t0
            every = config.trainer.eval_every
            if trainer.bank is not None and ((every and step % every == 0) or step == files[-1][0]):
                last[BANK_METRIC] = trainer.bank.entropy(trainer)  # the run's bank, at its evaluation steps
            if logger is not None:
                logger.log(step, last)
    finally:
        if logger is not None:
            logger.close()
        trainer.close()
    return {"steps": len(files), "run_dir": str(out), "last": last}
