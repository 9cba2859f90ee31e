"""RL updates whose groups have one long sample: padded to it (before) or that sample run alone (now), side by side.

    flock /tmp/bench.lock env ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/padding_cut.py   # fp32, a CPU without bf16

``bucket_by_length`` now cuts a micro-batch again where padding its rows to the longest costs more
than another pass (``stare_agent.train.batch.MICRO_BATCH_OVERHEAD`` tokens): the quickstart's RL draws
hold a sample that runs to the 256-token budget about once in 32 (``truncated_fraction`` 0.03), and
its group was padded to it. The embedded SmolLM2-135M, ``configs/quickstart.yaml``'s learner in the
precision it resolves on this CPU, one RL step's work (the pre-update log-prob/entropy pass and the
update, one optimizer step) on 3 groups of 4 samples of one 130-token prompt each, responses shaped
like the quickstart's (one group with a 256-token sample, one with a 195-token one, one without).
"Before" is the same code with the cut switched off (``MICRO_BATCH_OVERHEAD`` above any padding).
Interleaved, parameters restored after each step, medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from stare_agent.config import load_config
from stare_agent.models import load_policy
from stare_agent.provenance import machine
from stare_agent.recipes.quickstart import run_precision
from stare_agent.train import batch as batch_module
from stare_agent.train.learner import Learner
from stare_envs.trajectory import Trajectory, TrajectoryBuilder

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
GROUPS = [[256, 104, 92, 80], [195, 96, 88, 70], [120, 110, 95, 60]]  # response tokens of each sample
PROMPT = 130


def groups(seed: int = 0) -> list[Trajectory]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in GROUPS:
        prompt = torch.randint(100, 40000, (PROMPT,), generator=g).tolist()
        for n in lengths:
            b = TrajectoryBuilder(prompt)
            b.append(torch.randint(100, 40000, (n,), generator=g).tolist(), 1, [-1.0] * n)
            out.append(b.build(reward=float(torch.rand((), generator=g) > 0.5)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_config(CONFIG)
    model, tokenizer = load_policy(config.model.name_or_path)
    learner = Learner.from_config(model, tokenizer, config)
    print(f"precision {learner.precision} (configs/quickstart.yaml asks {run_precision(config)})")
    batch = groups()
    advantages = [1.0 if t.reward else -1.0 for t in batch]
    start = {k: v.clone() for k, v in learner.module.state_dict().items()}
    default = batch_module.MICRO_BATCH_OVERHEAD
    variants = {
        "before: each group padded to its longest": 10**9,
        f"now: cut where padding > {default}": default,
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    splits: dict[str, list[list[int]]] = {}
    learner.update(batch, advantages)  # warm-up
    learner.module.load_state_dict(start)
    for _ in range(args.repeats):
        for name, overhead in variants.items():
            batch_module.MICRO_BATCH_OVERHEAD = overhead
            splits[name] = learner.compute_batches(batch)
            t0 = time.perf_counter()
            learner.compute_logprobs_and_entropy(batch)
            learner.update(batch, advantages)
            seconds[name].append(time.perf_counter() - t0)
            learner.module.load_state_dict(start)
    batch_module.MICRO_BATCH_OVERHEAD = default
    print(f"\n{machine()}; medians of {args.repeats}\n")
    print("| variant | micro-batches (rows) | backbone tokens | s / step (log-probs + update) | speed-up |")
    print("|---|---|---:|---:|---:|")
    base = statistics.median(next(iter(seconds.values())))
    for name, times in seconds.items():
        rows = [len(m) for m in splits[name]]
        tokens = 0
        for m in splits[name]:
            part = [batch[i] for i in m]
            shared = batch_module.shared_prefix_length(part)
            tokens += shared + len(part) * (max(t.num_tokens for t in part) - shared)
        s = statistics.median(times)
        print(
            f"| {name} | {len(rows)} ({', '.join(map(str, rows))}) | {tokens} | {s:.2f} | {base / s:.2f}x |"
        )


if __name__ == "__main__":
    main()
