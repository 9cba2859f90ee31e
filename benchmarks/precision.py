"""What ``deepspeed.precision=bf16-autocast`` (the quickstart's) costs on a CPU without native bf16, before
and after the learner picks fp32 there; side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/precision.py             # 8 RL trajectories, 3 repeats
    flock /tmp/bench.lock .venv/bin/python benchmarks/precision.py --quick     # 4 trajectories, 1 repeat

A CPU without AVX-512 BF16 or AMX is played by capping oneDNN below them (``ONEDNN_MAX_CPU_ISA``, which
``stare_agent.config.cpu_has_bf16`` reads); each variant is its own process (the cap is read once, at
start), the variants interleaved repeat by repeat so that load drifts hit all alike:

- ``before, CAP``: capped, bf16-autocast as the learner ran it before (emulated bf16);
- ``after, CAP``: capped, bf16-autocast asked, what the learner runs now (``resolve_precision``: fp32);
- ``native``: uncapped, bf16-autocast (only where this CPU has native bf16; the reference).

The caps: ``AVX2`` (a CPU without AVX-512, the issue's kind) and ``AVX512_CORE`` (AVX-512 without its
BF16 extension).

Each process times one RL update (``Learner.update``: the embedded SmolLM2-135M, the quickstart's
settings, synthetic trajectories shaped like the quickstart's: ``benchmarks/learner_speed.py``) after a
warm-up update, and prints the precision the learner resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # learner_speed, beside this script

CAPS = ("AVX2", "AVX512_CORE")  # a CPU without AVX-512 at all; AVX-512 without its BF16 extension


def worker(trajectories: int, force_bf16: bool) -> None:
    """One timed RL update in this process; prints a JSON line."""
    import time

    from learner_speed import make_learner, rl_batch

    import stare_agent.config

    if force_bf16:  # the learner before: bf16-autocast whatever the CPU
        stare_agent.config.cpu_has_bf16 = lambda: True  # type: ignore[assignment]
    learner = make_learner("bf16-autocast")
    batch = rl_batch(trajectories)
    advantages = [1.0 if t.reward else -1.0 for t in batch]
    learner.update(batch[:2], advantages[:2])  # warm-up: first-call allocations, oneDNN kernels
    start = time.perf_counter()
    learner.update(batch, advantages)
    seconds = time.perf_counter() - start
    print(json.dumps({"precision": learner.precision, "seconds": seconds}))


def run_variant(cap: str | None, force_bf16: bool, trajectories: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if cap is not None:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    args = [sys.executable, __file__, "--worker", "--trajectories", str(trajectories)]
    done = subprocess.run(
        [*args, *(["--force-bf16"] if force_bf16 else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 trajectories, 1 repeat")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--force-bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.trajectories, args.force_bf16)
        return
    if args.quick:
        args.trajectories, args.repeats = 4, 1

    from learner_speed import load_note

    from stare_agent.config import cpu_has_bf16
    from stare_agent.provenance import machine

    print(f"machine: {machine()}; {load_note()}")
    variants: dict[str, tuple[str | None, bool]] = {}
    for cap in CAPS:
        variants[f"before, {cap}"] = (cap, True)
        variants[f"after, {cap}"] = (cap, False)
    if cpu_has_bf16():
        variants["native"] = (None, False)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    precision: dict[str, str] = {}
    for _ in range(args.repeats):
        for name, (cap, force) in variants.items():
            result = run_variant(cap, force, args.trajectories)
            seconds[name].append(result["seconds"])
            precision[name] = result["precision"]
    print(
        f"\nRL update of {args.trajectories} trajectories, embedded SmolLM2-135M, quickstart settings "
        f"(bf16-autocast asked), median of {args.repeats}; ratios against the same cap's 'before'"
    )
    print(f"| {'variant':<20} | {'learner computes in':<20} | {'s / update':>10} | {'speed-up':>8} |")
    print(f"|{'-' * 22}|{'-' * 22}|{'-' * 12}|{'-' * 10}|")
    for name, (cap, _) in variants.items():
        median = statistics.median(seconds[name])
        before = statistics.median(seconds[f"before, {cap}"]) if cap else median
        ratio = f"{before / median:7.1f}x" if cap else "      --"
        print(f"| {name:<20} | {precision[name]:<20} | {median:10.2f} | {ratio} |")


if __name__ == "__main__":
    main()
