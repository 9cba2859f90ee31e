"""The learner's step with 1, 2 and 4 PPO mini-batches, side by side in one run: seconds and peak memory.

    flock /tmp/bench.lock .venv/bin/python benchmarks/learner_minibatches.py            # 3 repeats
    flock /tmp/bench.lock .venv/bin/python benchmarks/learner_minibatches.py --quick    # 16 trajectories, 1 repeat

One step's learner work (``Trainer.learn``: advantages, the pre-update pass, the selection, the
optimizer steps) on the quickstart's batch shape (``benchmarks/learner_speed.rl_batch``: 32 trajectories,
8 groups of 4 samples, 300-400-token prompts and 60-140 sampled tokens) with the embedded
SmolLM2-135M-Instruct and ``configs/quickstart.yaml``'s learner (bf16-autocast where the CPU has bf16,
micro_batch_tokens 4096). Rows: GRPO-ds and STARE-O1 (``selection=per_mini_batch``, the default, and
``pre_update``) with ``algorithm.ppo_mini_batch_size`` = all 8 groups (one step: the baseline), 4 and 2.

Each row runs in a process of its own (peak memory is per process): seconds are the median of the
repeats after one warm-up step, the parameters restored after each; peak memory is the process's peak
resident set over the timed steps (``VmHWM``, reset after the warm-up) above its resident set then
(CPU), or ``torch.cuda.max_memory_allocated`` above the memory allocated then (GPU). Rows of one repeat are interleaved by running the children in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = [
    ("grpo_ds", 8, "per_mini_batch"),
    ("grpo_ds", 4, "per_mini_batch"),
    ("grpo_ds", 2, "per_mini_batch"),
    ("stare", 8, "per_mini_batch"),
    ("stare", 4, "per_mini_batch"),
    ("stare", 2, "per_mini_batch"),
    ("stare", 4, "pre_update"),
    ("stare", 2, "pre_update"),
]


def status_mib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` (the peak resident set) of this process, MiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start ``VmHWM`` afresh from the current resident set (Linux >= 4.0: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")


def child(name: str, groups_per_mini_batch: int, selection: str, n: int, repeats: int) -> dict:
    import torch
    from learner_speed import rl_batch

    from stare_agent.config import cpu_has_bf16, load_config
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.models import load_policy
    from stare_agent.train.rollout_phase import Group
    from stare_agent.train.trainer import Trainer

    config_path = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    run_dir = tempfile.mkdtemp(prefix="minibatch-bench-")
    precision = "bf16-autocast" if cpu_has_bf16() else "fp32"
    config = load_config(
        config_path,
        [
            f"algorithm.name={name}",
            f"algorithm.ppo_mini_batch_size={groups_per_mini_batch}",
            f"algorithm.selection={selection}",
            "algorithm.H_tgt=100.0",  # the gate on: STARE's weights are used
            f"deepspeed.precision={precision}",
            "sandbox.backend=local",
            "sandbox.pool_size=1",
            f"trainer.run_dir={run_dir}",
            f"data.prompts_per_step={n // 4}",
        ],
    )
    model, tokenizer = load_policy(config.model.name_or_path)
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, lambda p, t: "x")
    )
    batch = rl_batch(n)
    size = 4
    groups = [
        Group(
            index=g,
            problem=None,
            rewards=[t.reward for t in batch[g * size : (g + 1) * size]],
            trajectories=batch[g * size : (g + 1) * size],
            global_ids=list(range(g * size, (g + 1) * size)),
        )
        for g in range(n // size)
    ]
    start = {k: v.clone() for k, v in trainer.learner.module.state_dict().items()}
    cuda = torch.cuda.is_available()
    times, metrics = [], {}
    base = 0.0
    try:
        for i in range(repeats + 1):  # the first is a warm-up (optimizer state, allocator pools)
            if i == 1:
                base = torch.cuda.memory_allocated() / 2**20 if cuda else status_mib("VmRSS")
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                else:
                    reset_peak()
            trainer.step = 1
            t0 = time.perf_counter()
            metrics = trainer.learn(groups, groups)
            if i:
                times.append(time.perf_counter() - t0)
            trainer.learner.module.load_state_dict(start)
        peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda else status_mib("VmHWM")) - base
    finally:
        trainer.close()
    return {
        "seconds": statistics.median(times),
        "peak_mib": peak,
        "steps": metrics.get("ppo/optimizer_steps", 1.0),
        "precision": precision,
        "tokens": sum(t.num_tokens for t in batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 trajectories, 1 repeat")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.repeats = 16, 1
    if args.child:
        name, size, selection = args.child
        print(json.dumps(child(name, int(size), selection, args.trajectories, args.repeats)))
        return
    from learner_speed import load_note

    from stare_agent.provenance import machine

    print(f"machine: {machine()}")
    print(f"before: {load_note()}")
    groups = args.trajectories // 4
    results = {}
    for name, size, selection in ROWS:
        size = max(1, size * groups // 8)
        out = subprocess.run(
            [sys.executable, __file__, "--child", name, str(size), selection,
             "--trajectories", str(args.trajectories), "--repeats", str(args.repeats)],
            capture_output=True, text=True, check=True, timeout=1800,
        )  # fmt: skip
        results[name, size, selection] = json.loads(out.stdout.strip().splitlines()[-1])
    first = next(iter(results.values()))
    print(
        f"\n{args.trajectories} trajectories ({groups} groups of 4, {first['tokens']} tokens), {first['precision']}, "
        f"micro_batch_tokens 4096; seconds: median of {args.repeats} after a warm-up; peak: above the memory held then"
    )
    print(
        f"| {'algorithm':<9} | {'selection':<14} | {'mini-batches':>12} | {'learn (s)':>9} | {'x one step':>10} | {'peak (MiB)':>10} |"
    )  # noqa: E501
    print(f"|{'-' * 11}|{'-' * 16}|{'-' * 14}|{'-' * 11}|{'-' * 12}|{'-' * 12}|")
    for (name, _size, selection), r in results.items():
        base = results[name, groups, "per_mini_batch"]
        shown = selection if name == "stare" else "-"
        print(
            f"| {name:<9} | {shown:<14} | {int(r['steps']):>12} | {r['seconds']:9.2f} | "
            f"{r['seconds'] / base['seconds']:9.2f}x | {r['peak_mib']:10.0f} |"
        )
    print(f"\nafter: {load_note()}")


if __name__ == "__main__":
    main()
