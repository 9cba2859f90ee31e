"""Cold-start SFT: train only the model-written tokens of tool-use traces, then export the model.

``sft(config)`` reads the traces named by ``config.sft.data`` (see ``stare_agent.train.sft_data``),
tokenizes them exactly as the RL environment would play them (prompt rendered like the env's,
interpreter output and template glue mask 0), and runs ``sft.epochs`` passes of masked NLL with the
DeepSpeed learner, one optimizer step per ``sft.batch_size`` traces (split across ranks, then into
micro-batches by ``deepspeed.micro_batch_tokens``). It writes, under ``trainer.run_dir``:
``sft_config.yaml`` (an RL run in the same directory writes ``config.yaml``), ``sft_log.jsonl`` (one
line per step) and the fine-tuned model in Hugging Face format (``sft.output_dir``, default
``<run_dir>/sft_model``), ready for ``model.name_or_path`` of RL.

Example:
    >>> from stare_agent.config import load_config
    >>> summary = sft(load_config("configs/quickstart.yaml"))  # doctest: +SKIP
    >>> summary["output_dir"]  # doctest: +SKIP
    'runs/quickstart/sft_model'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from stare_agent import perf, run_dirs
from stare_agent.config import RunConfig
from stare_agent.metrics import StepLogger
from stare_agent.train.deepspeed_setup import load_training_policy
from stare_agent.train.learner import Learner
from stare_agent.train.sft_data import (
    SFTDataError,
    Trace,
    env_trace,
    procedural_traces,
    read_traces,
    trace_to_trajectory,
)
from stare_envs.problems import generate_problems, procedural_family
from stare_envs.registry import check_env_id
from stare_envs.trajectory import Trajectory

LOG_FILENAME = "sft_log.jsonl"
SFT_CONFIG_FILENAME = "sft_config.yaml"


def load_sft_traces(config: RunConfig) -> tuple[list[Trace], dict[str, int]]:
    """The traces of ``config.sft.data``: a file, a hub dataset, or ``procedural:<family>`` (run in the sandbox).

    Returns:
        (traces, counts) where counts has ``rejected`` (procedural traces whose real output missed the gold).
    """
    sft = config.sft
    check_env_id(config.env.id)  # module:id imports the module that registers the env, and its families
    family = procedural_family(sft.data)
    if family is None:
        return read_traces(sft.data, format=sft.format, limit=sft.limit), {"rejected": 0}
    from stare_sandbox import make_sandbox

    n = sft.procedural_rows if sft.limit is None else min(sft.procedural_rows, sft.limit)
    box = config.sandbox
    problems = generate_problems(family, n, seed=config.trainer.seed, difficulty=config.data.difficulty)
    if problems and "solution_calls" in problems[0].meta:  # a family of another tool's: played in the env
        from stare_agent.resources import make_env

        with make_env(config.env, sandbox_backend=box.backend, sandbox_config=box.limits) as env:
            traces = [t for p in problems if (t := env_trace(env, p)) is not None]
        if not traces:
            raise SFTDataError(
                f"none of {n} {family!r} solutions played in {config.env.id} was scored correct: check the "
                "family's solution calls against the env's tools and answer checker"
            )
        return traces, {"rejected": n - len(traces)}
    with make_sandbox(box.backend, box.limits) as sandbox:  # type: ignore[arg-type]
        traces, rejected = procedural_traces(
            family, n, sandbox, seed=config.trainer.seed, difficulty=config.data.difficulty
        )
    if not traces:
        raise SFTDataError(
            f"none of {n} procedural {family!r} traces reproduced the gold answer in the sandbox: "
            "run `stare-agent sandbox doctor` and check the limits (sandbox.limits.timeout_s)"
        )
    return traces, {"rejected": rejected}


def tokenize_traces(traces: list[Trace], tokenizer: Any, config: RunConfig) -> tuple[list[Trajectory], int]:
    """Trajectories of the traces, dropping those over ``sft.max_tokens``. Returns (kept, dropped)."""
    kept: list[Trajectory] = []
    for trace in traces:
        t = trace_to_trajectory(
            trace,
            tokenizer,
            system_prompt=config.env.system_prompt,
            prompt_template=config.env.prompt_template or "{problem}",
        )
        if t.num_tokens <= config.sft.max_tokens:
            kept.append(t)
    return kept, len(traces) - len(kept)


def sft(
    config: RunConfig, *, model: Any = None, tokenizer: Any = None, overwrite: bool = False
) -> dict[str, Any]:
    """Run cold-start SFT and export the model; returns a run summary (also logged as the last JSONL line).

    Args:
        config: The run config (sections ``sft``, ``model``, ``deepspeed``, ``optim``, ``sandbox``,
            ``env`` for the prompt, ``trainer`` for ``run_dir`` and ``seed``).
        model, tokenizer: An already loaded policy (default: ``config.model.name_or_path``).
        overwrite: Delete an earlier SFT's log and model in ``trainer.run_dir`` / ``sft.output_dir``
            first; without it such a directory is refused (``stare_agent.run_dirs``), as is one another
            process writes.

    Raises:
        SFTDataError: missing or malformed data, or no trace fits ``sft.max_tokens``.
        stare_agent.run_dirs.RunDirError: the run directory or output directory is taken or not writable.
        stare_agent.models.ModelTooLargeError: the model does not fit in memory.
    """
    run_dir = Path(config.trainer.run_dir)
    output_dir = Path(config.sft.output_dir) if config.sft.output_dir else run_dir / "sft_model"
    with contextlib.ExitStack() as claim:
        if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the run directory
            claim.enter_context(run_dirs.locked(run_dir, "trainer.run_dir"))
            run_dirs.check_sft(run_dir, output_dir, overwrite=overwrite)
            run_dirs.writable_dir(output_dir, "sft.output_dir")
        return _sft(config, run_dir, output_dir, model, tokenizer)


def _sft(config: RunConfig, run_dir: Path, output_dir: Path, model: Any, tokenizer: Any) -> dict[str, Any]:
    start = time.perf_counter()
    sft_cfg = config.sft
    traces, counts = load_sft_traces(config)  # a missing file fails before the model loads
    if model is None or tokenizer is None:
        model, tokenizer = load_training_policy(config)  # partitioned at load under ZeRO-3
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    trajectories, dropped = tokenize_traces(traces, tokenizer, config)
    if not trajectories:
        raise SFTDataError(
            f"all {len(traces)} traces are longer than sft.max_tokens={sft_cfg.max_tokens}: raise sft.max_tokens"
        )
    steps_per_epoch = max(len(trajectories) // sft_cfg.batch_size, 1)
    total_steps = steps_per_epoch * sft_cfg.epochs
    optim = dataclasses.replace(
        config.optim,
        lr=sft_cfg.lr,
        warmup_steps=int(sft_cfg.warmup_ratio * total_steps),
        schedule=sft_cfg.schedule,
    )
    learner = Learner(
        model, tokenizer, config.deepspeed, optim, total_steps=total_steps, lora=config.model.lora
    )
    rank, world = learner.rank, learner.world_size
    if sft_cfg.batch_size < world:
        raise SFTDataError(f"sft.batch_size={sft_cfg.batch_size} is smaller than the {world} ranks: raise it")
    if rank == 0:
        config.save(run_dir, SFT_CONFIG_FILENAME)
    rng = random.Random(config.trainer.seed)
    # perf/tokens_per_s and perf/mfu per step: 6N per token of the batch (prompt included) plus
    # attention, over the step's seconds, against the matmul bound in the learner's precision
    peak = perf.peak_flops(perf.precision_dtype(learner.precision), str(learner.device)) if rank == 0 else 0.0
    losses: list[float] = []
    skipped = step = 0
    bar = tqdm(total=total_steps, desc="SFT steps", unit="step", disable=rank != 0)
    log = (
        StepLogger(
            run_dir, filename=LOG_FILENAME, backends=config.logger.backends, job_type="sft", config=config
        )
        if rank == 0
        else None
    )
    try:
        for epoch in range(sft_cfg.epochs):
            order = list(range(len(trajectories)))
            rng.shuffle(order)
            for b in range(steps_per_epoch):
                batch = order[b * sft_cfg.batch_size : (b + 1) * sft_cfg.batch_size]
                mine = [trajectories[i] for i in batch[rank::world]]
                t_step = time.perf_counter()
                metrics = learner.sft_step(mine)
                step_s = time.perf_counter() - t_step
                step += 1
                skipped += int(metrics["skipped"])
                if not metrics["skipped"]:
                    losses.append(metrics["loss"])
                if log is not None:
                    log.log(
                        step,
                        {
                            "epoch": epoch,
                            **{k: metrics[k] for k in ("loss", "grad_norm", "lr", "skipped", "tokens")},
                            **perf.learner_perf(
                                learner.module.config,
                                [trajectories[i].num_tokens for i in batch],
                                step_s,
                                peak,
                                world=world,
                            ),
                        },
                    )
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        # whole or not at all (a full disk, a signal): a cut model would load as a damaged one later
        partial = output_dir.with_name(f".{output_dir.name}.partial")
        try:
            learner.export_hf(partial)
        except BaseException:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
        if rank == 0:
            shutil.rmtree(output_dir, ignore_errors=True)  # the empty folder claimed before training
            os.replace(partial, output_dir)
        summary = {
            "traces": len(traces),
            "trained_traces": len(trajectories),
            "dropped_too_long": dropped,
            "rejected_procedural": counts["rejected"],
            "steps": step,
            "skipped_steps": skipped,
            "first_loss": losses[0] if losses else float("nan"),
            "last_loss": losses[-1] if losses else float("nan"),
            "output_dir": str(output_dir),
            "seconds": time.perf_counter() - start,
        }
        if log is not None:
            log.log(step, {"summary": summary})
    finally:
        bar.close()
        if log is not None:
            log.close()
    return summary
