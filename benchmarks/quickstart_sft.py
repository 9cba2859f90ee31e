"""Cheaper cold starts for the quickstart: SFT (and evaluation) settings against today's, side by side in one run.

From the untouched embedded model, each setting runs the quickstart's cold-start SFT (``stare-agent sft
--config configs/quickstart.yaml`` plus the setting's SFT overrides, each in its own process and run
directory), then evaluates the SFT model the quickstart's way (greedy, vLLM fp32) on the first
``--problems`` held-out problems, with the setting's evaluation overrides (e.g. a smaller
``env.max_response_tokens``, which also bounds the before-evaluation's and RL's episodes). The first
setting is the baseline (today's quickstart); every other one gets its accuracy change against it with
Newcombe's paired 95 % interval over the same problems (``stare_agent.intervals.paired_difference_interval``),
the SFT steps and the SFT wall seconds (process start included).

Criterion, stated before the numbers: a cheaper setting may replace today's only if its paired interval
against the baseline holds 0 or lies above it (it is not measurably worse on these problems) and its
point estimate is no more than 0.01 below; the quickstart takes the cheapest such setting.

Run (one heavy job at a time):
``flock /tmp/bench.lock env ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/quickstart_sft.py --problems 200``
(``--setting 'NAME=SFT_OVERRIDES|EVAL_OVERRIDES'`` replaces the default settings, the first being the
baseline; ``--list`` prints them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quickstart_rl import CONFIG, REPO, cli, evaluate, settings_of  # noqa: E402

# a CPU played, printed (ONEDNN_MAX_CPU_ISA is in machine()'s line)
CAPS = ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
SETTINGS = {
    "today: 112 traces, lr 1e-4 (14 steps)": "|",
    "same SFT, response budget 192": "|env.max_response_tokens=192",
    "80 traces, lr 2e-4 (10 steps)": "sft.procedural_rows=80 sft.lr=2e-4|",
    "96 traces, lr 1.5e-4 (12 steps)": "sft.procedural_rows=96 sft.lr=1.5e-4|",
    "64 traces, lr 3e-4 (8 steps)": "sft.procedural_rows=64 sft.lr=3e-4|",
    # LoRA for the cold start (no weight gradients for the frozen matrices, an optimizer over the adapters
    # only); at ~10x full fine-tuning's lr, the usual LoRA rule of thumb, and at 5x
    "LoRA r 32 all-linear, lr 1e-3 (14 steps)": "model.lora.r=32 model.lora.alpha=32 sft.lr=1e-3|",
    "LoRA r 32 all-linear, lr 5e-4 (14 steps)": "model.lora.r=32 model.lora.alpha=32 sft.lr=5e-4|",
}


def sft(overrides: str, run_dir: Path) -> dict:
    """The quickstart's cold-start SFT with ``overrides``; its steps, seconds and model."""
    command = cli("sft", "--config", str(CONFIG), f"trainer.run_dir={run_dir}", *shlex.split(overrides))
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"`{shlex.join(command)}` failed:\n{done.stderr[-2000:]}")
    logged = [json.loads(line) for line in (run_dir / "sft_log.jsonl").open()]
    return {
        "seconds": time.perf_counter() - t0,
        "steps": sum(1 for row in logged if "loss" in row),
        "last_loss": next(row["summary"]["last_loss"] for row in logged if "summary" in row),
        "model": str(run_dir / "sft_model"),
    }


def main() -> None:
    from stare_agent.intervals import paired_difference_interval

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=SFT_OVERRIDES|EVAL_OVERRIDES")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    settings = settings_of(args.setting, SETTINGS)
    if args.list:
        print("\n".join(f"{name}: {o}" for name, o in settings.items()))
        return
    rows = []
    models: dict[str, dict] = {}  # one SFT per distinct SFT overrides
    with tempfile.TemporaryDirectory(prefix="quickstart-sft-") as tmp:
        for i, (name, spec) in enumerate(settings.items()):
            sft_overrides, _, eval_overrides = spec.partition("|")
            if sft_overrides not in models:
                print(f"[{name}] stare-agent sft {sft_overrides}", flush=True)
                models[sft_overrides] = sft(sft_overrides, Path(tmp) / f"sft{i}")
            trained = models[sft_overrides]
            print(f"[{name}] eval on {args.problems} problems {eval_overrides}", flush=True)
            scores, tokens = evaluate(trained["model"], args.problems, Path(tmp) / f"eval{i}", eval_overrides)
            rows.append((name, spec, trained, scores, tokens))
    from stare_agent.provenance import machine

    caps = "".join(f", {k}={os.environ[k]}" for k in CAPS if os.environ.get(k))
    print(f"\n{args.problems} held-out problems, greedy, vLLM fp32; {machine()}{caps}\n")
    print(
        "| setting | overrides (SFT \\| eval) | SFT steps | SFT seconds | SFT last loss | accuracy | change vs the first, "
        "95 % paired interval | better / worse | response tokens / episode |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---:|")
    base = rows[0][3]
    for name, spec, trained, scores, tokens in rows:
        lo, hi = paired_difference_interval(base, scores)
        change = (sum(scores) - sum(base)) / len(base)
        better = sum(1 for x, y in zip(base, scores, strict=True) if y > x)
        worse = sum(1 for x, y in zip(base, scores, strict=True) if y < x)
        print(
            f"| {name} | `{spec}` | {trained['steps']} | {trained['seconds']:.0f} | {trained['last_loss']:.3f} | "
            f"{sum(scores) / len(scores):.3f} | {change:+.3f} [{lo:+.3f}, {hi:+.3f}] | {better} / {worse} | "
            f"{tokens:.1f} |"
        )


if __name__ == "__main__":
    main()
