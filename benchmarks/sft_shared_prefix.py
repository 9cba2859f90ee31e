"""SFT steps on the quickstart's real traces, their common system prompt run once or per trace, side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/sft_shared_prefix.py
    flock /tmp/bench.lock env ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/sft_shared_prefix.py  # a CPU without bf16

The quickstart's cold-start traces (``configs/quickstart.yaml``: procedural ReTool traces whose
interpreter output is really produced in the sandbox) of different problems share the chat template's
system prompt, about 104 of their ~132 prompt tokens with the embedded SmolLM2-135M. With
``deepspeed.share_prompts`` a micro-batch now runs that common prefix once
(``stare_agent.train.batch.shared_prefix_length``); before, only the samples of one prompt shared it,
so SFT ran every trace whole (today's path with ``share_prompts=false`` is that baseline: the prefix
is the only difference). One ``Learner.sft_step`` per batch of 8 traces, both ways interleaved over
``--repeats`` rounds (parameters restored after each step), in the precision the quickstart resolves
on this CPU. Prints the median seconds and tokens/s of each way and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def main() -> None:
    from stare_agent.config import load_config
    from stare_agent.models import load_policy
    from stare_agent.provenance import machine
    from stare_agent.recipes.quickstart import run_precision
    from stare_agent.train.batch import shared_prefix_length
    from stare_agent.train.learner import Learner
    from stare_agent.train.sft import load_sft_traces, tokenize_traces

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2, help="batches of 8 traces per round")
    args = parser.parse_args()
    from stare_sandbox import resolve_backend

    backend = resolve_backend("auto", load_config(CONFIG).sandbox.limits, build=True)
    config = load_config(CONFIG, [f"sandbox.backend={backend}", f"sft.procedural_rows={8 * args.batches}"])
    precision = run_precision(config)  # what the learner resolves bf16-autocast to on this CPU
    model, tokenizer = load_policy(config.model.name_or_path)
    traces, _ = load_sft_traces(config)
    trajectories, _ = tokenize_traces(traces, tokenizer, config)
    batches = [trajectories[i : i + 8] for i in range(0, 8 * args.batches, 8)]
    learner = Learner(model, tokenizer, config.deepspeed, config.optim, total_steps=1000)
    start = {k: v.clone() for k, v in learner.module.state_dict().items()}
    learner.sft_step(batches[0])  # warm-up
    learner.module.load_state_dict(start)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for share in (False, True):
            learner.ds_config.share_prompts = share
            t0 = time.perf_counter()
            for batch in batches:
                learner.sft_step(batch)
            seconds[share].append(time.perf_counter() - t0)
            learner.module.load_state_dict(start)
    tokens = sum(t.num_tokens for b in batches for t in b)
    print(
        f"\n{machine()}; {precision}; "
        f"{len(batches)} batches of 8 traces, {tokens} tokens, shared prefix "
        f"{[shared_prefix_length(b) for b in batches]} tokens; medians of {args.repeats}; "
        f"load average at the end {os.getloadavg()[0]:.1f}\n"
    )
    print("| SFT step | seconds per step | tokens/s |")
    print("|---|---:|---:|")
    for share, name in (
        (False, "every trace whole (share_prompts=false)"),
        (True, "common prefix once (default)"),
    ):
        per_step = statistics.median(seconds[share]) / len(batches)
        print(f"| {name} | {per_step:.2f} | {tokens / len(batches) / per_step:.0f} |")
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    print(f"\nspeed-up: {ratio:.2f}x")


if __name__ == "__main__":
    main()
