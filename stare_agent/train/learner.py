"""The DeepSpeed learner: scores trajectories, applies the GRPO-ds / STARE loss or SFT, checkpoints.

One call of :meth:`Learner.update` (or :meth:`Learner.sft_step`) is ONE optimizer step over the whole
batch, however many micro-batches the token budget ``deepspeed.micro_batch_tokens`` splits it into:

- Gradients accumulate over the micro-batches (DeepSpeed's accumulation boundary is set by hand, so
  gradients are reduced across ranks once, at the last micro-batch).
- The loss is exact for the whole batch. For token-mean over the N mask-1 tokens of the batch on all
  R ranks, micro-batch m contributes ``sum_{t in m} mask_t * w_t * l_t * R / N``; DeepSpeed then
  averages gradients over the R ranks, so the step follows ``sum_all mask * w * l / N``, exactly the
  gradient of one big batch (the other aggregations scale the same way, see ``_loss_scale``).
- Every rank runs the same number of micro-batches (ranks with fewer run zero-weight repeats), so
  ZeRO's collectives always pair up.
- The work is cut without changing the result beyond float rounding (each switch in ``deepspeed``,
  on by default, false for the old path): the LM head and softmax run on scored tokens only
  (``score_response_only``), micro-batches group similar lengths (``bucket_by_length``), and the
  rows of a micro-batch run their common prompt prefix once (``share_prompts``: the samples of one
  prompt all of it, other prompts the system prompt); see :meth:`Learner.compute_batches`.
- A step whose loss or gradient norm is NaN/inf is never applied: gradients are dropped, the
  optimizer, scheduler and parameters are left untouched, and the metrics say ``skipped = 1``.

The learner runs with ``torch.distributed``: gloo on CPU (fp32) and NCCL on GPUs (bf16), launched by
``deepspeed``/``torchrun``; a plain single process works too (it sets up a world of one on a free
loopback port).

Its DeepSpeed config is ``deepspeed_setup.deepspeed_config`` (generated, with a user's
``deepspeed.config`` JSON merged over it and checked); ``deepspeed_setup.load_training_policy``
loads the policy for it (partitioned under ZeRO-3); with ``model.lora`` only LoRA adapters train
(see :class:`Learner`); the learning-rate schedule is :func:`lr_scheduler` (``transformers.get_scheduler``).

Example:
    >>> from stare_agent.config import load_config
    >>> from stare_agent.models import tiny_model
    >>> model, tokenizer = tiny_model()
    >>> learner = Learner.from_config(model, tokenizer, load_config())  # doctest: +SKIP
    >>> logp, entropy = learner.compute_logprobs_and_entropy(trajectories)  # doctest: +SKIP
    >>> metrics = learner.update(trajectories, advantages, weights)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from stare_agent.algorithms.logprobs import logprobs_and_entropy_from_logits, scatter_scored, score_tokens
from stare_agent.algorithms.losses import policy_loss
from stare_agent.algorithms.rollout_correction import correction_weights, mismatch_metrics, mismatch_sums
from stare_agent.config import (
    AlgorithmConfig,
    DeepSpeedConfig,
    LoRAConfig,
    OptimConfig,
    RunConfig,
    precision_line,
    resolve_precision,
)
from stare_agent.train.batch import bucket_by_length, collate, shared_prefix_length, split_by_token_budget
from stare_agent.train.deepspeed_setup import deepspeed_config, init_distributed
from stare_envs.trajectory import Trajectory

logger = logging.getLogger(__name__)

CHECKPOINT_TAG = "learner"
SUMMED_METRICS = frozenset({"rollout_correction/seq_rejected"})
"""Micro-batch metrics that are counts: summed over micro-batches and ranks, not token-weighted."""
ADAPTER_DIRNAME = "adapter"


def lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int) -> LambdaLR:
    """The learning-rate schedule of ``optim``: a ``LambdaLR`` whose multiplier at optimizer step s is,
    with ``W = optim.warmup_steps``, ``T = total_steps`` and ``r = optim.min_lr_ratio``:

    - ``constant``: ``s / W`` during warmup, then 1.
    - ``linear``: ``s / W`` during warmup, then ``r + (1 - r) * (1 - (s - W) / (T - W))``, and r from
      step T on.
    - ``cosine``: ``s / W`` during warmup, then ``r + (1 - r) * (1 + cos(pi * (s - W) / (T - W))) / 2``
      up to step T.

    ``r = 1`` (no decay) is ``constant`` for every schedule. These are transformers' schedules
    ``constant_with_warmup``, ``polynomial`` (power 1, ``lr_end = r * lr``) and ``cosine_with_min_lr``,
    written in their exact arithmetic (a test compares every step): importing
    ``transformers.optimization`` costs a process about 2-5 s (it imports peft), paid by every launch.
    """
    warmup = optim.warmup_steps
    r = optim.min_lr_ratio

    def constant(s: int) -> float:
        return float(s) / float(max(1.0, warmup)) if s < warmup else 1.0

    def linear(s: int) -> float:
        if s < warmup:
            return float(s) / float(max(1, warmup))
        lr_init = optimizer.defaults["lr"]
        lr_end = optim.lr * r
        end = max(total_steps, warmup + 1)  # the decay divides by T - W
        if s > end:
            return lr_end / lr_init
        decay = (lr_init - lr_end) * (1 - (s - warmup) / (end - warmup)) + lr_end
        return decay / lr_init

    def cosine(s: int) -> float:
        if s < warmup:
            return float(s) / float(max(1, warmup))
        progress = float(s - warmup) / float(max(1, total_steps - warmup))
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))  # pi * 0.5 * 2.0 is pi exactly
        return max(0, factor * (1 - r) + r)

    if optim.schedule == "constant" or r == 1.0:
        return LambdaLR(optimizer, constant)
    return LambdaLR(optimizer, linear if optim.schedule == "linear" else cosine)


class ScheduleByUpdate:
    """The learning-rate schedule in verl's unit: one step per update (``Learner.advance_schedule``, a
    trainer step or an SFT step), whatever the number of optimizer steps (mini-batches, epochs) in it.

    DeepSpeed holds it and calls :meth:`step` after every optimizer step it applies; that call only
    notes that one was applied, and :meth:`advance` steps the schedule once if any was (a step every
    optimizer step dropped leaves the schedule where it was, as before). So ``trainer.steps`` is the
    schedule's horizon and ``optim.warmup_steps`` counts trainer steps."""

    def __init__(self, schedule: LambdaLR) -> None:
        self.schedule = schedule
        self.applied = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.applied = True

    def advance(self) -> None:
        if self.applied:
            self.schedule.step()
        self.applied = False

    def get_last_lr(self) -> list[float]:
        return [float(lr) for lr in self.schedule.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state)


