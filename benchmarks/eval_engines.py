"""One model, evaluated by each rollout engine and precision, side by side in one run.

The quickstart's before/after table is measured with whatever engine `env.engine: auto` picks (the
vLLM engine in bf16 where it is installed; before the speed work: the transformers engine). This
benchmark separates what the model learned from how the engine decodes it: the same model, the
same 40 held-out problems, greedy (the quickstart's evaluation), through ``stare-agent eval`` once
per path, each in its own process. Per path: accuracy, tool calls per episode, mean response tokens,
the problems it solves that the first path does not (and vice versa), and wall seconds (engine start
included).

Run: ``.venv/bin/python benchmarks/eval_engines.py`` (needs ``runs/quickstart/sft_model``: make it
with ``.venv/bin/stare-agent sft --config configs/quickstart.yaml``; ``--model`` picks another;
``--path NAME=ARGS`` replaces the default paths, ARGS being ``stare-agent eval`` flags and overrides).
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

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
PATHS = {
    "transformers fp32 (baseline)": "--engine transformers",
    "vLLM fp32": "--engine vllm env.vllm.dtype=float32",
    "vLLM bf16 (quickstart default)": "--engine vllm env.vllm.dtype=bfloat16",
}


def run_path(model: str, args: str, out: Path) -> dict:
    """``stare-agent eval`` of ``model`` with ``args``; its report and per-problem correctness."""
    cli = Path(sys.executable).with_name("stare-agent")
    command = [str(cli), "eval", "--config", str(CONFIG), "--model", model, "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run([*command, *shlex.split(args)], cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command)} {args}` failed:\n{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").open()]
    engine = next((line for line in done.stdout.splitlines() if line.startswith("engine:")), "engine: ?")
    return {"summary": summary, "rows": rows, "seconds": seconds, "engine": engine.split(":", 1)[1].strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "runs" / "quickstart" / "sft_model"))
    parser.add_argument("--path", action="append", default=[], metavar="NAME=ARGS")
    args = parser.parse_args()
    if not Path(args.model, "config.json").is_file():
        sys.exit(
            f"no model at {args.model}: make the quickstart's SFT model first with "
            "`.venv/bin/stare-agent sft --config configs/quickstart.yaml`, or pass --model DIR"
        )
    paths = dict(PATHS)
    if args.path:
        paths = {}
        for spec in args.path:
            name, sep, flags = spec.partition("=")
            if not sep or not name:
                sys.exit(
                    f"--path {spec!r}: write NAME=ARGS, e.g. 'vllm-fp32=--engine vllm env.vllm.dtype=float32'"
                )
            paths[name] = flags
    results = {}
    with tempfile.TemporaryDirectory(prefix="eval-engines-") as tmp:
        for i, (name, flags) in enumerate(paths.items()):
            print(f"[{name}] stare-agent eval {flags}", flush=True)
            results[name] = run_path(args.model, flags, Path(tmp) / f"path{i}")
    from stare_agent.provenance import machine

    print(f"\n{args.model} on the quickstart's held-out problems, greedy; {machine()}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}\n")
    print(
        "| path | engine | accuracy | tool calls / episode | response tokens | solved, not by the first | not solved, solved by the first | seconds |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    first = None
    for name, r in results.items():
        m = r["summary"]
        solved = {row["problem_id"] for row in r["rows"] if any(row["correct"])}
        first = solved if first is None else first
        acc = m[f"avg@{m['samples']}"]
        print(
            f"| {name} | {r['engine']} | {acc:.3f} | {m['tool_calls_per_episode']:.2f} | "
            f"{m['response_tokens_mean']:.1f} | {len(solved - first)} | {len(first - solved)} | {r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
