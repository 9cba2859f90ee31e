"""bf16-autocast against fp32 gradients of the learner's loss on real batches: GRPO-ds's, and C2's lever.

Why: on the draws of the study's higher-entropy start, the learner's gradient norms under bf16-autocast
(the default on a CPU with native bf16) differed from fp32's by 4-19 % (docs/research/study.md, the
placebo's result). A norm says little about the direction an optimizer follows, and the one-step
research numbers rest on a small difference of two gradients (C2's lever: M on L- minus GRPO-ds). This
measures both, from the same weights and the same batches, side by side in one run:

- ``grpo``: the gradient of GRPO-ds's loss (``Learner.update`` with no weights) in each precision: the
  norm (the learner's, before clipping), the cosine between the bf16-autocast and fp32 gradients, and
  ``|g_bf16 - g_fp32| / |g_fp32|``;
- ``lever``: C2's lever, the gradient with M (0.9) on L- minus GRPO-ds's (L- as ``stare_weights`` selects
  it from the fp32 log-probs, the same weights in both precisions): its norm in each precision and the
  cosine between them.

Two learners (``Learner.from_config`` of the run's config, one at ``deepspeed.precision=fp32``, one at
``bf16-autocast``) on two copies of the start's weights; each ``update`` is taken with the optimizer's
step replaced by a capture of the gradients it would apply (after clipping at ``optim.grad_clip``, a
uniform scale that leaves cosines alone), so the weights never move. Statistics: per batch, and the median
and range over the batches (one start, one run's batches: they cover no other start or seed).

Run (one heavy job at a time; needs a CPU with native bf16, AVX-512 BF16 or AMX):
``flock /tmp/bench.lock .venv/bin/python benchmarks/precision_gradients.py --from-run runs/closed_loop_sft48/runs/draws``
(a run of a study's config, e.g. the lr = 1e-30 draws run of docs/research/study.md; ``--quick``: the tiny
random model on made-up batches, a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.adam_lever import machine_line, quick_data, run_batches  # noqa: E402


def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """``<a, b>`` over parameter lists, each product summed in float64."""
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The cosine between two parameter-list vectors (NaN when either is 0)."""
    na, nb = math.sqrt(dot(a, a)), math.sqrt(dot(b, b))
    return dot(a, b) / (na * nb) if na and nb else math.nan


def minus(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x - y for x, y in zip(a, b, strict=True)]


