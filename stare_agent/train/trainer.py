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
    7. weights      the method's (``stare_agent.methods``): STARE W on L+, M on L- (C2), 1
                    elsewhere; GRPO-ds none
    8. update       one optimizer step of the dual-clip surrogate x weights, token-mean (the paper's;
                    ``algorithm.ppo_mini_batch_size`` / ``ppo_epochs``: one per mini-batch and epoch)
    9. sync         hand the new weights to the rollout engine

With ``trainer.max_staleness = k > 0`` steps 1-3 of later steps run on a producer thread while
steps 4-9 of this one run here (``train.async_rollouts``): every model token is labelled with the
policy version that sampled it and is at most k updates stale when trained.

Steps 1-3 are ``train.rollout_phase`` (what a step draws, plays and keeps), step 9 and the engine the
rollouts sample with are ``train.rollout_engine``; steps 4-8 read here, in the paper's order, with this
rank's share of the batch from ``train.step_batch`` and step 7 from the method ``algorithm.name``
names (``stare_agent.methods``).

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
import os
import signal
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from stare_agent import perf, run_dirs
from stare_agent.algorithms import AdaptiveController, broadcast_to_tokens, gate
from stare_agent.config import RunConfig
from stare_agent.methods import make_method
from stare_agent.methods.base import Batch, Gate, Method, Selection
from stare_agent.metrics import StepLogger, ToolHealth, ToolHealthAlarm, rollout_metrics
from stare_agent.resources import eval_source, periodic_eval_config
from stare_agent.train import checkpoints, records
from stare_agent.train.async_rollouts import RolloutProducer, staleness
from stare_agent.train.batch import collate
from stare_agent.train.deepspeed_setup import load_training_policy
from stare_agent.train.diagnostics import Diagnostics, PreUpdate
from stare_agent.train.learner import Learner
from stare_agent.train.rollout_engine import RolloutEngine
from stare_agent.train.rollout_phase import Group, RolloutPhase, Rollouts, problem_stream
from stare_agent.train.signals import StopAtStepBoundary
from stare_agent.train.step_batch import (
    budget_cut,
    combine_updates,
    dropped_entropy,
    mini_batch_plan,
    nothing_to_train,
    pre_update_rows,
    rank_share,
    rows_of,
)
from stare_envs.registry import check_env_id
from stare_envs.trajectory import Trajectory

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
        method: The method step 7 runs (``stare_agent.methods.base.Method``), e.g. a variant of a
            registered one; default: ``make_method(config.algorithm)``, the one ``algorithm.name`` names.
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
        method: Method | None = None,
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
            self.method = method if method is not None else make_method(config.algorithm)
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
        self.config, self.resume = config, resume
        self.diagnostics = list(diagnostics)
        _check_before_loading(config, engine)
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
        logger = self._start_fit()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="RL steps", unit="step", disable=self.rank != 0)
        last: dict[str, Any] = {}
        stopped: str | None = None
        try:
            with StopAtStepBoundary(lambda: self.step, quiet=self.rank != 0) as stop:
                while self.step < cfg.steps and not stopped:
                    self.step += 1
                    last = self.train_step()
                    if self._eval_source is not None and self._due(cfg.eval_every):
                        last.update(self._evaluate_now())
                    if logger is not None:
                        logger.log(self.step, last)
                    self._tool_alarm.observe(self.step, self._tool_health)  # stops a run whose tools broke
                    bar.update(1)
                    bar.set_postfix(_progress(last))
                    stopped = self._stop_requested(stop)
                    if self._due(cfg.checkpoint_every) or self.step == cfg.steps or stopped:
                        self.save_checkpoint()
        finally:
            bar.close()
            if logger is not None:
                logger.close()
            self.close()
        if stopped and self.rank == 0:
            print(
                f"stopped by {stopped} after step {self.step} of {cfg.steps}: checkpoint "
                f"{checkpoints.latest_checkpoint(self.run_dir)}; continue with --resume",
                flush=True,
            )
        skipped = sum(1 for r in self._logged() if r.get("skipped"))
        return {
            "steps": self.step,
            "skipped_steps": skipped,
            "run_dir": str(self.run_dir),
            "last": last,
            "stopped_by": stopped,
        }

    def _start_fit(self) -> StepLogger | None:
        """Before the first step: the restored checkpoint (``resume``) handed to the engine, the config
        and the run record saved, the hooks told; rank 0's step logger."""
        if self.resume and self._restore():
            # The engine still holds the weights it was built with: give it the restored policy
            # before the first rollout (and any evaluation) samples from it.
            self.rollout_engine.sync(self.step)
        if self.rank == 0:
            self.config.save(self.run_dir)
            pool = self.rollouts.pool()  # None: the env's tools run no code
            records.save_run_record(self.run_dir, pool=pool, engine=self.engine, step=self.step)
        for hook in self.diagnostics:
            hook.on_fit_start(self)
        if self.rank != 0:
            return None
        return StepLogger(
            self.run_dir, backends=self.config.logger.backends, job_type="rl", config=self.config
        )

    def _due(self, every: int) -> bool:
        """Whether this step is one of every ``every`` (0: never) or, with ``every`` > 0, the last."""
        return every > 0 and (self.step % every == 0 or self.step == self.config.trainer.steps)

    def _evaluate_now(self) -> dict[str, Any]:
        """The periodic evaluation on ``data.eval`` (sampled, and greedy with ``data.eval_greedy``), said on
        rank 0, its episodes saved: its ``eval/*`` and ``eval_greedy/*`` metrics and the hooks'."""
        t_eval = time.perf_counter()
        if self.rank == 0:
            tqdm.write(f"[eval] step {self.step}: evaluating on data.eval ...")
        config = periodic_eval_config(self.config)
        report = self.evaluate(config=config)
        if self.rank == 0:
            shown = {k: v for k, v in report.metrics.items() if k.startswith(("avg@", "maj@"))}
            tqdm.write(
                f"[eval] step {self.step}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in shown.items())
                + f" ({len(report.problems)} problems, {time.perf_counter() - t_eval:.0f} s)"
            )
        self._save_rollouts(f"eval_{self.step:05d}", report.trajectories)
        metrics = {f"eval/{k}": v for k, v in report.metrics.items()}
        for hook in self.diagnostics:
            metrics.update(hook.on_evaluation(self))
        if config.data.eval_greedy:
            report = self.evaluate(greedy=True, config=config)
            self._save_rollouts(f"eval_greedy_{self.step:05d}", report.trajectories)
            metrics.update({f"eval_greedy/{k}": v for k, v in report.metrics.items()})
        return metrics

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
        metrics.update(staleness(kept, self.step, self.max_staleness))
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
        metrics.update(self._perf(kept, learned, engine_busy))
        return metrics

    def _perf(self, kept: list[Group], learned: dict[str, Any], engine_busy: float) -> dict[str, float]:
        """perf/*: the learner's model FLOPs (6N per trained token, 2N per forward-only one, plus
        attention; stare_agent.perf) over time/logprob_s + time/update_s before the sync, against the
        matmul bound; the engine's sampled tokens per busy second when it played this step."""
        updates, passes = perf.learner_passes(
            self.config.algorithm, learned, pre_update=self.method.pre_update
        )
        peak = perf.peak_flops(perf.precision_dtype(self.learner.precision), str(self.learner.device))
        lens = [t.num_tokens for g in kept for t in g.trajectories]
        learner_s = learned["time/logprob_s"] + learned["time/update_s"]
        out = perf.learner_perf(
            self.learner.module.config,
            lens,
            learner_s,
            peak,
            updates=updates,
            forward_passes=passes,
            world=self.world,
        )
        if not self.max_staleness and engine_busy > 0:
            out["perf/rollout_tokens_per_s"] = sum(t.num_sampled_tokens for t in self._played) / engine_busy
        return out

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

    def learn(self, drawn: list[Group], kept: list[Group]) -> dict[str, Any]:
        """Steps 4-8 on one step's groups: ``drawn`` in draw order, ``kept`` those dynamic sampling
        kept (in draw order); the engine is not synced. Returns the update's metrics, or ``skipped`` and
        ``skip_reason`` when there is nothing to train. ``stare_research.replay`` calls it on saved
        episodes, so that a replay trains exactly as the run did. With ``algorithm.ppo_mini_batch_size``
        / ``ppo_epochs`` the update is one optimizer step per mini-batch and epoch (module docstring)."""
        alg, method = self.config.algorithm, self.method
        skip = self._skip(drawn, kept)
        if skip is not None:
            return skip
        # 4. advantages over all kept groups (identical on every rank), then this rank's share
        A, trajectories, sequence_ids, adv_metrics = rank_share(kept, alg, self.rank, self.world)
        plan = mini_batch_plan(kept, alg.ppo_mini_batch_size, self.rank, self.world)
        several = len(plan) > 1 or alg.ppo_epochs > 1
        # 5-7. pre-update log-probs and entropy, the gate (global over ranks), the selection. GRPO-ds
        # with one step per batch needs no batch statistic before its loss: its update's own forward
        # pass gives the entropy; several steps need the pre-update log-probs as the old policy.
        t1 = time.perf_counter()
        pre = self._pre_update_pass(trajectories, A) if method.pre_update or several else None
        gated = self._gate(drawn, kept, pre) if method.gated and pre is not None else None
        selection, pre_metrics = None, dict[str, float]()
        if method.pre_update and pre is not None:
            selection = method.select(self._batch(pre, trajectories, sequence_ids, gated))
            pre_metrics = {**selection.metrics, **self._diagnose(pre, selection)}
        t_logprob = time.perf_counter() - t1
        # 8. update: one optimizer step per mini-batch, algorithm.ppo_epochs passes
        t2 = time.perf_counter()
        batch = _Learning(trajectories, A, sequence_ids, pre, gated, selection, method.entropy_coef())
        updates = [
            self._update(batch, rows if several else None, (epoch, j))
            for epoch in range(alg.ppo_epochs)
            for j, rows in enumerate(plan)
        ]
        update_metrics = combine_updates(updates, epochs=alg.ppo_epochs, mini_batches=len(plan))
        update_metrics["lr"] = self.learner.advance_schedule()  # once a trainer step: verl's unit
        t_update = time.perf_counter() - t2
        if gated is None:  # a method without the closed loop: the gate it would have seen, logged
            Hbar = update_metrics["entropy"] if pre is None else self._gate(drawn, kept, pre, closed=False)[1]
            gated = self._gate_of(Hbar)
        gate_on, Hbar, gate_metrics = gated
        filtered = sum(budget_cut(t) for g in kept for t in g.trajectories) if alg.overlong_filter else 0
        return {
            **adv_metrics,
            **gate_metrics,
            **method.after_update(Hbar),
            **pre_metrics,
            **update_metrics,
            **{"entropy": Hbar, "gate_on": int(gate_on), "H_tgt": alg.H_tgt, "kept_groups": len(kept)},
            **{"W": self.controller.W, "M": self.controller.M, "overlong_filtered": filtered},
            "frac_reweighted": pre_metrics.get("stare/frac_reweighted", 0.0),
            **{"time/logprob_s": t_logprob, "time/update_s": t_update},
        }

    def _update(self, batch: _Learning, rows: list[int] | None, key: tuple[int, int]) -> dict[str, float]:
        """8. One optimizer step: on the whole batch on-policy (``rows`` None: old = logp.detach(),
        rho = 1), or on mini-batch ``key = (epoch, j)``'s ``rows`` with the pre-update log-probs as the
        ratio's old policy and its selection (``algorithm.selection``)."""
        part, A_part, old, chosen = batch.trajectories, batch.A, None, batch.selection
        if rows is not None:
            assert batch.pre is not None
            part, A_part = [batch.trajectories[i] for i in rows], batch.A[rows]
            old = rows_of(batch.pre.logprobs, rows, part)
            chosen = self._select_mini_batch(batch, rows, part, A_part, key)
        if chosen is not None and chosen.advantages is not None:  # EntroAdv's shaped A_t
            A_part = chosen.advantages
        return self.learner.update(
            part,
            A_part,
            chosen.weights if chosen is not None else None,
            old_logprobs=old,
            rollout_correction=self.rollout_engine.correction_mode(),
            kl_coef=chosen.kl_coef if chosen is not None else None,
            entropy_coef=batch.entropy_coef,
            L_plus=chosen.L_plus if chosen is not None else None,
        )

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
            reason = nothing_to_train(drawn, kept, self.config.data, self.world)
            if self.rank == 0:
                tqdm.write(f"step {self.step}: no update: {reason}")
        else:
            return None
        # no update, so no gate: NaN (null in metrics.jsonl, a gap on the dashboard), never "off"
        return {"skipped": 1, "skip_reason": reason, "entropy": float("nan"), "gate_on": float("nan")}

    def _pre_update_pass(self, trajectories: list[Trajectory], A: torch.Tensor) -> PreUpdate:
        """5. The pre-update policy's log-probs and entropy of this rank's rows (and the moments when the
        method or a diagnostics hook needs them), with the token advantages and mask."""
        with_moments = self.method.needs_moments or any(hook.needs_moments for hook in self.diagnostics)
        logp, entropy, *moments = self.learner.compute_logprobs_and_entropy(
            trajectories, with_moments=with_moments
        )
        mask = collate(trajectories, self.learner.pad_id)["response_mask"].to(logp.device)
        A_tok = broadcast_to_tokens(A.to(logp.device), mask)
        return PreUpdate(
            self.step, self.method.name, A_tok, logp, entropy, moments[0] if moments else None, mask,
            None, None, None, None,
        )  # fmt: skip

    def _gate(self, drawn: list[Group], kept: list[Group], pre: PreUpdate, *, closed: bool = True) -> Gate:
        """6. The method's gate on the pre-update pass (global over ranks). ``closed``: the closed loop's,
        which ``algorithm.gate=always_on`` holds on (the paper's open-loop ablation) and the adaptive
        W/M schedule steps on, once per step."""
        gate_on, Hbar, metrics = self.method.gate(
            pre, lambda: dropped_entropy(self.learner, drawn, kept, self.rank, self.world)
        )
        if not closed:
            return gate_on, Hbar, metrics
        if self.config.algorithm.gate == "always_on":
            gate_on = True
        if self.config.algorithm.adaptive:
            self.controller.update(Hbar)
        return gate_on, Hbar, metrics

    def _gate_of(self, Hbar: float) -> Gate:
        """6 for a method without the closed loop: the gate on the step's Hbar, logged for comparison
        (the adaptive W/M schedule steps on it)."""
        gate_on, metrics = gate(Hbar, self.config.algorithm.H_tgt)
        if self.config.algorithm.adaptive:
            self.controller.update(Hbar)
        return gate_on, Hbar, metrics

    def _batch(
        self,
        pre: PreUpdate,
        trajectories: list[Trajectory],
        sequence_ids: torch.Tensor,
        gated: Gate | None,
        key: tuple[int, int] | None = None,
        old_logprobs: torch.Tensor | None = None,
    ) -> Batch:
        """7. What the method selects from on ``pre``'s rows (``trajectories``). The micro_batch scope
        selects inside each of the learner's own micro-batches, as the authors' code does."""
        split = (
            self.learner.micro_batches(trajectories) if self.config.algorithm.scope == "micro_batch" else None
        )
        return Batch(
            pre, sequence_ids, split, self.controller.W, self.controller.M, gated, old_logprobs,
            self.config.trainer.seed, self.step, key,
        )  # fmt: skip

    def _select_mini_batch(
        self,
        batch: _Learning,
        rows: list[int],
        part: list[Trajectory],
        A_part: torch.Tensor,
        key: tuple[int, int],
    ) -> Selection | None:
        """The selection mini-batch ``key = (epoch, j)`` trains with: ``pre_update`` slices the whole
        batch's; with ``per_mini_batch`` the mini-batch is selected anew from the policy being updated
        (at (0, 0) that is the pre-update policy, whose pass is at hand)."""
        if batch.selection is None or batch.pre is None:
            return None
        if self.config.algorithm.selection == "pre_update":
            return batch.selection.rows(lambda t: rows_of(t, rows, part))
        pre = batch.pre
        now = pre_update_rows(pre, rows, part) if key == (0, 0) else self._pre_update_pass(part, A_part)
        old = rows_of(pre.logprobs, rows, part)
        return self.method.select(self._batch(now, part, batch.sequence_ids[rows], batch.gated, key, old))

    def _diagnose(self, pre: PreUpdate, selection: Selection) -> dict[str, float]:
        """The diagnostics hooks' metrics of this step's weighted batch (``Diagnostics.on_pre_update``)."""
        if not self.diagnostics:
            return {}
        batch = dataclasses.replace(pre, **selection.diagnosed)
        metrics: dict[str, float] = {}
        for hook in self.diagnostics:
            metrics.update(hook.on_pre_update(batch))
        return metrics

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
        return records.model_texts(self.learner.tokenizer, trajectories)

    def _save_rollouts(
        self, name: str, trajectories: list[Trajectory], fields: list[dict[str, Any]] | None = None
    ) -> None:
        """With ``trainer.save_rollouts``, on rank 0: ``rollouts/<name>.jsonl`` (``records.save_rollouts``)."""
        if self.config.trainer.save_rollouts and self.rank == 0:
            records.save_rollouts(self.run_dir, self.learner.tokenizer, name, trajectories, fields)

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
        controller, the method's state (the adaptive entropy coefficient) and every RNG state; keeps the newest
        ``trainer.keep_checkpoints``."""
        state = {
            "step": self.step,
            # after the last trained step's draws: the rollouts of later steps in flight are played
            # again on resume, with the same seeds
            "data_position": self._consumed_position,
            "controller": self.controller.state_dict(),
            "method": self.method.state_dict(),
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
        # a checkpoint saved before methods had a state keeps the adaptive entropy coefficient's apart
        self.method.load_state_dict(state.get("method", state.get("entropy_controller", {})))
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


def _check_before_loading(config: RunConfig, engine: Any) -> None:
    """What a run must have before the model loads: a known env id, a vLLM python
    where ``env.engine=vllm`` builds the engine; a warning for a nucleus-truncated rollout."""
    if config.env.top_p < 1:
        warnings.warn(
            f"env.top_p={config.env.top_p}: rollouts sample from the nucleus-truncated distribution "
            "while the loss scores them under the full one, as if on-policy (the ratio is off by the "
            "truncation): use env.top_p=1.0 for RL (the paper's setting)",
            stacklevel=3,
        )
    check_env_id(config.env.id)  # before the model loads, as the problems, run dir and engine are
    if engine is None and config.env.engine == "vllm":
        from stare_agent.engines.vllm_engine import resolve_vllm_python

        resolve_vllm_python(config.env.vllm.python)


def _progress(last: dict[str, Any]) -> dict[str, Any]:
    """The progress bar's postfix of a step's metrics."""
    if last.get("skipped"):
        return {"reward": f"{last['reward_mean']:.2f}", "update": "skipped"}
    return {
        "reward": f"{last['reward_mean']:.2f}",
        "H": f"{last['entropy']:.3f}",
        "gate": int(last["gate_on"]),
    }


@dataclasses.dataclass(frozen=True)
class _Learning:
    """One step's batch on this rank between steps 4-7 and the update: what each optimizer step reads."""

    trajectories: list[Trajectory]
    A: torch.Tensor
    sequence_ids: torch.Tensor
    pre: PreUpdate | None
    gated: Gate | None
    selection: Selection | None
    entropy_coef: float
