"""Issue 31's entropy controls and STARE, paired on the saved batches of one closed-loop run (issue 25 item 6).

Every method trains, from the run's starting weights (the study's SFT model), on the SAME batches: the
episodes the GRPO-ds run of ``configs/closed_loop.yaml`` drew and saved (``trainer.save_rollouts``),
through ``stare-agent replay`` (``stare_research.replay.replay``: the trainer's own learner code). The
baseline is the replay of the run with its own config (GRPO-ds, which repeats the run's learner), in the
same table. Methods (``stare_research.study.VARIANTS``, at their defaults; H_tgt is the run's):
grpo-ds, entropy-bonus, kl-cov, clip-cov, forking-tokens, stare-o1 (W 1.1, the paper's gate on the
kept groups), stare-o1-w3-drawn (W 3, the gate on the whole draw: ours), both with L+ restricted to
the tokens whose reinforcement raises their position's entropy (ours, ``research.L_plus_rule=top_k_raising``),
and both with W on a random subset of T+ of L+'s size instead of L+ (their placebos,
``research.L_plus_rule=random``: STARE minus its placebo is the surprisal selection's share).

What a replay can show: how each learner moves the policy's entropy given the same data, on the
run's sampled tokens (``entropy``: the replayed policy teacher-forced on the run's kept episodes,
off-policy after step 1) and on the held-out bank (``eval/bank_entropy``, at the run's evaluation
steps and the last). What it cannot: reward (no episode is played, so every method's reward column
is the run's), and the closed loop itself (the samples never come from the replayed policy, so a
method's entropy cannot feed back into what it trains on, and the gate reads the replayed policy on
GRPO-ds's samples).

    .venv/bin/python benchmarks/closed_loop_replay.py --run runs/closed_loop/runs/grpo-ds-s0 \\
        --out runs/closed_loop/replay [--steps N] [--methods grpo-ds stare-o1 ...]

Resumable: a method whose replay finished is read, not rerun; an unfinished one is replayed again from
its start (a replay has no checkpoints). ``--table-only`` prints the table of what finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

from stare_agent.metrics import read_metrics
from stare_research.replay import replay, step_files
from stare_research.study import BANK_EVALS, EDGE_STEPS, VARIANTS, run_numbers

METHODS = (
    "grpo-ds",
    "entropy-bonus",
    "kl-cov",
    "clip-cov",
    "forking-tokens",
    "stare-o1",
    "stare-o1-w3-drawn",
    "stare-o1-raising",
    "stare-o1-w3-drawn-raising",
    "stare-o1-placebo",
    "stare-o1-w3-drawn-placebo",
)


def machine() -> str:
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        cpu = platform.processor() or "unknown CPU"
    return f"{cpu}, {os.cpu_count()} cores"


def finished(out: Path, steps: int) -> bool:
    if not (out / "metrics.jsonl").is_file():
        return False
    records = read_metrics(out)
    return bool(records) and records[-1]["step"] >= steps


def run_method(run: Path, out_root: Path, method: str, steps: int) -> None:
    out = out_root / method
    if finished(out, steps):
        print(f"[{method}] finished earlier: {out}", flush=True)
        return
    if out.exists():  # an interrupted replay: no checkpoints, so again from the start
        shutil.rmtree(out)
    t0 = time.perf_counter()
    print(f"[{method}] replaying {steps} steps of {run} with {' '.join(VARIANTS[method])}", flush=True)
    replay(run, out, list(VARIANTS[method]), steps=steps)
    gc.collect()
    print(f"[{method}] {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)


def table(run: Path, out_root: Path, methods: list[str], steps: int) -> str:
    ran = run_numbers(read_metrics(run)[:steps])
    rows = [
        "| method | steps | sampled-token entropy, first 5 | sampled-token entropy, last 5 | "
        f"bank entropy, last {BANK_EVALS} evals | - GRPO-ds's replay | bank entropy, each eval | gate on | "
        "s/step (median) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    baseline = out_root / "grpo-ds"
    base_bank = (
        run_numbers(read_metrics(baseline)).get("bank_entropy_late")
        if (baseline / "metrics.jsonl").is_file()
        else None
    )
    for method in methods:
        out = out_root / method
        if not (out / "metrics.jsonl").is_file():
            rows.append(f"| {method} | - | not run | | | | | | |")
            continue
        records = read_metrics(out)
        n = run_numbers(records)
        bank = ", ".join(
            f"{r['step']}: {r['eval/bank_entropy']:.4f}" for r in records if "eval/bank_entropy" in r
        )

        def cell(key: str, digits: int = 4, n=n) -> str:
            return f"{n[key]:.{digits}f}" if key in n else "-"

        late = n.get("bank_entropy_late")
        diff = "-" if late is None or base_bank is None or method == "grpo-ds" else f"{late - base_bank:+.4f}"
        rows.append(
            f"| {method} | {records[-1]['step']} | {cell('entropy_early')} | {cell('entropy_late')} | "
            f"{cell('bank_entropy_late')} | {diff} | {bank} | {cell('gate_on', 2)} | {cell('seconds_per_step', 1)} |"
        )
    starts = run.parent.parent / "start_eval.json"
    start = json.loads(starts.read_text()).get("0", {}).get("eval/bank_entropy") if starts.is_file() else None
    head = (
        f"Replays of {run} (first {steps} steps), {machine()}, load average {os.getloadavg()[0]:.1f} at the end. "
        f"Reward on these batches (the run's, the same for every method): {ran.get('reward', float('nan')):.3f} "
        f"(mean over steps). The run itself: sampled-token entropy first/last {EDGE_STEPS} steps "
        f"{ran.get('entropy_early', float('nan')):.4f} / {ran.get('entropy_late', float('nan')):.4f}, "
        f"bank entropy last {BANK_EVALS} evals {ran.get('bank_entropy_late', float('nan')):.4f}"
        + (f"; the start's bank entropy {start:.4f}." if start is not None else ".")
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the GRPO-ds run of the closed-loop study")
    ap.add_argument("--out", type=Path, required=True, help="one replay directory per method under it")
    ap.add_argument("--steps", type=int, default=None, help="replay only the first N saved steps")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--table-only", action="store_true", help="replay nothing: the table of what finished")
    args = ap.parse_args()
    steps = len(step_files(args.run, args.steps))
    if not args.table_only:
        for method in args.methods:
            run_method(args.run, args.out, method, steps)
    text = table(args.run, args.out, args.methods, steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