class Learner:
    """A causal LM wrapped by ``deepspeed.initialize``: scoring, RL and SFT steps, checkpoints, export.

    Args:
        model: A Hugging Face causal LM (moved to the learner's device and dtype here).
        tokenizer: Its tokenizer (padding id; saved by :meth:`export_hf`).
        ds: The ``deepspeed`` config section (ZeRO stage, precision, micro-batch token budget).
        optim: The optimizer section (AdamW, clipping, schedule).
        total_steps: Optimizer steps planned (for decaying schedules).
        loss: The ``algorithm`` section (clip range, dual clip, aggregation) used by :meth:`update`;
            None for an SFT-only learner.
        temperature: Sampling temperature; logits are divided by it when scoring.
        norm_length: Constant divisor of ``seq-mean-token-sum-norm`` (the response budget).
        lora: The ``model.lora`` section: with ``r > 0`` the model is wrapped in LoRA adapters
            (``stare_agent.models.apply_lora``) and only they train. :attr:`module` is then the
            adapted model (its linear layers carry the adapters), which an in-process engine samples
            from; :meth:`named_weights`, :meth:`state_dict` and :meth:`export_hf` give the merged
            weights under the base model's names.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        ds: DeepSpeedConfig,
        optim: OptimConfig,
        *,
        total_steps: int,
        loss: AlgorithmConfig | None = None,
        temperature: float = 1.0,
        norm_length: int | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        import deepspeed

        init_distributed(ds.dist_backend)
        self.ds_config, self.optim_config, self.loss_config = ds, optim, loss
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.norm_length = norm_length
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.precision = resolve_precision(ds.precision, self.device.type)
        if self.rank == 0:
            print(precision_line(ds.precision, self.precision, self.device.type), flush=True)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad)
        if getattr(model.config, "use_cache", None):
            model.config.use_cache = False  # no KV cache while training
        model.to(self.device)
        model.train()
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            from stare_agent.models import apply_lora

            model = apply_lora(model, self.lora)
        model.zero_grad(set_to_none=True)  # a model trained before (e.g. SFT) must not add its last gradient
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=optim.lr,
            betas=(float(optim.betas[0]), float(optim.betas[1])),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )

        # The DeepSpeed-wrapped model (DeepSpeed's "engine"; in this package an engine samples rollouts).
        self.ds_model, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: ScheduleByUpdate(lr_scheduler(opt, optim, total_steps)),
            config=self._deepspeed_dict(),
        )
        # Under LoRA, ds_model.module is the PeftModel; module is the adapted model inside it, which
        # scores and samples through the adapters like any Hugging Face causal LM.
        self.module = self.ds_model.module.get_base_model() if self.lora is not None else self.ds_model.module
        self.steps_applied = 0
        self.steps_skipped = 0
        self._last_applied = True

    @classmethod
    def from_config(cls, model: Any, tokenizer: Any, config: RunConfig) -> Learner:
        """The RL learner of a run: its ``deepspeed``, ``optim`` and ``algorithm`` sections."""
        return cls(
            model,
            tokenizer,
            config.deepspeed,
            config.optim,
            total_steps=config.trainer.steps,
            loss=config.algorithm,
            temperature=config.env.temperature,
            norm_length=config.env.max_response_tokens,
            lora=config.model.lora,
        )

    def _deepspeed_dict(self) -> dict[str, Any]:
        return deepspeed_config(self.ds_config, self.optim_config, self.precision, self.world_size)

    # ------------------------------------------------------------------ batching

    def micro_batches(self, trajectories: Sequence[Trajectory]) -> list[list[int]]:
        """This rank's batch split in order (lists of consecutive indices) by the padded-token budget.

        STARE's ``micro_batch`` scope selects inside these groups (the trainer asks for them). The
        forward passes run on :meth:`compute_batches`, the same split unless ``bucket_by_length``.
        """
        return split_by_token_budget(trajectories, self.ds_config.micro_batch_tokens, padded=True)

    def compute_batches(self, trajectories: Sequence[Trajectory]) -> list[list[int]]:
        """The micro-batches the forward and backward passes run on. Which trajectories share a
        micro-batch changes the work, not the results:

        - with :attr:`shares_prompts`, the trajectories of one prompt (a GRPO group) form micro-batches
          of their own, whose prompt runs once
          (:func:`~stare_agent.algorithms.logprobs.shared_prompt_logprobs_and_entropy`);
        - the others, with ``deepspeed.bucket_by_length``, go by similar length
          (:func:`~stare_agent.train.batch.bucket_by_length`), else in batch order (:meth:`micro_batches`),
          and with :attr:`shares_prompts` run their common prefix (the system prompt) once;
        - by similar length, a micro-batch is cut again where padding its rows to the longest costs
          more than another pass (a group's one long sample runs alone).
        """
        budget = self.ds_config.micro_batch_tokens
        rest = list(range(len(trajectories)))
        split: list[list[int]] = []
        if self.shares_prompts:
            groups: dict[tuple[int, ...], list[int]] = {}
            for i, t in enumerate(trajectories):
                groups.setdefault(tuple(t.prompt_ids), []).append(i)
            rest = [g[0] for g in groups.values() if len(g) == 1]
            for group in (g for g in groups.values() if len(g) > 1):
                split += [
                    [group[j] for j in m]
                    for m in bucket_by_length([trajectories[i] for i in group], budget, share_prompts=True)
                ]
        if not rest:
            return split
        if self.ds_config.bucket_by_length:
            tail = bucket_by_length(
                [trajectories[i] for i in rest], budget, share_prompts=self.shares_prompts
            )
        else:
            tail = split_by_token_budget([trajectories[i] for i in rest], budget, padded=True)
        return split + [[rest[j] for j in m] for m in tail]

    @property
    def shares_prompts(self) -> bool:
        """Whether the rows of a micro-batch run their common prompt prefix once
        (:func:`~stare_agent.train.batch.shared_prefix_length`): ``deepspeed.share_prompts`` with
        ``score_response_only``, below ZeRO-3 and without gradient checkpointing (which drops caches)."""
        ds = self.ds_config
        return (
            ds.share_prompts
            and ds.score_response_only
            and ds.zero_stage != 3
            and not any(getattr(m, "gradient_checkpointing", False) for m in self.module.modules())
        )

    def _padded_split(self, trajectories: Sequence[Trajectory]) -> list[tuple[list[int], bool]]:
        """Micro-batches plus zero-weight repeats so every rank runs the same count: (indices, real)."""
        split = self.compute_batches(trajectories)
        count = torch.tensor([len(split)], dtype=torch.long, device=self._comm_device)
        if self.world_size > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return [(idx, True) for idx in split] + [(split[0], False)] * (int(count) - len(split))

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.tolist()

    # ------------------------------------------------------------------ forward

    def _forward(self, micro: dict[str, Tensor], with_moments: bool = False) -> tuple[Tensor, ...]:
        """(logp, entropy) [b, l-1] of one collated micro-batch, with gradient through logp (and the
        moments [b, l-1, 2] of ``algorithms.logprobs`` when ``with_moments``)."""
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16-autocast"
        ):
            return self._forward_inner(micro, with_moments)

    def _forward_entropy_grad(self, micro: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(logp, entropy) [b, l-1] with gradient through both, from the model's full logits, for
        an entropy bonus (the chunked pass returns the entropy detached; this one holds
        a micro-batch's [b, l-1, V] logits in float32 at once)."""
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16-autocast"
        ):
            out = self.ds_model(
                input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], use_cache=False
            )
        log_p = torch.log_softmax(out.logits[:, :-1].float() / self.temperature, dim=-1)
        logp = log_p.gather(-1, micro["input_ids"][:, 1:, None]).squeeze(-1)
        return logp, -(log_p.exp() * log_p).sum(-1)

    def _forward_inner(self, micro: dict[str, Tensor], with_moments: bool) -> tuple[Tensor, ...]:
        ids, attention = micro["input_ids"], micro["attention_mask"]
        # Only mask-1 positions are ever read (losses, gate, weights): the rest skip the LM head.
        scored = micro["response_mask"].bool() if self.ds_config.score_response_only else None
        chunk = self.ds_config.logprob_chunk_size
        if self.ds_config.zero_stage == 3:
            # ZeRO-3 partitions the LM head, so score from the logits the model itself computes.
            logits = self.ds_model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
            if scored is None:
                return logprobs_and_entropy_from_logits(
                    logits,
                    ids[:, 1:],
                    chunk_size=chunk,
                    temperature=self.temperature,
                    with_moments=with_moments,
                )
            scores = logprobs_and_entropy_from_logits(
                logits[scored],
                ids[:, 1:][scored],
                chunk_size=chunk,
                temperature=self.temperature,
                with_moments=with_moments,
            )
            return tuple(scatter_scored(values, scored) for values in scores)
        return score_tokens(
            self.module,
            ids,
            attention,
            scored,
            prompt_length=int(micro.get("shared_prompt_length", 0)),
            chunk_size=chunk,
            temperature=self.temperature,
            with_moments=with_moments,
            use_cache=False,
        )

    def _collate(self, trajectories: Sequence[Trajectory], idx: list[int]) -> dict[str, Tensor]:
        rows = [trajectories[i] for i in idx]
        micro = collate(rows, self.pad_id, self.device)
        shared = shared_prefix_length(rows) if self.shares_prompts else 0
        if shared:
            micro["shared_prompt_length"] = torch.tensor(shared)
        return micro

    @torch.no_grad()
    def compute_logprobs_and_entropy(
        self, trajectories: Sequence[Trajectory], *, with_moments: bool = False
    ) -> tuple[Tensor, ...]:
        """Log-probs and full-vocabulary entropies of every scored position under the current policy.

        Returns:
            (logp, entropy), float32 [B, L-1] on the learner's device, aligned with
            ``stare_agent.train.batch.collate(trajectories)`` (column t scores token t + 1); 0 on padding,
            and with ``deepspeed.score_response_only`` (the default) 0 on every mask-0 position too.
            With ``with_moments`` a third tensor [B, L-1, 2], ``(sum_j p_j^2, sum_j p_j^2 log p_j)`` of
            each position (``stare_research.entropy_effect``), from the same forward pass.
        """
        if not trajectories:
            raise ValueError("cannot score an empty batch: pass at least one trajectory")
        B, L = len(trajectories), max(t.num_tokens for t in trajectories)
        logp = torch.zeros(B, L - 1, dtype=torch.float32, device=self.device)
        entropy = torch.zeros_like(logp)
        moments = torch.zeros(B, L - 1, 2, dtype=torch.float32, device=self.device) if with_moments else None
        self.ds_model.eval()
        try:
            for idx, real in self._padded_split(trajectories):
                micro = self._collate(trajectories, idx)
                lp, ent, *mom = self._forward(micro, with_moments)
                if not real:
                    continue
                valid = micro["attention_mask"][:, 1:].bool()
                width = lp.shape[1]
                rows = torch.tensor(idx, device=self.device)
                logp[rows, :width] = torch.where(valid, lp.float(), 0.0)
                entropy[rows, :width] = torch.where(valid, ent.float(), 0.0)
                if moments is not None:
                    moments[rows, :width] = torch.where(valid[..., None], mom[0].float(), 0.0)
        finally:
            self.ds_model.train()
        return (logp, entropy) if moments is None else (logp, entropy, moments)

    # ------------------------------------------------------------------ steps

    def update(
        self,
        trajectories: Sequence[Trajectory],
        advantages: Tensor | Sequence[float],
        weights: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        *,
        rollout_correction: str = "none",
        kl_coef: Tensor | None = None,
        entropy_coef: float = 0.0,
        L_plus: Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the dual-clip policy loss (GRPO-ds; STARE when ``weights`` are given).

        Args:
            trajectories: This rank's batch.
            advantages: One advantage per trajectory (broadcast to its mask-1 tokens) or a
                [B, L-1] per-token tensor aligned with ``collate(trajectories)``.
            weights: STARE token weights [B, L-1] (same alignment), or None for GRPO-ds.
            old_logprobs: Log-probs of the policy that sampled the batch [B, L-1]; None is on-policy
                (``logp.detach()``, so rho = 1, the paper's setting of one step per batch).
            rollout_correction: A mode of ``stare_agent.algorithms.rollout_correction`` (resolved:
                not ``auto``): each model-written token's loss term is multiplied by the detached
                importance weight of the learner's pre-update log-prob against the engine's
                (``Trajectory.logprobs``), with the cap and bounds of the algorithm config.
            kl_coef: KL-Cov's per-token coefficients [B, L-1] (``entropy_control.kl_cov_coefficients``,
                same alignment): ``kl_coef_t * |logp_t - logp_old_t|`` joins the token's loss; None
                adds nothing.
            entropy_coef: This step's entropy-bonus coefficient beta (``Method.entropy_coef``): above 0
                the loss subtracts beta times the token-mean entropy, with its gradient; 0: no bonus.
            L_plus: The tokens STARE amplifies (``Selection.L_plus``, same alignment), for
                ``mismatch/L_plus_abs_logp_mean`` and ``rollout_correction/weight_mean_L_plus``.

        Returns:
            Metrics: ``loss`` (the whole batch's), ``grad_norm``, ``lr``, ``skipped`` (1 when the step
            was dropped for a non-finite loss or gradient), ``micro_batches``, ``tokens``, the loss's
            clip fractions and ``entropy``, the pre-update policy's mean entropy of the mask-1 tokens
            (the gate's Hbar, from this update's own forward pass), token-weighted over the batch
            on all ranks; ``mismatch/*``, the gap between the engine's log-probs and the learner's
            pre-update ones (``rollout_correction.mismatch_metrics``), and ``rollout_correction/*``.
        """
        if self.loss_config is None:
            raise RuntimeError(
                "this learner was built without an algorithm section: pass loss=AlgorithmConfig()"
            )
        cfg = self.loss_config
        if not trajectories:
            raise ValueError("cannot take a step on an empty batch: pass at least one trajectory")
        B, L = len(trajectories), max(t.num_tokens for t in trajectories)
        advantages = _token_advantages(advantages, B, L, self.device)
        _check_shapes(
            (B, L - 1),
            advantages=advantages,
            weights=weights,
            old_logprobs=old_logprobs,
            kl_coef=kl_coef,
            L_plus=L_plus,
        )
        denominators = self._global_denominators(trajectories)
        rc = cfg.rollout_correction
        mismatch: dict[tuple[int, ...], dict[str, float]] = {}  # per micro-batch; a repeat rewrites its own
        plus_weights: dict[tuple[int, ...], tuple[float, float]] = {}  # (sum, count) of the correction on L+
        bonus, beta = entropy_coef > 0, entropy_coef

        def micro_loss(micro: dict[str, Tensor], idx: list[int]) -> tuple[Tensor, dict[str, float]]:
            logp, entropy = self._forward_entropy_grad(micro) if bonus else self._forward(micro)
            width = logp.shape[1]
            rows = torch.tensor(idx, device=self.device)

            def take(t: Tensor) -> Tensor:
                return t.to(self.device)[rows, :width].to(logp.dtype)

            old = take(old_logprobs) if old_logprobs is not None else logp.detach()
            mask = micro["response_mask"]
            sampler_logp = micro["old_logprobs"].to(self.device)[:, :width]  # the engine's
            w = take(weights) if weights is not None else None
            l_plus = take(L_plus).bool() if L_plus is not None else None  # STARE's amplified tokens
            # The engine is compared with the learner's pre-update policy (decoupled PPO's proximal
            # policy, the ratio's `old`), not with the policy after this step's earlier mini-batches.
            mismatch[tuple(idx)] = mismatch_sums(old, sampler_logp, mask, l_plus)
            correction: dict[str, float] = {}
            if rollout_correction != "none":
                c, correction = correction_weights(
                    old, sampler_logp, mask, mode=rollout_correction, **rc.options()
                )
                if l_plus is not None:  # STARE's L+ is high-surprisal, where the engine's ratio runs low
                    on_plus = l_plus & mask.bool()
                    plus_weights[tuple(idx)] = (float(c[on_plus].double().sum()), float(on_plus.sum()))
                w = c if w is None else w * c
            raw, metrics = policy_loss(
                logp,
                old,
                take(advantages),
                mask,
                w,
                eps_low=cfg.eps_low,
                eps_high=cfg.eps_high,
                clip_c=cfg.clip_c,
                agg=cfg.loss_agg,  # type: ignore[arg-type]
                norm_length=self.norm_length,
                kl_coef=take(kl_coef) if kl_coef is not None else None,
                entropy=entropy if bonus else None,
                entropy_coef=beta,
            )
            n = mask.sum()
            scored = torch.where(mask.bool(), entropy.detach().double(), 0.0).sum()
            metrics["entropy"] = float(scored / n) if n > 0 else 0.0
            metrics.update(correction)
            return raw * self._loss_scale(mask, denominators), metrics

        out = self._step(trajectories, micro_loss)
        if "rollout_correction/seq_rejected" in out:  # of the batch's sequences on all ranks
            out["rollout_correction/seq_rejected_frac"] = out["rollout_correction/seq_rejected"] / max(
                denominators["seqs"], 1.0
            )
        out.update(self._mismatch_metrics(list(mismatch.values())))
        if L_plus is not None and rollout_correction != "none":
            total, count = self._all_reduce(
                [sum(v[0] for v in plus_weights.values()), sum(v[1] for v in plus_weights.values())]
            )
            if count:  # STARE with its gate on
                out["rollout_correction/weight_mean_L_plus"] = total / count
        return out

    def _mismatch_metrics(self, parts: list[dict[str, float]]) -> dict[str, float]:
        """``mismatch_metrics`` of the micro-batches' ``mismatch_sums``, added up over all ranks."""
        keys = sorted(k for k in parts[0] if k != "abs_max")
        totals = dict(zip(keys, self._all_reduce([sum(p[k] for p in parts) for k in keys]), strict=True))
        totals["abs_max"] = self._all_reduce([max(p["abs_max"] for p in parts)], op=dist.ReduceOp.MAX)[0]
        return mismatch_metrics(totals)

    def sft_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step of masked NLL: ``-sum mask_t * logp_t / sum mask_t`` over the whole batch.

        Only mask-1 tokens (what the model writes) count; prompt, tool output, template glue and
        padding never reach the loss.
        """
        denominators = self._global_denominators(trajectories)

        def micro_loss(micro: dict[str, Tensor], idx: list[int]) -> tuple[Tensor, dict[str, float]]:
            logp, _ = self._forward(micro)
            mask = micro["response_mask"].to(logp.dtype)
            nll = -(torch.where(mask.bool(), logp, 0.0) * mask).sum()
            return nll * self.world_size / max(denominators["tokens"], 1.0), {}

        out = self._step(trajectories, micro_loss)
        out["lr"] = self.advance_schedule()
        return out

    def advance_schedule(self) -> float:
        """End an update (an RL trainer step, whatever its optimizer steps, or an SFT step): the
        learning-rate schedule steps once if any of its optimizer steps was applied
        (``ScheduleByUpdate``). Returns the learning rate after it, the one a step's ``lr`` logs."""
        self.scheduler.advance()
        return float(self.scheduler.get_last_lr()[0])

    @torch.no_grad()
    def sft_loss(self, trajectories: Sequence[Trajectory]) -> float:
        """The masked NLL of :meth:`sft_step` without a step (e.g. a validation loss), over all ranks."""
        logp, _ = self.compute_logprobs_and_entropy(trajectories)
        mask = collate(trajectories, self.pad_id, self.device)["response_mask"]
        nll, tokens = self._all_reduce([float(-(logp * mask).sum()), float(mask.sum())])
        return nll / max(tokens, 1.0)

    def _global_denominators(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        tokens = sum(t.num_sampled_tokens for t in trajectories)
        seqs = sum(1 for t in trajectories if t.num_sampled_tokens > 0)
        total_tokens, total_seqs = self._all_reduce([float(tokens), float(seqs)])
        return {"tokens": total_tokens, "seqs": total_seqs}

    def _loss_scale(self, mask: Tensor, denominators: dict[str, float]) -> float:
        """Factor turning policy_loss's micro-batch value into its share of the whole batch's loss.

        policy_loss divides by the micro-batch's own denominator d_m (tokens, or sequences with a
        mask-1 token, or the constant norm_length); the batch loss divides by the global D and
        DeepSpeed averages over R ranks, so the factor is d_m * R / D.
        """
        agg = self.loss_config.loss_agg  # type: ignore[union-attr]
        R = self.world_size
        if agg == "token-mean":
            return float(mask.sum()) * R / max(denominators["tokens"], 1.0)
        if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
            d_m = max(int((mask.sum(dim=-1) > 0).sum()), 1)
            return d_m * R / max(denominators["seqs"], 1.0)
        return float(R)  # seq-mean-token-sum-norm: a constant divisor already

    def _step(self, trajectories: Sequence[Trajectory], micro_loss: Any) -> dict[str, float]:
        """Accumulate ``micro_loss`` over the micro-batches and take one optimizer step (or skip it)."""
        if not trajectories:
            raise ValueError("cannot take a step on an empty batch: pass at least one trajectory")
        split = self._padded_split(trajectories)
        total_loss = 0.0
        finite = True
        weighted: dict[str, float] = {}
        tokens = 0.0
        for i, (idx, real) in enumerate(split):
            self.ds_model.set_gradient_accumulation_boundary(i == len(split) - 1)
            micro = self._collate(trajectories, idx)
            loss, metrics = micro_loss(micro, idx)
            for key in metrics:  # the same keys on every rank, for the all-reduce below
                weighted.setdefault(key, 0.0)
            if not real:
                loss = loss * 0.0
            if not torch.isfinite(loss.detach()).all():
                finite = False
                # Poison the gradients so that every path (ours and ZeRO's overflow check) drops the step.
                loss = loss.detach().nan_to_num(0.0) + float("nan") * loss
            else:
                total_loss += float(loss.detach())
            self.ds_model.backward(loss)
            if real:
                n = float(micro["response_mask"].sum())
                tokens += n
                for key, value in metrics.items():
                    weighted[key] = weighted.get(key, 0.0) + (value if key in SUMMED_METRICS else value * n)
        finite = self._all_reduce([0.0 if finite else 1.0])[0] == 0.0
        keys = sorted(weighted)
        loss_sum, tokens_sum, *sums = self._all_reduce([total_loss, tokens, *(weighted[k] for k in keys)])
        grad_norm = self._apply_or_skip(finite)
        out = {
            key: value if key in SUMMED_METRICS else value / max(tokens_sum, 1.0)
            for key, value in zip(keys, sums, strict=True)
        }
        out.update(
            loss=loss_sum / self.world_size,
            grad_norm=grad_norm,
            lr=float(self.scheduler.get_last_lr()[0]),
            skipped=float(not self._last_applied),
            micro_batches=float(len(split)),
            tokens=tokens_sum,
        )
        if not self._last_applied:
            logger.warning(
                "skipped a step with a non-finite loss or gradient norm (loss=%s, grad_norm=%s): "
                "parameters unchanged; if this repeats, lower optim.lr or check the rewards/advantages",
                out["loss"],
                grad_norm,
            )
        return out

    def _apply_or_skip(self, finite_loss: bool) -> float:
        """Step when loss and gradient are finite; otherwise drop the gradients. Returns the grad norm."""
        ds_model = self.ds_model
        # ZeRO and bf16 optimizers check overflow themselves
        wrapped = hasattr(ds_model.optimizer, "overflow")
        if not wrapped:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = (
                float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
                if grads
                else 0.0
            )
            if not (finite_loss and math.isfinite(norm)):
                ds_model.zero_grad()
                self._last_applied = False
                self.steps_skipped += 1
                return norm
            ds_model.step()
            self._last_applied = True
            self.steps_applied += 1
            return norm
        ds_model.step()  # a poisoned (NaN) gradient makes DeepSpeed discard the step and its gradients
        self._last_applied = bool(ds_model.was_step_applied()) and finite_loss
        if self._last_applied:
            self.steps_applied += 1
        else:
            self.steps_skipped += 1
        norm = ds_model.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    # ------------------------------------------------------------------ weights and checkpoints

    def _gathered(self) -> Any:
        """Context in which every parameter is whole on every rank (a no-op below ZeRO-3)."""
        if self.ds_config.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` for every parameter, whole (ZeRO-3 gathers one at a time), for engine sync.

        The tensors are the live parameters below ZeRO-3 (an in-process engine sharing this module is
        already in sync); detached copies under ZeRO-3. Under LoRA they are the merged weights under
        the base model's parameter names (what an engine holding a plain copy of the base model
        loads); an in-process engine sharing :attr:`module` samples through the adapters instead and
        needs no sync.
        """
        if self.lora is not None:
            merged = self.state_dict()
            for name in _base_names(self.module.named_parameters()):
                yield name, merged[name]
            return
        if self.ds_config.zero_stage != 3:
            for name, param in self.module.named_parameters():
                yield name, param.detach()
            return
        import deepspeed

        for name, param in self.module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                yield name, param.detach().clone()

    def state_dict(self) -> dict[str, Tensor]:
        """The model's full state dict on CPU (gathered under ZeRO-3), in the training dtype.

        Under LoRA: the merged model's, ``W + (alpha / r) * B A`` under the base model's names.
        """
        with self._gathered(), torch.no_grad():
            if self.lora is not None:
                return _merged_lora_state_dict(self.module)
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def export_hf(self, directory: str | os.PathLike[str]) -> Path:
        """Write the model and tokenizer in Hugging Face format (``from_pretrained``-loadable).

        Under LoRA the model written is the merged one, and the adapters are written in PEFT format
        (``adapter_config.json``, ``adapter_model.safetensors``) in ``directory/adapter``, for
        ``peft.PeftModel.from_pretrained(base_model, directory / "adapter")``.

        Collective: every rank must call it; rank 0 writes. Returns the directory.
        """
        directory = Path(directory)
        state = self.state_dict()
        adapters = None
        if self.lora is not None:
            with self._gathered():
                adapters = {k: v.detach().cpu().clone() for k, v in self.ds_model.module.state_dict().items()}
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.module.save_pretrained(directory, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
            if adapters is not None:
                self.ds_model.module.save_pretrained(directory / ADAPTER_DIRNAME, state_dict=adapters)
        if self.world_size > 1:
            dist.barrier()
        return directory

    def save_checkpoint(
        self, directory: str | os.PathLike[str], client_state: dict[str, Any] | None = None
    ) -> Path:
        """Save model, optimizer and scheduler (DeepSpeed's sharded format) plus ``client_state``.

        Collective. Writes straight into ``directory``; atomicity (write to a temporary directory,
        then rename) is the caller's.
        """
        directory = Path(directory)
        state = dict(client_state or {})
        state["learner"] = {"steps_applied": self.steps_applied, "steps_skipped": self.steps_skipped}
        self.ds_model.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            client_state=state,
            save_latest=True,
            exclude_frozen_parameters=self.lora is not None,  # LoRA: the frozen base is not saved again
        )
        return directory

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimizer and scheduler from :meth:`save_checkpoint`; return the client state.

        Raises:
            FileNotFoundError: ``directory`` holds no learner checkpoint.
        """
        directory = Path(directory)
        if not (directory / CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(
                f"no learner checkpoint in {directory} (expected {directory / CHECKPOINT_TAG}/): "
                "pass a directory written by Learner.save_checkpoint"
            )
        path, client = self.ds_model.load_checkpoint(
            str(directory), tag=CHECKPOINT_TAG, load_module_strict=self.lora is None
        )
        if path is None:
            raise FileNotFoundError(
                f"DeepSpeed could not load the checkpoint in {directory}: it is incomplete"
            )
        client = dict(client or {})
        counters = client.pop("learner", {})
        self.steps_applied = int(counters.get("steps_applied", 0))
        self.steps_skipped = int(counters.get("steps_skipped", 0))
        return client


def _token_advantages(advantages: Tensor | Sequence[float], B: int, L: int, device: torch.device) -> Tensor:
    """``advantages`` as a [B, L-1] tensor: one per trajectory broadcast along its row, or as given."""
    if isinstance(advantages, Tensor) and advantages.dim() != 1:
        return advantages
    per_seq = torch.as_tensor(advantages, dtype=torch.float32, device=device)
    if per_seq.shape != (B,):
        raise ValueError(f"got {per_seq.numel()} advantages for {B} trajectories: pass one per trajectory")
    return per_seq[:, None].expand(B, L - 1)


def _check_shapes(expected: tuple[int, int], **tensors: Tensor | None) -> None:
    """Refuse a per-token tensor not aligned with ``collate(trajectories)`` ([B, L-1])."""
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {expected}: align it with "
                "stare_agent.train.batch.collate(trajectories)"
            )


def _base_names(names: Iterator[tuple[str, Any]]) -> list[str]:
    """Names of a LoRA-adapted model's tensors as the base model names them (adapters left out)."""
    return [name.replace(".base_layer.", ".") for name, _ in names if ".lora_" not in name]


def _merged_lora_state_dict(model: Any) -> dict[str, Tensor]:
    """The state dict of a LoRA-adapted model with every adapter merged into its base layer, on CPU.

    For a LoRA layer with base weight W: ``W + delta``, where ``delta`` is peft's own
    ``get_delta_weight`` (``(alpha / r) * B A``, transposed for fan-in-fan-out layers), summed over the
    active adapters; names lose peft's ``.base_layer`` and the adapters' own tensors are dropped. The
    model itself is left as it is (no in-place merge, whose unmerge would round the base weights).
    """
    from peft.tuners.lora import LoraLayer

    deltas = {
        f"{name}.base_layer.weight": module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        value = value.detach()
        layer = deltas.get(key)
        if layer is not None:
            for adapter in layer.active_adapters:
                # peft's lora.Linear defines it; the LoraLayer mixin the isinstance names does not declare it
                value = value + layer.get_delta_weight(adapter).to(value.dtype)  # type: ignore[attr-defined]
        out[key.replace(".base_layer.", ".")] = value.cpu().clone()
    return out
