"""The learner's side of an RL step and of SFT on CPU: the old path and the new one, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/learner_speed.py             # quickstart's RL batch
    flock /tmp/bench.lock .venv/bin/python benchmarks/learner_speed.py --quick     # 8 trajectories, 1 repeat

The model is the embedded SmolLM2-135M-Instruct with its tokenizer, the settings those of
``configs/quickstart.yaml`` (bf16-autocast, micro_batch_tokens 4096). Batches are synthetic but shaped
like the quickstart's: RL trajectories of a 300-400-token prompt and 60-140 sampled tokens, in groups of
4 samples of one prompt (32 of them, what one step of 4 prompts x 4 samples x up to 2 draws trains
on); SFT traces of a 250-350-token
prompt and three model turns separated by interpreter output (mask 0), 450-1000 tokens in all,
8 per optimizer step.

1. RL: the pre-update log-prob/entropy pass and the update (one optimizer step), old path
   (``deepspeed.score_response_only=false deepspeed.bucket_by_length=false deepspeed.share_prompts=false``)
   vs new (the defaults: all three true).
2. SFT: one ``sft_step`` in tokens/s (prompt and tool tokens included, padding not), padded in batch
   order vs bucketed by length with the head on the scored tokens only, in fp32 and in bf16-autocast.

Medians over repeats; the variants of a section are interleaved so that load drifts hit all alike,
and the parameters are restored after every step. The machine (CPU model, cores, load average) is
printed with the table: on a shared machine the seconds move with the load, the ratios much less.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from stare_agent.config import load_config
from stare_agent.models import load_policy
from stare_agent.provenance import machine
from stare_agent.train.learner import Learner
from stare_envs.trajectory import Trajectory, TrajectoryBuilder

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
OLD = {"score_response_only": False, "bucket_by_length": False, "share_prompts": False}
NEW = {"score_response_only": True, "bucket_by_length": True, "share_prompts": True}


def load_note() -> str:
    one, five, _ = os.getloadavg()
    cores = os.cpu_count() or 1
    state = "SHARED/LOADED" if one > 0.5 * cores else "quiet"
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {cores} cores: {state}"


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 40000) for _ in range(n)]


def rl_batch(n: int, group: int = 4, seed: int = 0) -> list[Trajectory]:
    """n trajectories in groups of ``group`` samples of one prompt (GRPO), as the trainer gives them."""
    rng = random.Random(seed)
    out = []
    prompt: list[int] = []
    for i in range(n):
        if i % group == 0:
            prompt = _ids(rng, rng.randint(300, 400))
        b = TrajectoryBuilder(prompt)
        r = rng.randint(60, 140)
        b.append(_ids(rng, r), 1, [-1.0] * r)
        out.append(b.build(reward=float(i % 2)))
    return out


def sft_batch(n: int, seed: int = 1) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = TrajectoryBuilder(_ids(rng, rng.randint(250, 350)))
        for turn in range(3):
            k = rng.randint(50, 180)
            b.append(_ids(rng, k), 1, [0.0] * k)
            if turn < 2:
                b.append(_ids(rng, rng.randint(20, 100)), 0)  # interpreter output
        out.append(b.build(reward=1.0))
    return out


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(
    learner: Learner,
    variants: dict[str, dict[str, bool]],
    jobs: dict[str, Callable[[], object]],
    repeats: int,
) -> dict[tuple[str, str], float]:
    """Median seconds of every (variant, job); variants interleaved, parameters restored after each job."""
    start = {k: v.clone() for k, v in learner.module.state_dict().items()}
    times: dict[tuple[str, str], list[float]] = {(v, j): [] for v in variants for j in jobs}
    for _ in range(repeats):
        for variant, switches in variants.items():
            for name, value in switches.items():
                setattr(learner.ds_config, name, value)
            for job, fn in jobs.items():
                times[variant, job].append(timed(fn))
                learner.module.load_state_dict(start)
    return {key: statistics.median(v) for key, v in times.items()}


def work(learner: Learner, trajectories: list[Trajectory], switches: dict[str, bool]) -> tuple[int, int]:
    """(token positions through the backbone, padding included; rows through the LM head) of one pass."""
    for name, value in switches.items():
        setattr(learner.ds_config, name, value)
    backbone = head = 0
    for idx in learner.compute_batches(trajectories):
        rows = [trajectories[i] for i in idx]
        width = max(t.num_tokens for t in rows)
        shared = (
            learner.shares_prompts and len(rows) > 1 and all(t.prompt_ids == rows[0].prompt_ids for t in rows)
        )
        prefix = len(rows[0].prompt_ids) - 1 if shared else 0
        backbone += prefix + len(rows) * (width - prefix)
        head += (
            sum(t.num_sampled_tokens for t in rows)
            if switches["score_response_only"]
            else len(rows) * (width - 1)
        )
    return backbone, head


def print_work(learner: Learner, rl: list[Trajectory], sft: list[Trajectory]) -> None:
    print("\nwork per pass (counted, not timed: the same on any machine)")
    print(
        f"| {'batch':<28} | {'backbone tokens old':>19} | {'new':>7} | {'LM-head rows old':>16} | {'new':>7} |"
    )
    print(f"|{'-' * 30}|{'-' * 21}|{'-' * 9}|{'-' * 18}|{'-' * 9}|")
    for name, batch in ((f"RL, {len(rl)} trajectories", rl), (f"SFT, {len(sft)} traces", sft)):
        (b_old, h_old), (b_new, h_new) = work(learner, batch, OLD), work(learner, batch, NEW)
        print(f"| {name:<28} | {b_old:19d} | {b_new:7d} | {h_old:16d} | {h_new:7d} |")
    work(learner, rl, NEW)


def make_learner(precision: str) -> Learner:
    config = load_config(CONFIG, [f"deepspeed.precision={precision}"])
    model, tokenizer = load_policy(config.model.name_or_path)
    return Learner.from_config(model, tokenizer, config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32, help="RL batch size (default 32)")
    parser.add_argument("--sft-batch", type=int, default=8, help="SFT traces per step (default 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 trajectories, 4 SFT traces, 1 repeat")
    parser.add_argument("--skip-fp32", action="store_true", help="SFT in bf16-autocast only")
    parser.add_argument(
        "--work-only", action="store_true", help="count the work of old and new, time nothing"
    )
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.sft_batch, args.repeats = 8, 4, 1
    torch.manual_seed(0)
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}")
    print(f"before: {load_note()}")

    rl = rl_batch(args.trajectories)
    sft = sft_batch(args.sft_batch)
    rl_tokens = sum(t.num_tokens for t in rl)
    sft_tokens = sum(t.num_tokens for t in sft)
    advantages = [1.0 if t.reward else -1.0 for t in rl]
    if args.work_only:
        print_work(make_learner("bf16-autocast"), rl, sft)
        return

    sft_times: dict[tuple[str, str], float] = {}

    def bench_sft(precision: str, learner: Learner) -> None:
        jobs = {"sft": lambda: learner.sft_step(sft)}
        times = bench(learner, {"padded": OLD, "new": NEW}, jobs, args.repeats)
        sft_times.update({(precision, variant): t for (variant, _), t in times.items()})

    def bench_bf16() -> dict[tuple[str, str], float]:
        learner = make_learner("bf16-autocast")
        learner.compute_logprobs_and_entropy(rl[:2])  # warm-up (first-call allocations)
        jobs = {
            "log-prob pass": lambda: learner.compute_logprobs_and_entropy(rl),
            "update": lambda: learner.update(rl, advantages),
        }
        rl_times = bench(learner, {"old": OLD, "new": NEW}, jobs, args.repeats)
        bench_sft("bf16-autocast", learner)
        return rl_times

    rl_times = bench_bf16()
    if not args.skip_fp32:
        bench_sft("fp32", make_learner("fp32"))

    mean_prompt = statistics.mean(len(t.prompt_ids) for t in rl)
    mean_response = statistics.mean(len(t.response_ids) for t in rl)
    print(
        f"\nRL batch: {len(rl)} trajectories, prompt {mean_prompt:.0f} + response {mean_response:.0f} tokens "
        f"on average ({rl_tokens} tokens, 4 samples per prompt), bf16-autocast, micro_batch_tokens 4096, "
        f"medians of {args.repeats}"
    )
    print(
        f"| {'RL learner':<22} | {'old path (s)':>12} | {'new path (s)':>12} | {'new tokens/s':>12} | {'speed-up':>8} |"
    )
    print(f"|{'-' * 24}|{'-' * 14}|{'-' * 14}|{'-' * 14}|{'-' * 10}|")
    total_old = total_new = 0.0
    for job in ("log-prob pass", "update"):
        old, new = rl_times["old", job], rl_times["new", job]
        total_old, total_new = total_old + old, total_new + new
        print(f"| {job:<22} | {old:12.2f} | {new:12.2f} | {rl_tokens / new:12.0f} | {old / new:7.2f}x |")
    print(
        f"| {'log-prob + update':<22} | {total_old:12.2f} | {total_new:12.2f} | "
        f"{rl_tokens / total_new:12.0f} | {total_old / total_new:7.2f}x |"
    )
    print(
        f"\nSFT step: {len(sft)} traces, {sft_tokens} tokens ({sum(t.num_sampled_tokens for t in sft)} "
        f"model-written), tokens/s (median of {args.repeats})"
    )
    print(
        f"| {'SFT tokens/s':<15} | {'padded, batch order':>19} | {'bucketed, scored only':>21} | {'speed-up':>8} |"
    )
    print(f"|{'-' * 17}|{'-' * 21}|{'-' * 23}|{'-' * 10}|")
    for precision in ("fp32", "bf16-autocast"):
        if (precision, "padded") not in sft_times:
            continue
        padded, bucketed = sft_times[precision, "padded"], sft_times[precision, "new"]
        print(
            f"| {precision:<15} | {sft_tokens / padded:19.0f} | {sft_tokens / bucketed:21.0f} | "
            f"{padded / bucketed:7.2f}x |"
        )
    print_work(make_learner("fp32") if args.skip_fp32 else make_learner("bf16-autocast"), rl, sft)
    print(f"\nafter: {load_note()}")


if __name__ == "__main__":
    main()