def compare_gradients(
    g32: list[torch.Tensor], g16: list[torch.Tensor], c32: list[torch.Tensor], c16: list[torch.Tensor]
) -> dict[str, float]:
    """One batch's comparison: GRPO-ds's gradients ``g`` and C2's ``c`` in fp32 (``32``) and bf16-autocast
    (``16``); the lever is ``c - g`` in each precision."""
    lever32, lever16 = minus(c32, g32), minus(c16, g16)
    n32 = math.sqrt(dot(g32, g32))
    return {
        "grpo_cos": cosine(g16, g32),
        "grpo_rel_diff": math.sqrt(dot(minus(g16, g32), minus(g16, g32))) / n32 if n32 else math.nan,
        "lever_norm_fp32": math.sqrt(dot(lever32, lever32)),
        "lever_norm_bf16": math.sqrt(dot(lever16, lever16)),
        "lever_cos": cosine(lever16, lever32),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-run", type=Path, help="a run directory (trainer.run_dir) of a study's config")
    parser.add_argument("--batches", type=int, default=8, help="kept batches measured, from the run's first")
    parser.add_argument("--M", type=float, default=0.9, help="C2's attenuation of L-")
    parser.add_argument("--quick", action="store_true", help="the tiny random model on made-up batches")
    args = parser.parse_args(argv)
    if not args.quick and args.from_run is None:
        parser.error("pass --from-run RUN (a study run's directory) or --quick")
    if args.batches < 1:
        parser.error(f"--batches {args.batches} must be >= 1")

    from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages
    from stare_agent.algorithms.stare import stare_weights
    from stare_agent.config import CONFIG_FILENAME, cpu_has_bf16
    from stare_agent.train.batch import collate
    from stare_agent.train.learner import Learner
    from stare_research.config import load_research_config

    if not cpu_has_bf16():
        raise SystemExit("this CPU has no native bf16 (AVX-512 BF16 or AMX): bf16-autocast is emulated here")
    t0 = time.time()
    if args.quick:
        from stare_agent.models import tiny_model

        config = load_research_config(None, ["optim.lr=1e-30", "algorithm.rollout_correction.mode=none"])
        model, tok = tiny_model()
        data, _ = quick_data(tok, args.batches)
    else:
        from stare_agent.train.deepspeed_setup import load_training_policy

        config_file = args.from_run / CONFIG_FILENAME
        if not config_file.is_file():
            raise SystemExit(f"--from-run {args.from_run}: no {CONFIG_FILENAME}: pass a run directory")
        config = load_research_config(config_file)
        data = run_batches(args.from_run)
        model, tok = load_training_policy(config)
    data = data[: args.batches]
    if not data:
        raise SystemExit(f"--from-run {args.from_run}: no kept batch saved in the run")

    learners: dict[str, Any] = {}
    captured: dict[str, list[torch.Tensor]] = {}
    for precision in ("fp32", "bf16-autocast"):
        policy = model if precision == "bf16-autocast" else copy.deepcopy(model)  # the same start weights
        run_config = dataclasses.replace(
            config, deepspeed=dataclasses.replace(config.deepspeed, precision=precision)
        )
        learner = Learner.from_config(policy, tok, run_config)
        params = [p for p in learner.module.parameters() if p.requires_grad]

        def capture(*_: Any, _params: list[torch.Tensor] = params, _name: str = precision, **__: Any) -> None:
            # the step is not taken; a weight the loss does not reach has no gradient: 0
            captured[_name] = [
                torch.zeros_like(p, dtype=torch.float32)
                if p.grad is None
                else p.grad.detach().float().clone()
                for p in _params
            ]

        learner.ds_model.optimizer.step = capture  # type: ignore[method-assign]
        learners[precision] = learner
    print(f"{machine_line()}; start {config.model.name_or_path}; {len(data)} batches", flush=True)

    def gradient(precision: str, batch: dict[str, Any], A: torch.Tensor, w: torch.Tensor | None) -> tuple:
        out = learners[precision].update(batch["episodes"], A, weights=w)
        return captured.pop(precision), out["grad_norm"]

    rows = []
    for batch in data:
        A = grpo_advantages(batch["rewards"], group_index=batch["group_index"])[0]
        fp32 = learners["fp32"]
        logp, _ = fp32.compute_logprobs_and_entropy(batch["episodes"])
        mask = collate(batch["episodes"], fp32.pad_id)["response_mask"].to(logp.device)
        alg = config.algorithm
        split = fp32.micro_batches(batch["episodes"]) if alg.scope == "micro_batch" else None
        w_c2, _, L_minus, _ = stare_weights(
            broadcast_to_tokens(A.to(logp.device), mask), logp, mask, gate_on=True, variant="C2",
            P=alg.P, W=1.0, M=args.M, scope=alg.scope, micro_batches=split,  # type: ignore[arg-type]
            sequence_ids=batch["sequence_ids"],
        )  # fmt: skip
        g32, norm32 = gradient("fp32", batch, A, None)
        c32, _ = gradient("fp32", batch, A, w_c2)
        g16, norm16 = gradient("bf16-autocast", batch, A, None)
        c16, _ = gradient("bf16-autocast", batch, A, w_c2)
        row = {
            "step": batch["step"],
            "tokens": int(mask.sum()),
            "L_minus": int(L_minus.sum()),
            "grad_norm_fp32": norm32,
            "grad_norm_bf16": norm16,
            **compare_gradients(g32, g16, c32, c16),
        }
        rows.append(row)
        print(f"[{time.time() - t0:6.0f}s] step {row['step']}: {row}", flush=True)
    print(table(rows))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The per-batch table and a median (range) line."""
    cols = (
        ("step", "{:d}"),
        ("tokens", "{:d}"),
        ("L_minus", "{:d}"),
        ("grad_norm_fp32", "{:.4f}"),
        ("grad_norm_bf16", "{:.4f}"),
        ("grpo_cos", "{:.4f}"),
        ("grpo_rel_diff", "{:.3f}"),
        ("lever_norm_fp32", "{:.3g}"),
        ("lever_norm_bf16", "{:.3g}"),
        ("lever_cos", "{:.4f}"),
    )
    lines = [
        "| " + " | ".join(name for name, _ in cols) + " |",
        "|" + "---:|" * len(cols),
    ]
    for r in rows:
        lines.append("| " + " | ".join(spec.format(r[name]) for name, spec in cols) + " |")
    summary = []
    for name, spec in cols[3:]:
        xs = sorted(r[name] for r in rows)
        summary.append(f"{spec.format(xs[len(xs) // 2])} ({spec.format(xs[0])}-{spec.format(xs[-1])})")
    lines.append("| median (range) | | | " + " | ".join(summary) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
