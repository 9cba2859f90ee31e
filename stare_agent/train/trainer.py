"""The STARE / GRPO-ds RL loop: ``Trainer(config).fit()`` and ``stare-agent train``.

One step, in the paper's order (docs/algorithm.md, "One training step, in the paper's order"):

    1. rollout      G episodes per prompt, multi-turn and token-exact (stare_envs.rollout)
    2. reward       binary accuracy of the final answer (scored by the environment)
    3. dynamic      drop groups whose G rewards are all equal; draw more prompt batches (capped)
       sampling     until ``data.prompts_per_step`` groups remain; truncate to exactly that
    4. advantages   A_i = (r_i - mean_group) / (std_group + 1e-6), broadcast to mask-1 tokens
    5. log-probs    pre-update log pi(o_t) and full-vocabulary entropy H_t of every response token
                    (STARE and the other selectors; GRPO-ds with one step per batch takes Hbar from
                    its update's own forward pass)
    6. gate         gate_on = Hbar < H_tgt, Hbar the masked token mean over the batch on all ranks
    7. weights      STARE: W on L+, M on L- (C2), 1 elsewhere; GRPO-ds: none
    8. update       one optimizer step of the dual-clip surrogate x weights, token-mean (the paper's;
                    ``algorithm.ppo_mini_batch_size`` / ``ppo_epochs``: one per mini-batch and epoch)
    9. sync         hand the new weights to the rollout engine

With ``trainer.max_staleness = k > 0`` steps 1-3 of later steps run on a producer thread while
steps 4-9 of this one run here (``train.async_rollouts``): every model token is labelled with the
policy version that sampled it and is at most k updates stale when trained.

Steps 1-3 are ``train.rollout_phase`` (what a step draws, plays and keeps), step 9 and the engine the
rollouts sample with are ``train.rollout_engine``; steps 4-8 read here, in the paper's order.

Distributed (torchrun / the deepspeed launcher, gloo on CPU, NCCL on GPU): every rank draws the
same prompt batch and plays the groups it owns (group g on rank g mod world); rewards and
trajectories are exchanged so that dynamic sampling, advantages and the kept groups agree on all
ranks; kept groups are dealt to ranks round-robin; the gate and STARE's global scope reduce over
all ranks inside the algorithm functions.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from stare_agent import perf, run_dirs
from stare_agent.algorithms import (
    AdaptiveController,
    AdaptiveEntropyCoefficient,
    broadcast_to_tokens,
    clip_cov_weights,
    entroadv_advantages,
    entropy_gate,
    first_order_weights,
    forking_token_weights,
    gate,
    grpo_advantages,
    kl_cov_coefficients,
    stapo_weights,
    stare_weights,
    steer_weights,
)
from stare_agent.config import SELECTING_ALGORITHMS, RunConfig
from stare_agent.metrics import StepLogger, ToolHealth, ToolHealthAlarm, rollout_metrics
from stare_agent.resources import eval_source
from stare_agent.train import checkpoints
from stare_agent.train.async_rollouts import RolloutProducer
from stare_agent.train.batch import collate
from stare_agent.train.deepspeed_setup import load_training_policy
from stare_agent.train.diagnostics import Diagnostics, PreUpdate
from stare_agent.train.learner import SUMMED_METRICS, Learner
from stare_agent.train.rollout_engine import RolloutEngine
from stare_agent.train.rollout_phase import Group, RolloutPhase, Rollouts, problem_stream
from stare_envs.registry import check_env_id
from stare_envs.trajectory import Trajectory

if TYPE_CHECKING:
    from stare_agent.options import Scope, Variant

__all__ = ["Group", "Rollouts", "Trainer"]


class Trainer:
    """RL training of a tool-using policy with GRPO-ds or STARE.

    Args:
        config: The run's config (``stare_agent.config.load_config``).
        model, tokenizer: An already loaded policy (default: ``config.model.name_or_path``).
        resume: Continue from the last complete checkpoint in ``config.trainer.run_dir``.
        overwrite: Delete the run ``config.trainer.run_dir`` holds (its config, metrics, run record,
            checkpoints, rollouts, plots) first; without it (or ``resume``) such a directory is refused
            (``stare_agent.run_dirs``), as is one another process trains in.
        engine: A rollout engine to use instead of the one ``env.engine`` names (e.g. a scripted
            engine in tests); it receives the new weights after every update.
        diagnostics: Hooks that read the run (``stare_agent.train.diagnostics``): their metrics are
            logged with each step and each evaluation.
        pool: A sandbox pool the episodes lease from (``stare_agent.resources.open_sandboxes``), owned
            and closed by the caller, e.g. one shared with evaluations around the run; default: the
            trainer opens its own on first use and closes it.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        model: Any = None,
        tokenizer: Any = None,
        resume: bool = False,
        overwrite: bool = False,
        engine: Any = None,
        diagnostics: Sequence[Diagnostics] = (),
        pool: Any = None,
    ) -> None:
        # Held until close(): one live process per run directory (rank 0's; the others write nothing
        # of their own there), checked before anything loads.
        self._claim = contextlib.ExitStack()
        self.run_dir = Path(config.trainer.run_dir)
        if int(os.environ.get("RANK", "0")) == 0:
            self._claim.enter_context(run_dirs.locked(self.run_dir, "trainer.run_dir"))
        try:
            run_dirs.check_training(
                self.run_dir, resume=resume, overwrite=overwrite, steps=config.trainer.steps
            )
            self._build(config, model, tokenizer, resume, engine, diagnostics, pool)
        except BaseException:
            self._claim.close()
            raise

    def _build(
        self,
        config: RunConfig,
        model: Any,
        tokenizer: Any,
        resume: bool,
        engine: Any,
        diagnostics: Sequence[Diagnostics],
        pool: Any,
    ) -> None:
        self.config = config
        self.diagnostics = list(diagnostics)
        if config.env.top_p < 1:
            warnings.warn(
                f"env.top_p={config.env.top_p}: rollouts sample from the nucleus-truncated distribution "
                "while the loss scores them under the full one, as if on-policy (the ratio is off by the "
                "truncation): use env.top_p=1.0 for RL (the paper's setting)",
                stacklevel=2,
            )
        self.resume = resume
        check_env_id(config.env.id)  # before the model loads, as the problems, run dir and engine are
        if engine is None and config.env.engine == "vllm":
            from stare_agent.engines.vllm_engine import resolve_vllm_python

            resolve_vllm_python(config.env.vllm.python)
        stream = problem_stream(config)  # a bad problem source fails here, before the model loads
        self._eval_source = eval_source(config)
        if model is None or tokenizer is None:
            model, tokenizer = load_training_policy(config)  # partitioned at load under ZeRO-3
        if config.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        checkpoints.seed_all(config.trainer.seed)  # python, numpy, torch (every device)
        self.tokenizer = tokenizer
        self.max_staleness = config.trainer.max_staleness
        # With max_staleness > 0 the producer thread encodes and decodes with `tokenizer` (its runner,
        # envs and engine) while this thread decodes the step before: a fast tokenizer used by two
        # threads at once raises "Already borrowed", so the learner's side (logged texts, saved
        # rollouts, checkpoints) decodes with a copy of its own.
        learner_tokenizer = copy.deepcopy(tokenizer) if self.max_staleness else tokenizer
        self.learner = Learner.from_config(model, learner_tokenizer, config)
        self.rank, self.world = self.learner.rank, self.learner.world_size
        self.rollout_engine = RolloutEngine(config, self.learner, tokenizer, engine=engine, rank=self.rank)
        # the producer's reward/trajectory exchange, apart from the learner's collectives
        group = dist.new_group(backend="gloo") if self.max_staleness and self.world > 1 else None
        self.rollouts = RolloutPhase(
            config,
            tokenizer,
            lambda: self.rollout_engine.versioned,
            rank=self.rank,
            world=self.world,
            process_group=group,
            stream=stream,
            pool=pool,
        )
        self._producer: RolloutProducer[Rollouts] | None = None
        self._rollout_lock = threading.Lock()  # one step's rollouts, or an evaluation, at a time
        if self.rank == 0 and stream.counts:
            c = stream.counts
            print(
                f"data.train: {c['rows']} rows -> {len(stream.problems)} problems "
                f"({c['duplicates']} repeats dropped, answer-format instructions removed from {c['unwrapped']})"
            )
        self.controller = AdaptiveController.from_config(config.algorithm)
        self.entropy_controller = AdaptiveEntropyCoefficient.from_config(config.algorithm)  # adaptive_entropy
        self.step = 0
        self._played: list[Trajectory] = []  # this step's episodes, failed ones included (tool health)
        self._tool_health = ToolHealth()
        self._tool_alarm = ToolHealthAlarm(
            config.trainer.max_infra_error_rate, config.trainer.infra_error_window
        )
        self._consumed_position = stream.position  # after the last trained step's draws

    @property
    def engine(self) -> Any:
        """The rollout engine (``RolloutEngine.engine``)."""
        return self.rollout_engine.engine

    @property
    def policy_version(self) -> int:
        """The step whose update produced the weights the rollout engine samples from."""
        return self.rollout_engine.version

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, Any]:
        """Train ``trainer.steps`` steps (from the last checkpoint with ``resume``); return a summary."""
        cfg = self.config.trainer
        if self.resume and self._restore():
            # The engine still holds the weights it was built with: give it the restored policy
            # before the first rollout (and any evaluation) samples from it.
            self.rollout_engine.sync(self.step)
        if self.rank == 0:
            self.config.save(self.run_dir)
            self._save_run_record()
        for hook in self.diagnostics:
            hook.on_fit_start(self)
        logger = None
        if self.rank == 0:
            logger = StepLogger(
                self.run_dir, backends=self.config.logger.backends, job_type="rl", config=self.config
            )
        bar = tqdm(total=cfg.steps, initial=self.step, desc="RL steps", unit="step", disable=self.rank != 0)
        last: dict[str, Any] = {}
        stop = StopAtStepBoundary(lambda: self.step, quiet=self.rank != 0)
        stopped: str | None = None
        try:
            stop.__enter__()
            while self.step < cfg.steps:
                self.step += 1
                last = self.train_step()
                if (
                    cfg.eval_every
                    and self._eval_source is not None
                    and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                ):
                    t_eval = time.perf_counter()
                    if self.rank == 0:
                        tqdm.write(f"[eval] step {self.step}: evaluating on data.eval ...")
                    report = self.evaluate()
                    if self.rank == 0:
                        shown = {k: v for k, v in report.metrics.items() if k.startswith(("avg@", "maj@"))}
                        tqdm.write(
                            f"[eval] step {self.step}: "
                            + ", ".join(f"{k} {v:.3f}" for k, v in shown.items())
                            + f" ({len(report.problems)} problems, {time.perf_counter() - t_eval:.0f} s)"
                        )
                    self._save_rollouts(f"eval_{self.step:05d}", report.trajectories)
                    last.update({f"eval/{k}": v for k, v in report.metrics.items()})
                    for hook in self.diagnostics:
                        last.update(hook.on_evaluation(self))
                    if self.config.data.eval_greedy:
                        report = self.evaluate(greedy=True)
                        self._save_rollouts(f"eval_greedy_{self.step:05d}", report.trajectories)
                        last.update({f"eval_greedy/{k}": v for k, v in report.metrics.items()})
                if logger is not None:
                    logger.log(self.step, last)
                self._tool_alarm.observe(self.step, self._tool_health)  # stops a run whose tools broke
                bar.update(1)
                if last.get("skipped"):
                    bar.set_postfix(reward=f"{last['reward_mean']:.2f}", update="skipped")
                else:
                    bar.set_postfix(
                        reward=f"{last['reward_mean']:.2f}",
                        H=f"{last['entropy']:.3f}",
                        gate=int(last["gate_on"]),
                    )
                stopped = self._stop_requested(stop)
                if (
                    (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
                    or self.step == cfg.steps
                    or stopped
                ):
                    self.save_checkpoint()
                if stopped:
                    break
        finally:
            stop.__exit__(None, None, None)
            bar.close()
            if logger is not None:
                logger.close()
            self.close()
        skipped = sum(1 for r in self._logged() if r.get("skipped"))
        if stopped and self.rank == 0:
            print(
                f"stopped by {stopped} after step {self.step} of {cfg.steps}: checkpoint "
                f"{checkpoints.latest_checkpoint(self.run_dir)}; continue with --resume",
                flush=True,
            )
        return {
            "steps": self.step,
            "skipped_steps": skipped,
            "run_dir": str(self.run_dir),
            "last": last,
            "stopped_by": stopped,
        }

    def _stop_requested(self, stop: StopAtStepBoundary) -> str | None:
        """The signal that asks this run to stop at this step boundary, on any rank (all ranks agree,
        since saving a checkpoint is collective), or None."""
        asked = stop.signal_name
        if self.world == 1:
            return asked
        flag = torch.tensor([stop.signum or 0], device=self.learner.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None

    def _logged(self) -> list[dict[str, Any]]:
        """The run's metrics records (every fit's, a resumed run's too); rank 0's file, [] elsewhere."""
        from stare_agent.metrics import read_metrics

        return read_metrics(self.run_dir) if (self.run_dir / "metrics.jsonl").is_file() else []

    def train_step(self) -> dict[str, Any]:
        """One RL step in the paper's order (see the module docstring); returns its metrics."""
        t0 = time.perf_counter()
        busy0 = self.rollout_engine.versioned.busy_s()
        # 1-3. rollout, reward (answers are verified inside env.step), dynamic sampling: played here,
        # or taken from the producer thread (trainer.max_staleness > 0)
        rollouts = self._next_rollouts()
        t_wait = time.perf_counter() - t0
        drawn, kept = rollouts.drawn, rollouts.kept
        self._played, self._consumed_position = rollouts.played, rollouts.position
        metrics = self._rollout_metrics(drawn, kept, rollouts.ds_metrics, rollouts.rollout_s)
        metrics["time/reward_s"] = rollouts.reward_s  # part of rollout_s
        metrics.update(self._staleness(kept))
        self.rollout_engine.sleep()  # env.placement.sleep_between_steps: the GPU is the learner's now
        # 4-8. advantages, log-probs, gate, weights, update
        learned = self.learn(drawn, kept)
        metrics.update(learned)
        if "skip_reason" in learned:
            self.rollout_engine.publish(self.step)  # the policy after this step: unchanged
            return metrics
        # 9. sync
        if not learned.get("skipped"):
            self.rollout_engine.sync(self.step)
        self.rollout_engine.publish(self.step)
        sync_s, self.rollout_engine.sync_s = self.rollout_engine.sync_s, 0.0
        metrics["time/update_s"] += sync_s
        metrics["time/sync_s"] = sync_s  # part of time/update_s
        step_s = time.perf_counter() - t0
        metrics["time/step_s"] = step_s
        metrics["time/learner_idle_frac"] = t_wait / step_s  # waiting for rollouts
        engine_busy = self.rollout_engine.versioned.busy_s() - busy0
        metrics["time/engine_idle_frac"] = max(0.0, 1.0 - engine_busy / step_s)
        # perf/*: the learner's model FLOPs (6N per trained token, 2N per forward-only one, plus
        # attention; stare_agent.perf) over time/logprob_s + time/update_s before the sync, against
        # the matmul bound; the engine's sampled tokens per busy second when it played this step
        updates, passes = perf.learner_passes(self.config.algorithm, learned)
        peak = perf.peak_flops(perf.precision_dtype(self.learner.precision), str(self.learner.device))
        lens = [t.num_tokens for g in kept for t in g.trajectories]
        learner_s = learned["time/logprob_s"] + learned["time/update_s"]
        cfg, world = self.learner.module.config, self.world
        metrics.update(
            perf.learner_perf(cfg, lens, learner_s, peak, updates=updates, forward_passes=passes, world=world)
        )
        if not self.max_staleness and engine_busy > 0:
            metrics["perf/rollout_tokens_per_s"] = (
                sum(t.num_sampled_tokens for t in self._played) / engine_busy
            )
        return metrics

    def _next_rollouts(self) -> Rollouts:
        """This step's rollouts: played now (max_staleness 0), or the producer's (started here)."""
        if not self.max_staleness:
            return self.rollouts.play(self.step)
        if self._producer is None or not self._producer.first <= self.step <= self._producer.last:
            if self._producer is not None:
                self._producer.close()
            self._producer = RolloutProducer(
                self.rollouts.play,
                self.rollout_engine.versioned,
                first=self.step,
                last=max(self.config.trainer.steps, self.step),
                max_staleness=self.max_staleness,
                lock=self._rollout_lock,
            )
        return self._producer.take(self.step)

    def _staleness(self, kept: list[Group]) -> dict[str, float]:
        """``async/staleness_mean`` (token mean) and ``_max`` of the kept groups' model tokens: how many
        updates older than the proximal policy (version ``step - 1``) each token's sampler was."""
        proximal = self.step - 1
        lags = [
            proximal - v
            for g in kept
            for t in g.trajectories
            for v in t.token_versions()  # per token: a sync may interrupt a turn
            if v is not None
        ]
        if not lags:
            return {}
        if max(lags) > self.max_staleness or min(lags) < 0:
            raise RuntimeError(
                f"step {self.step} got tokens {max(lags)} updates stale (bound trainer.max_staleness="
                f"{self.max_staleness}) or from a future policy ({min(lags)}): a bug in the rollout producer"
            )
        return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}

    def learn(self, drawn: list[Group], kept: list[Group]) -> dict[str, Any]:
        """Steps 4-8 on one step's groups: ``drawn`` in draw order, ``kept`` those dynamic sampling
        kept (in draw order). Advantages over the kept groups, log-probs, the gate, the token
        selection and the update; the engine is not synced. Returns the update's metrics, or
        ``skipped`` and ``skip_reason`` when there is nothing to train. ``stare_research.replay`` calls
        it on saved episodes, so that a replay trains exactly as the run did.

        With ``algorithm.ppo_mini_batch_size`` / ``ppo_epochs`` the update is several optimizer steps
        (:meth:`_mini_batch_plan`), each on its mini-batch with the pre-update log-probs as the ratio's
        old policy; the selection is re-taken per mini-batch or kept from the pre-update pass
        (``algorithm.selection``). One step per batch is the paper's setting and the same either way."""
        alg = self.config.algorithm
        skip = self._skip(drawn, kept)
        if skip is not None:
            return skip
        # 4. advantages over all kept groups (identical on every rank), then this rank's share
        A, trajectories, sequence_ids, adv_metrics = self._advantages(kept)
        plan = self._mini_batch_plan(kept)
        several = len(plan) > 1 or alg.ppo_epochs > 1
        selects = alg.name in SELECTING_ALGORITHMS
        # 5-7. pre-update log-probs and entropy, the gate (global over ranks), the selection. GRPO-ds
        # with one step per batch needs no batch statistic before its loss: its update's own forward
        # pass gives the entropy; several steps need the pre-update log-probs as the old policy.
        t1 = time.perf_counter()
        pre = self._pre_update_pass(trajectories, A) if selects or several else None
        gated = None
        if alg.name in ("stare", "first_order"):  # the closed loop's gate on the pre-update pass
            assert pre is not None
            gated = self._stare_gate(drawn, kept, pre)
        beta = self.entropy_controller.beta if alg.name == "adaptive_entropy" else None
        selection, pre_metrics = None, dict[str, float]()
        if selects:
            assert pre is not None
            selection = self._select(pre, trajectories, sequence_ids, gated)
            pre_metrics = {**selection.metrics, **self._diagnose(pre, **selection.diagnosed)}
        t_logprob = time.perf_counter() - t1
        # 8. update: one optimizer step per mini-batch, algorithm.ppo_epochs passes
        t2 = time.perf_counter()
        updates = []
        for epoch in range(alg.ppo_epochs):
            for j, rows in enumerate(plan):
                if not several:
                    part, A_part, old = trajectories, A, None  # on-policy: old = logp.detach(), rho = 1
                    chosen = selection
                else:
                    assert pre is not None
                    part, A_part = [trajectories[i] for i in rows], A[rows]
                    old = _rows(pre.logprobs, rows, part)
                    chosen = self._select_mini_batch(
                        pre, selection, rows, part, A_part, sequence_ids, gated, key=(epoch, j)
                    )
                if chosen is not None and chosen.advantages is not None:  # EntroAdv's shaped A_t
                    A_part = chosen.advantages
                updates.append(
                    self.learner.update(
                        part,
                        A_part,
                        chosen.weights if chosen is not None else None,
                        old_logprobs=old,
                        rollout_correction=self.rollout_engine.correction_mode(),
                        kl_coef=chosen.kl_coef if chosen is not None else None,
                        entropy_coef=beta,
                    )
                )
        update_metrics = _combine_updates(updates, epochs=alg.ppo_epochs, mini_batches=len(plan))
        t_update = time.perf_counter() - t2
        if gated is None:  # not STARE: the gate STARE would have seen, logged for comparison
            Hbar = update_metrics["entropy"] if pre is None else self._gate(drawn, kept, pre)[1]
            gated = self._gate_after_update(Hbar)
        gate_on, Hbar, gate_metrics = gated
        if beta is not None:  # the adaptive entropy coefficient steps on this step's entropy
            gate_metrics = {
                **gate_metrics,
                "adaptive_entropy/beta": beta,
                **self.entropy_controller.update(Hbar),
            }
        return {
            **adv_metrics,
            **gate_metrics,
            **pre_metrics,
            **update_metrics,
            "entropy": Hbar,
            "gate_on": int(gate_on),
            "H_tgt": alg.H_tgt,
            "W": self.controller.W,
            "M": self.controller.M,
            "frac_reweighted": pre_metrics.get("stare/frac_reweighted", 0.0),
            "kept_groups": len(kept),
            "overlong_filtered": sum(_budget_cut(t) for g in kept for t in g.trajectories)
            if alg.overlong_filter
            else 0,
            "time/logprob_s": t_logprob,
            "time/update_s": t_update,
        }

    def _mini_batch_plan(self, kept: list[Group]) -> list[list[int]]:
        """This rank's rows (indices into its trajectories) of each mini-batch, whole groups each.

        ``algorithm.ppo_mini_batch_size = S`` cuts the K kept groups into ``n = ceil(K / S)``
        mini-batches, fewer when a rank would get none (``n <= K // world``): each rank splits its own
        groups (kept group i on rank i mod world) into n consecutive near-equal parts, so mini-batch j
        is about S groups over all ranks and every rank takes the same n optimizer steps. Null: one."""
        S = self.config.algorithm.ppo_mini_batch_size
        mine = [g for i, g in enumerate(kept) if i % self.world == self.rank]
        offsets = np.cumsum([0] + [len(g.trajectories) for g in mine])
        n = 1 if S is None else max(1, min(-(-len(kept) // S), len(kept) // self.world))
        return [
            [r for gi in part for r in range(int(offsets[gi]), int(offsets[gi + 1]))]
            for part in np.array_split(np.arange(len(mine)), n)
        ]

    def _skip(self, drawn: list[Group], kept: list[Group]) -> dict[str, Any] | None:
        """The metrics of a step with nothing to train, said on rank 0 (dynamic sampling fell short
        with ``data.on_short_batch=skip``, or fewer kept groups than ranks); None otherwise."""
        data = self.config.data
        short = data.dynamic_sampling and len(kept) < data.prompts_per_step
        if short and self.rank == 0:
            skip = data.on_short_batch == "skip" or len(kept) < self.world
            action = "skipping the step" if skip else f"training on {len(kept)}"
            tqdm.write(
                f"step {self.step}: dynamic sampling kept {len(kept)} of {data.prompts_per_step} groups after "
                f"data.max_sampling_batches={data.max_sampling_batches}: {action} (data.on_short_batch="
                f"{data.on_short_batch})"
            )
        if short and data.on_short_batch == "skip":
            reason = "dynamic sampling fell short (data.on_short_batch=skip)"
        elif len(kept) < self.world:
            # Every rank needs a group to take part in the update; all ranks see the same count.
            reason = self._nothing_to_train(drawn, kept)
            if self.rank == 0:
                tqdm.write(f"step {self.step}: no update: {reason}")
        else:
            return None
        # no update, so no gate: NaN (null in metrics.jsonl, a gap on the dashboard), never "off"
        return {"skipped": 1, "skip_reason": reason, "entropy": float("nan"), "gate_on": float("nan")}

    def _nothing_to_train(self, drawn: list[Group], kept: list[Group]) -> str:
        """Why a step has fewer groups to train than ranks, in the user's terms, with what to change."""
        data = self.config.data
        if not any(g.trajectories for g in drawn):
            return "every episode of the step was lost to sandbox failures: run `stare-agent sandbox doctor`"
        if data.dynamic_sampling and self.world == 1:
            return (
                f"none of the {len(drawn)} prompts drawn had samples that scored differently (all right or all "
                "wrong), so every GRPO advantage is 0 and there is nothing to learn from: if this repeats, "
                "match the problems to the model (data.train, data.difficulty) or draw more "
                "(data.max_sampling_batches, data.prompts_per_draw)"
            )
        groups = "groups with reward variance" if data.dynamic_sampling else "groups with episodes"
        return (
            f"{len(kept)} {groups} for {self.world} ranks, and every rank needs one: raise "
            "data.prompts_per_step or data.max_sampling_batches"
        )

    def _advantages(
        self, kept: list[Group]
    ) -> tuple[torch.Tensor, list[Trajectory], torch.Tensor, dict[str, float]]:
        """4. GRPO advantages over all kept groups (identical on every rank), then this rank's share
        (kept group i on rank i mod world): (A, trajectories, sequence_ids, metrics)."""
        alg = self.config.algorithm
        rewards = torch.tensor([r for g in kept for r in g.rewards], dtype=torch.float32)
        group_index = torch.tensor([i for i, g in enumerate(kept) for _ in g.rewards])
        A_all, adv_metrics = grpo_advantages(rewards, group_index=group_index)
        mine = [i for i, g in enumerate(kept) if i % self.world == self.rank]
        offsets = np.cumsum([0] + [len(g.rewards) for g in kept])
        rows = [r for i in mine for r in range(offsets[i], offsets[i + 1])]
        trajectories = [t for i in mine for t in kept[i].trajectories]
        if alg.overlong_filter:  # DAPO: budget-cut episodes shape their group's advantages, not the loss
            trajectories = [_without_loss(t) if _budget_cut(t) else t for t in trajectories]
        if alg.void_turn_filter:  # SimpleTIR: episodes with a void turn shape advantages, not the loss
            trajectories = [_without_loss(t) if t.void_turn else t for t in trajectories]
        sequence_ids = torch.tensor([gid for i in mine for gid in kept[i].global_ids])
        return A_all[rows], trajectories, sequence_ids, adv_metrics

    def _stare_gate(
        self, drawn: list[Group], kept: list[Group], pre: PreUpdate
    ) -> tuple[bool, float, dict[str, float]]:
        """6 for STARE: the gate on the pre-update pass (global over ranks; ``always_on`` for the
        paper's open-loop ablation); the optional adaptive W/M steps on its Hbar, once per step:
        (gate_on, Hbar, gate metrics)."""
        alg = self.config.algorithm
        gate_on, Hbar, gate_metrics = self._gate(drawn, kept, pre)
        if alg.gate == "always_on":  # the paper's open-loop ablation
            gate_on = True
        if alg.adaptive:
            self.controller.update(Hbar)
        return gate_on, Hbar, gate_metrics

    def _pre_update_pass(self, trajectories: list[Trajectory], A: torch.Tensor) -> PreUpdate:
        """5. The pre-update policy's log-probs and entropy of this rank's rows (and the moments when a
        diagnostics hook needs them), with the token advantages and mask, as the weights read them."""
        logp, entropy, *moments = self.learner.compute_logprobs_and_entropy(
            trajectories, with_moments=self._with_moments
        )
        mask = collate(trajectories, self.learner.pad_id)["response_mask"].to(logp.device)
        A_tok = broadcast_to_tokens(A.to(logp.device), mask)
        return PreUpdate(
            self.step, self.config.algorithm.name, A_tok, logp, entropy, moments[0] if moments else None, mask,
            None, None, None, None,
        )  # fmt: skip

    @property
    def _with_moments(self) -> bool:
        """Whether the pre-update pass also returns the moments: the first-order weighting reads them
        (its c_t), or a diagnostics hook needs them."""
        return self.config.algorithm.name == "first_order" or any(
            hook.needs_moments for hook in self.diagnostics
        )

    def _gate(
        self, drawn: list[Group], kept: list[Group], pre: PreUpdate
    ) -> tuple[bool, float, dict[str, float]]:
        """6. The gate: ``gate_on = Hbar < H_tgt``, Hbar the token-mean entropy of the kept groups' model
        tokens on all ranks (the paper's definition): (gate_on, Hbar, metrics)."""
        return entropy_gate(pre.entropy, pre.mask, self.config.algorithm.H_tgt)

    def _stare_weights(
        self,
        pre: PreUpdate,
        gate_on: bool,
        Hbar: float,
        trajectories: list[Trajectory],
        sequence_ids: torch.Tensor,
        **options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
        """7. STARE's weights (``stare_weights``) with this run's options, and ``options`` passed on:
        (weights, L+, L-, metrics)."""
        alg = self.config.algorithm
        return stare_weights(
            pre.advantages,
            pre.logprobs,
            pre.mask,
            gate_on=gate_on,
            variant=cast("Variant", alg.variant),  # the config checked variant and scope
            P=alg.P,
            W=self.controller.W,
            M=self.controller.M,
            scope=cast("Scope", alg.scope),
            micro_batches=self.learner.micro_batches(trajectories) if alg.scope == "micro_batch" else None,
            sequence_ids=sequence_ids.to(pre.logprobs.device),
            Hbar=Hbar,
            **options,
        )

    def _diagnose(self, pre: PreUpdate, **weighted: Any) -> dict[str, float]:
        """The diagnostics hooks' metrics of this step's weighted batch (``Diagnostics.on_pre_update``)."""
        if not self.diagnostics:
            return {}
        batch = dataclasses.replace(pre, **weighted)
        metrics: dict[str, float] = {}
        for hook in self.diagnostics:
            metrics.update(hook.on_pre_update(batch))
        return metrics

    def _gate_after_update(self, Hbar: float) -> tuple[bool, float, dict[str, float]]:
        """6 for the algorithms other than STARE: the gate on the update's own Hbar, logged for
        comparison (the adaptive W/M steps on it): (gate_on, Hbar, metrics)."""
        gate_on, gate_metrics = gate(Hbar, self.config.algorithm.H_tgt)
        if self.config.algorithm.adaptive:
            self.controller.update(Hbar)
        return gate_on, Hbar, gate_metrics

    def _select(
        self,
        pre: PreUpdate,
        trajectories: list[Trajectory],
        sequence_ids: torch.Tensor,
        gated: tuple[bool, float, dict[str, float]] | None,
        key: tuple[int, int] | None = None,
        old_logprobs: torch.Tensor | None = None,
    ) -> Selection:
        """7. The token selection of ``algorithm.name`` on ``pre``'s rows (``trajectories``), per
        ``algorithm.scope``: STARE's weights (``gated`` is its gate), KL-Cov's coefficients,
        Clip-Cov's / forking tokens' weights (``algorithms.entropy_control``), or the field's
        token weights or EntroAdv's advantages (:meth:`_token_weighting`). The micro_batch scope
        selects inside each of the learner's own micro-batches of ``trajectories``, as the authors'
        code does, so the split must be the learner's. ``key``: (epoch, mini-batch) of a re-selection,
        which Clip-Cov's draw is seeded with besides the run's seed and the step; ``old_logprobs``: the
        ratio's old policy on those rows when it is not ``pre``'s (STEER's pi_old)."""
        alg = self.config.algorithm
        ids = sequence_ids.to(pre.logprobs.device)
        if alg.name == "stare":
            assert gated is not None
            gate_on, Hbar, _ = gated
            weights, L_plus, L_minus, metrics = self._stare_weights(pre, gate_on, Hbar, trajectories, ids)
            diagnosed = {"weights": weights, "L_plus": L_plus, "L_minus": L_minus, "Hbar": Hbar}
            return Selection(weights, None, metrics, diagnosed)
        scope = cast("Scope", alg.scope)
        split = self.learner.micro_batches(trajectories) if alg.scope == "micro_batch" else None
        if alg.name in ("steer", "stapo", "entroadv", "first_order"):
            return self._token_weighting(pre, scope, split, gated, old_logprobs)
        if alg.name == "kl_cov":
            kl_coef, metrics = kl_cov_coefficients(
                pre.advantages,
                pre.logprobs,
                pre.mask,
                k=alg.kl_cov_k,
                coef=alg.kl_cov_coef,
                scope=scope,
                micro_batches=split,
                sequence_ids=ids,
            )
            return Selection(None, kl_coef, metrics, {})
        if alg.name == "clip_cov":  # the same draw on every rank: seeded by the run's seed and the step
            label = f"clip_cov {self.config.trainer.seed} {self.step}" + ("" if key is None else f" {key}")
            draw = torch.Generator().manual_seed(zlib.crc32(label.encode()))
            weights, metrics = clip_cov_weights(
                pre.advantages,
                pre.logprobs,
                pre.mask,
                r=alg.clip_cov_r,
                lb=alg.clip_cov_lb,
                ub=alg.clip_cov_ub,
                generator=draw,
                scope=scope,
                micro_batches=split,
                sequence_ids=ids,
            )
        else:
            weights, metrics = forking_token_weights(
                pre.entropy, pre.mask, rho=alg.forking_rho, scope=scope, micro_batches=split, sequence_ids=ids
            )
        return Selection(weights, None, metrics, {"weights": weights})

    def _token_weighting(
        self,
        pre: PreUpdate,
        scope: Scope,
        split: list[list[int]] | None,
        gated: tuple[bool, float, dict[str, float]] | None,
        old_logprobs: torch.Tensor | None,
    ) -> Selection:
        """7 for the field's token-weighting methods (``algorithms.token_weighting``): STEER's, STAPO's
        or the first-order weights (``gated``: the closed loop's gate), or EntroAdv's advantages."""
        alg = self.config.algorithm
        if alg.name == "entroadv":
            shaped, metrics = entroadv_advantages(
                pre.advantages, pre.entropy, pre.mask, alpha=alg.entroadv_alpha, kappa=alg.entroadv_kappa
            )
            return Selection(None, None, metrics, {"advantages": shaped}, advantages=shaped)
        if alg.name == "steer":
            weights, metrics = steer_weights(
                pre.advantages,
                pre.logprobs,
                pre.entropy,
                pre.mask,
                old_logprobs=old_logprobs,
                w_min=alg.steer_w_min,
                w_max=alg.steer_w_max,
                scope=scope,
                micro_batches=split,
            )
        elif alg.name == "stapo":
            weights, metrics = stapo_weights(
                pre.advantages,
                pre.logprobs,
                pre.entropy,
                pre.mask,
                tau_p=alg.stapo_tau_p,
                q=alg.stapo_q,
                scope=scope,
                micro_batches=split,
            )
        else:
            assert gated is not None and pre.moments is not None  # first_order: the gate, the moments
            weights, metrics = first_order_weights(
                pre.advantages,
                pre.logprobs,
                pre.entropy,
                pre.moments,
                pre.mask,
                gate_on=gated[0],
                lambda_max=alg.first_order_lambda_max,
                scope=scope,
                micro_batches=split,
            )
        return Selection(weights, None, metrics, {"weights": weights})

    def _select_mini_batch(
        self,
        pre: PreUpdate,
        selection: Selection | None,
        rows: list[int],
        part: list[Trajectory],
        A_part: torch.Tensor,
        sequence_ids: torch.Tensor,
        gated: tuple[bool, float, dict[str, float]] | None,
        *,
        key: tuple[int, int],
    ) -> Selection | None:
        """The selection mini-batch ``key = (epoch, j)`` trains with: ``pre_update`` slices the whole
        batch's; with ``per_mini_batch`` the mini-batch is selected anew from the policy being updated
        (at (0, 0) that is the pre-update policy, whose pass is at hand)."""
        if selection is None:
            return None
        if self.config.algorithm.selection == "pre_update":
            return Selection(
                _rows(selection.weights, rows, part),
                _rows(selection.kl_coef, rows, part),
                {},
                {},
                advantages=_rows(selection.advantages, rows, part),
            )
        now = _pre_update_rows(pre, rows, part) if key == (0, 0) else self._pre_update_pass(part, A_part)
        return self._select(now, part, sequence_ids[rows], gated, key, _rows(pre.logprobs, rows, part))

    # ------------------------------------------------------------------ the run's record

    def _rollout_metrics(
        self, drawn: list[Group], kept: list[Group], ds_metrics: dict[str, float], t_rollout: float
    ) -> dict[str, Any]:
        """The step's episodes saved (``trainer.save_rollouts``) and measured: rollout, dynamic
        sampling and tool-health metrics; infrastructure failures printed on rank 0."""
        episodes = [t for g in drawn for t in g.trajectories]
        trained = {id(g) for g in kept}
        self._save_rollouts(
            f"step_{self.step:05d}",
            episodes,
            [
                {"group": n, "trained": id(g) in trained, "global_id": gid}
                for n, g in enumerate(drawn)
                for gid in g.global_ids
            ],
        )
        metrics: dict[str, Any] = {**rollout_metrics(episodes, self.model_texts(episodes)), **ds_metrics}
        metrics["time/rollout_s"] = t_rollout
        metrics["failed_episodes"] = sum(g.failed for g in drawn)
        self._tool_health = ToolHealth.of(self._played)  # the same on every rank: from gathered episodes
        metrics.update(self._tool_health.metrics())
        metrics["dropped_groups"] = sum(g.dropped for g in drawn)
        if metrics["failed_episodes"] and self.rank == 0:
            tqdm.write(
                f"step {self.step}: {metrics['failed_episodes']} episodes failed in the sandbox infrastructure "
                f"after their retries: {metrics['dropped_groups']} groups dropped whole (data.on_failed_episode="
                f"{self.config.data.on_failed_episode})"
            )
        return metrics

    def model_texts(self, trajectories: list[Trajectory]) -> list[str]:
        """The model-written text of each episode (its mask-1 tokens), decoded by the learner's tokenizer."""
        texts = []
        for t in trajectories:
            ids = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
            texts.append(self.learner.tokenizer.decode(ids, skip_special_tokens=True))
        return texts

    def _save_rollouts(
        self, name: str, trajectories: list[Trajectory], fields: list[dict[str, Any]] | None = None
    ) -> None:
        """With ``trainer.save_rollouts``: ``rollouts/<name>.jsonl``, one episode per line, each with its
        ``fields`` (see ``TrainerConfig.save_rollouts``)."""
        if not self.config.trainer.save_rollouts or self.rank != 0:
            return
        out = self.run_dir / "rollouts"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{name}.jsonl", "w") as f:
            for n, t in enumerate(trajectories):
                record = {
                    **(fields[n] if fields else {}),
                    "problem_id": t.info.get("problem_id"),
                    "reward": t.reward,
                    "response": self.learner.tokenizer.decode(t.response_ids),
                    "response_ids": t.response_ids,
                    "info": t.info,
                    # the rest of the trajectory, so that `stare-agent replay` trains on it token-exactly
                    "prompt_ids": t.prompt_ids,
                    "loss_mask": t.loss_mask,
                    "logprobs": t.logprobs,
                    "turn_spans": t.turn_spans,
                    "turn_versions": t.turn_versions,
                    "version_switches": t.version_switches,
                }
                f.write(json.dumps(record, default=str) + "\n")

    def _save_run_record(self) -> None:
        """``run_dir/run.json``: this fit's command, start, versions and commit, the sandbox backend its
        pool resolved (``auto`` never means ``local``: a local one was named) and its engine; one
        record per fit, a resumed run's appended (``runs``)."""
        from stare_agent.provenance import engine_settings, run_record

        path = self.run_dir / "run.json"
        runs = json.loads(path.read_text())["runs"] if path.is_file() else []
        pool = self.rollouts.pool()  # None: the env's tools run no code
        runs.append(
            run_record(
                sandbox_backend=pool.backend if pool is not None else None,
                engine=engine_settings(self.engine),
                resumed_at_step=self.step,
            )
        )
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"runs": runs}, indent=2, default=str))
        tmp.replace(path)

    def evaluate(
        self, *, greedy: bool = False, config: RunConfig | None = None, keep_trajectories: bool | None = None
    ) -> Any:
        """Validation on ``data.eval`` with the current policy (avg@k etc.), between two steps'
        rollouts; ``greedy``: one temperature-0 sample per problem instead of ``data.eval_samples`` at
        ``data.eval_temperature``. ``config`` replaces the run's (e.g. other problems or sampling);
        ``keep_trajectories`` (default ``trainer.save_rollouts``): the report keeps the episodes."""
        from stare_agent.evaluation import evaluate_config

        with self._rollout_lock:
            return evaluate_config(
                config or self.config,
                engine=self.engine,
                tokenizer=self.tokenizer,
                pool=self.rollouts.pool(),
                batch_size=self.config.sandbox.pool_size,  # one leased sandbox per live episode at most
                greedy=greedy,
                progress=False,
                keep_trajectories=self.config.trainer.save_rollouts
                if keep_trajectories is None
                else keep_trajectories,
            )

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Write ``run_dir/checkpoints/step-N`` atomically (``checkpoints.save_checkpoint``): the
        learner (model, optimizer, scheduler), the HF model + tokenizer, the data position, the W/M
        controller, the adaptive entropy coefficient and every RNG state; keeps the newest
        ``trainer.keep_checkpoints``."""
        state = {
            "step": self.step,
            # after the last trained step's draws: the rollouts of later steps in flight are played
            # again on resume, with the same seeds
            "data_position": self._consumed_position,
            "controller": self.controller.state_dict(),
            "entropy_controller": self.entropy_controller.state_dict(),
        }
        return checkpoints.save_checkpoint(
            self.run_dir, self.learner, state, keep=self.config.trainer.keep_checkpoints
        )

    def _restore(self) -> bool:
        """Load the last checkpoint, if any; return whether one was loaded."""
        state = checkpoints.load_checkpoint(self.run_dir, self.learner)
        if state is None:
            return False
        self.step = int(state["step"])
        self.rollouts.stream.position = self._consumed_position = int(state["data_position"])
        self.rollout_engine.version = self.step
        self.controller.load_state_dict(state["controller"])
        if "entropy_controller" in state:  # checkpoints saved before it have none: keep its start
            self.entropy_controller.load_state_dict(state["entropy_controller"])
        return True

    def close(self) -> None:
        """Close the rollout producer, the envs, the sandbox pool and an engine this trainer
        started (a vLLM worker)."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self.rollout_engine.close()
        self.rollouts.close()
        self._claim.close()


class StopAtStepBoundary:
    """While entered (from the main thread): SIGINT (Ctrl-C) and SIGTERM (``kill``, a scheduler's
    preemption) ask the run to stop at the next step boundary, where it saves a checkpoint, instead of
    dying mid-step with nothing saved. A second signal stops at once (``KeyboardInterrupt``, or
    ``SystemExit(128 + SIGTERM)``). The handlers in place before are restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, step: Callable[[], int], *, quiet: bool = False) -> None:
        self.step, self.quiet = step, quiet
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: now
            self.__exit__()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        if not self.quiet:
            how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(
                f"\n{signal.Signals(signum).name}: stopping after step {self.step()}, where a checkpoint is saved "
                f"({how} again to stop at once, saving nothing)",
                file=sys.stderr,
                flush=True,
            )


@dataclasses.dataclass
class Selection:
    """Step 7's result on some rows: token weights [B, T] (None: 1), KL-Cov's coefficients (None:
    none), the metrics, what the diagnostics hooks read of it (``PreUpdate`` fields), and token
    advantages [B, T] to train with instead of the GRPO ones (EntroAdv's; None: GRPO's)."""

    weights: torch.Tensor | None
    kl_coef: torch.Tensor | None
    metrics: dict[str, float]
    diagnosed: dict[str, Any]
    advantages: torch.Tensor | None = None


@overload
def _rows(t: torch.Tensor, rows: list[int], part: list[Trajectory]) -> torch.Tensor: ...
@overload
def _rows(t: torch.Tensor | None, rows: list[int], part: list[Trajectory]) -> torch.Tensor | None: ...
def _rows(t: torch.Tensor | None, rows: list[int], part: list[Trajectory]) -> torch.Tensor | None:
    """The [B, L-1, ...] token tensor ``t`` of a rank's batch cut to ``rows``, aligned with
    ``collate(part)`` (``part`` the trajectories of those rows: collate pads to the longest)."""
    if t is None:
        return None
    width = max(x.num_tokens for x in part) - 1
    return t[torch.as_tensor(rows, device=t.device), :width]


def _pre_update_rows(pre: PreUpdate, rows: list[int], part: list[Trajectory]) -> PreUpdate:
    """``pre`` (before its weights) cut to ``rows``, as :func:`_rows` cuts each of its tensors."""
    return dataclasses.replace(
        pre,
        advantages=_rows(pre.advantages, rows, part),
        logprobs=_rows(pre.logprobs, rows, part),
        entropy=_rows(pre.entropy, rows, part),
        mask=_rows(pre.mask, rows, part),
        moments=_rows(pre.moments, rows, part),
    )


def _combine_updates(updates: list[dict[str, float]], *, epochs: int, mini_batches: int) -> dict[str, Any]:
    """The step's metrics from its optimizer steps' (``Learner.update``, epoch-major): one step's as
    they are; for several, token-weighted means (``tokens`` and ``micro_batches`` of one epoch,
    ``lr`` the last, ``skipped`` 1 when every step was dropped), ``ppo/*`` counts, the clip fraction
    and approximate KL of the last and the largest, and ``ppo/per_mini_batch``: each step's
    ``epoch``, ``mini_batch``, loss, clip fractions, approximate KL, ratio mean and gradient norm."""
    if len(updates) == 1:
        return updates[0]
    weight = [u["tokens"] for u in updates]
    total = sum(weight) or 1.0
    keys = [k for k in updates[0] if all(isinstance(u.get(k), int | float) for u in updates)]
    out: dict[str, Any] = {
        k: sum(u[k] * n for u, n in zip(updates, weight, strict=True)) / total for k in keys
    }
    for key in SUMMED_METRICS & set(keys):  # counts: each sequence once, in the first epoch
        out[key] = sum(u[key] for u in updates[:mini_batches])
    out.update(
        tokens=sum(u["tokens"] for u in updates[:mini_batches]),
        micro_batches=sum(u["micro_batches"] for u in updates[:mini_batches]),
        lr=updates[-1]["lr"],
        skipped=float(all(u["skipped"] for u in updates)),
    )
    out["ppo/optimizer_steps"] = float(len(updates))
    out["ppo/mini_batches"] = float(mini_batches)
    out["ppo/epochs"] = float(epochs)
    out["ppo/steps_skipped"] = float(sum(u["skipped"] for u in updates))
    per_step = [
        {
            "epoch": i // mini_batches,
            "mini_batch": i % mini_batches,
            **{k: u[k] for k in PER_MINI_BATCH if k in u},
        }
        for i, u in enumerate(updates)
    ]
    for key in ("actor/pg_clipfrac", "actor/ppo_kl"):
        values = [u[key] for u in updates if key in u]
        if values:
            out[f"{key}_last"] = values[-1]
            out[f"{key}_max"] = max(values, key=abs)
    out["ppo/per_mini_batch"] = per_step  # a list: metrics.jsonl keeps it, trackers take the scalars
    return out


PER_MINI_BATCH = (
    "loss",
    "grad_norm",
    "skipped",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "actor/ratio_mean",
    "tokens",
)
"""``Learner.update`` metrics logged for each optimizer step of a step (``ppo/per_mini_batch``)."""


def _budget_cut(trajectory: Trajectory) -> bool:
    return trajectory.info.get("finish_reason") == "budget"


def _without_loss(trajectory: Trajectory) -> Trajectory:
    """The episode with every token masked out of the loss (and out of every token count)."""
    n = len(trajectory.response_ids)
    return dataclasses.replace(
        trajectory, loss_mask=[0] * n, logprobs=[0.0] * n, turn_spans=[], turn_versions=[]
    )
