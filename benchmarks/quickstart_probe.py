"""Cold-start SFT settings for the quickstart: which ones make the embedded SmolLM2-135M use the code tool.

For each setting: procedural ReTool traces (solution code REALLY run in the sandbox, by
``stare_agent.sft_data.procedural_traces``), the product's cold-start SFT (``stare_agent.cold_start.sft``
with ``configs/quickstart.yaml`` and the setting's overrides: the DeepSpeed learner, its schedule and
its precision, exactly the loop ``stare-agent quickstart`` runs), then the product's tool-use evaluation
(``stare_agent.evaluation.evaluate``) on held-out procedural problems (a different seed). The untouched
model is evaluated first, in the same run, with the same settings.

Prints one row per setting: traces, SFT steps, SFT wall and CPU seconds (CPU / 2 is roughly the wall
time on an idle 2-core machine), seconds per step, mean sequence length, baseline and after-SFT
accuracy, tool calls per episode, and the load average while training (the machine is shared).

Run: ``.venv/bin/python benchmarks/quickstart_probe.py --settings short-lr1e-4-s40``
(``--list`` shows the named settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from envs.problems import generate_problems
from envs.rollout import SamplingParams
from sandbox import make_sandbox
from stare_agent import cold_start
from stare_agent.config import load_config
from stare_agent.engines.transformers_engine import TransformersEngine
from stare_agent.evaluation import evaluate
from stare_agent.models import load_policy
from stare_agent.sft_data import Trace, procedural_traces, write_retool_jsonl

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


@dataclass(frozen=True)
class Setting:
    """One cold-start SFT configuration."""

    name: str
    template: str = "short"  # how the model-written steps read (see TEMPLATES)
    traces_per_family: int = 16
    difficulty: int = 1
    lr: float = 1e-4
    batch_size: int = 8
    steps: int = 40  # rounded up to whole epochs (sft.epochs) of the product's loop
    warmup: int = 4
    bf16: bool = False  # deepspeed.precision=bf16-autocast (fp32 weights, bf16 forward passes)


def _short(code: str, output: str, answer: str) -> tuple[str, str]:
    return (
        f"I'll compute this with Python.\n<code>\n```python\n{code}\n```\n</code>",
        f"<answer>\\boxed{{{answer}}}</answer>",
    )


def _bare(code: str, output: str, answer: str) -> tuple[str, str]:
    return f"<code>\n```python\n{code}\n```\n</code>", f"<answer>\\boxed{{{answer}}}</answer>"


def _explained(code: str, output: str, answer: str) -> tuple[str, str]:
    return (
        f"I'll compute this with Python.\n<code>\n```python\n{code}\n```\n</code>",
        f"The code printed {answer}, so the answer is {answer}.\n<answer>\\boxed{{{answer}}}</answer>",
    )


TEMPLATES = {"short": _short, "bare": _bare, "explained": _explained}

SETTINGS = {
    s.name: s
    for s in [
        Setting("smoke", traces_per_family=2, batch_size=2, steps=2),
        Setting("short-lr1e-4-s40"),
        Setting("bf16-short-lr1e-4-s30", steps=30, bf16=True),
        Setting("bf16-short-lr2e-4-s30", steps=30, lr=2e-4, bf16=True),
        Setting("bf16-bare-lr1e-4-s30", template="bare", steps=30, bf16=True),
        Setting("bf16-explained-lr1e-4-s30", template="explained", steps=30, bf16=True),
        Setting("bf16-short-lr1e-4-s20", steps=20, bf16=True),
        Setting("bf16-short-lr1e-4-s20-bs12", steps=20, batch_size=12, bf16=True),
        Setting("short-lr3e-5-s40", lr=3e-5),
        Setting("short-lr2e-4-s40", lr=2e-4),
        Setting("short-lr1e-4-s20", steps=20),
        Setting("short-lr1e-4-s60", steps=60),
        Setting("short-lr1e-4-s40-bs4", batch_size=4),
        Setting("bare-lr1e-4-s40", template="bare"),
        Setting("explained-lr1e-4-s40", template="explained"),
        Setting("short-lr1e-4-s40-bf16", bf16=True),
        Setting("short-lr1e-4-s40-d12", difficulty=12),  # half difficulty 1, half difficulty 2
    ]
}


def make_traces(setting: Setting, families: list[str], seed: int, sandbox) -> list[Trace]:
    """Procedural traces of every family, rewritten into ``setting.template`` (outputs stay real)."""
    template = TEMPLATES[setting.template]
    difficulties = [1, 2] if setting.difficulty == 12 else [setting.difficulty]
    traces: list[Trace] = []
    for family in families:
        for difficulty in difficulties:
            n = setting.traces_per_family // len(difficulties)
            made, _rejected = procedural_traces(family, n, sandbox, seed=seed, difficulty=difficulty)
            traces.extend(made)
    out = []
    for trace in traces:
        (_, first), (_, observation), _ = trace.steps
        code = first.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        turn_1, turn_2 = template(code, observation, trace.answer or "")
        steps = [("model", turn_1), ("tool", observation), ("model", turn_2)]
        out.append(dataclasses.replace(trace, steps=steps))
    return out


def sft(model, tokenizer, traces: list[Trace], setting: Setting, seed: int) -> dict[str, float]:
    """The product's cold-start SFT (``cold_start.sft``) on ``traces`` with the quickstart config and
    the setting's overrides; returns wall/CPU seconds and the loss curve ends."""
    with tempfile.TemporaryDirectory(prefix="quickstart-probe-") as tmp:
        run_dir = Path(tmp)
        data = write_retool_jsonl(traces, run_dir / "traces.jsonl")
        steps_per_epoch = max(len(traces) // setting.batch_size, 1)
        epochs = math.ceil(setting.steps / steps_per_epoch)
        config = load_config(
            QUICKSTART,
            [
                f"sft.data={data}",
                "sft.format=retool",
                f"sft.lr={setting.lr}",
                f"sft.batch_size={setting.batch_size}",
                f"sft.epochs={epochs}",
                f"sft.warmup_ratio={min(setting.warmup / (epochs * steps_per_epoch), 0.5)}",
                f"sft.output_dir={run_dir / 'model'}",
                f"trainer.run_dir={run_dir}",
                f"trainer.seed={seed}",
                f"deepspeed.precision={'bf16-autocast' if setting.bf16 else 'fp32'}",
                "logger.backends=[]",
            ],
        )
        wall0, cpu0 = time.perf_counter(), time.process_time()
        load0 = os.getloadavg()[0]
        summary = cold_start.sft(config, model=model, tokenizer=tokenizer)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        logged = [json.loads(line) for line in (run_dir / cold_start.LOG_FILENAME).read_text().splitlines()]
    losses = [row["loss"] for row in logged if "loss" in row and not row.get("skipped")]
    tokens = sum(row.get("tokens", 0) for row in logged)
    model.eval()
    return {
        "steps": summary["steps"],
        "wall_s": wall,
        "cpu_s": cpu,
        "load": (load0 + os.getloadavg()[0]) / 2,
        "mean_len": tokens / max(summary["steps"] * setting.batch_size, 1),
        "loss_first": sum(losses[:3]) / max(len(losses[:3]), 1),
        "loss_last": sum(losses[-3:]) / max(len(losses[-3:]), 1),
    }


def run_eval(model, tokenizer, problems, args) -> tuple[dict[str, float], float]:
    engine = TransformersEngine(model, tokenizer, max_batch_size=args.eval_batch)
    sampling = SamplingParams(temperature=args.temperature, top_p=1.0, seed=0)
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.eval_bf16):
        report = _evaluate(problems, engine, tokenizer, sampling, args)
    by_family: dict[str, list[bool]] = {}
    for problem, result in zip(problems, report.problems, strict=True):
        by_family.setdefault(problem.meta["family"], []).extend(result.correct)
    metrics = dict(report.metrics)
    metrics["by_family"] = {f: sum(c) / len(c) for f, c in sorted(by_family.items())}  # type: ignore[assignment]
    return metrics, time.perf_counter() - t0


def _evaluate(problems, engine, tokenizer, sampling, args):
    return evaluate(
        problems,
        engine=engine,
        tokenizer=tokenizer,
        samples=args.samples,
        sampling=sampling,
        max_response_tokens=args.max_response_tokens,
        batch_size=args.eval_batch,
        env_kwargs={"format": "retool", "sandbox_backend": args.sandbox, "max_turns": 3},
        progress=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="*", default=["short-lr1e-4-s40"])
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--eval-n", type=int, default=40)
    parser.add_argument("--eval-seed", type=int, default=1000)
    parser.add_argument("--eval-difficulty", type=int, default=1)
    parser.add_argument("--eval-batch", type=int, default=20)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--families", default="all")
    parser.add_argument("--sandbox", default="docker", choices=["docker", "local"])
    parser.add_argument("--eval-bf16", action="store_true", help="generate under bfloat16 autocast")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=0, help="print this many after-SFT episodes")
    args = parser.parse_args()
    if args.list:
        for s in SETTINGS.values():
            print(s)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from envs.problems import PROBLEM_FAMILIES

    families = sorted(PROBLEM_FAMILIES) if args.families == "all" else args.families.split(",")
    held_out = generate_problems("mixed", args.eval_n, seed=args.eval_seed, difficulty=args.eval_difficulty)
    held_out = [p for p in held_out if p.meta["family"] in families] if args.families != "all" else held_out
    print(
        f"held-out: {len(held_out)} problems, families {families}, load {os.getloadavg()[0]:.1f}", flush=True
    )

    rows = []
    if not args.skip_baseline:
        model, tokenizer = load_policy()
        base, base_s = run_eval(model, tokenizer, held_out, args)
        print(f"baseline: {base}  ({base_s:.0f}s)", flush=True)
    else:
        base = {f"avg@{args.samples}": float("nan"), "tool_calls_per_episode": float("nan")}
    sandbox = make_sandbox(args.sandbox)
    try:
        for name in args.settings:
            setting = SETTINGS[name]
            model, tokenizer = load_policy()
            t0 = time.perf_counter()
            traces = make_traces(setting, families, seed=0, sandbox=sandbox)
            trace_s = time.perf_counter() - t0
            stats = sft(model, tokenizer, traces, setting, seed=0)
            after, eval_s = run_eval(model, tokenizer, held_out, args)
            print(
                f"{name}: traces {len(traces)} in {trace_s:.0f}s; sft {stats}; after {after} ({eval_s:.0f}s)",
                flush=True,
            )
            if args.show:
                _show(model, tokenizer, held_out[: args.show], args)
            rows.append((setting, len(traces), trace_s, stats, after, eval_s))
    finally:
        sandbox.close()

    key = f"avg@{args.samples}"
    print()
    print(
        f"eval: {len(held_out)} held-out problems (mixed, difficulty {args.eval_difficulty}, seed "
        f"{args.eval_seed}), T={args.temperature}, samples={args.samples}, "
        f"max_response_tokens={args.max_response_tokens}"
    )
    header = (
        f"{'setting':<30} {'traces':>6} {'steps':>5} {'bs':>3} {'sft_wall':>8} {'sft_cpu':>8} "
        f"{'s/step':>6} {'len':>5} {'load':>5} {'loss':>11} {'base':>5} {'after':>5} {'tools':>9}"
    )
    print(header)
    for setting, n, _trace_s, stats, after, _eval_s in rows:
        print(
            f"{setting.name:<30} {n:>6} {stats['steps']:>5} {setting.batch_size:>3} {stats['wall_s']:>8.0f} "
            f"{stats['cpu_s']:>8.0f} {stats['wall_s'] / stats['steps']:>6.1f} {stats['mean_len']:>5.0f} "
            f"{stats['load']:>5.1f} {stats['loss_first']:>5.2f}>{stats['loss_last']:<5.2f} {base[key]:>5.2f} "
            f"{after[key]:>5.2f} {base['tool_calls_per_episode']:>4.2f}>{after['tool_calls_per_episode']:<4.2f}"
        )


def _show(model, tokenizer, problems, args) -> None:
    """Print a few greedy after-SFT episodes, to see what the model writes."""
    from envs.code_interpreter import CodeInterpreterEnv
    from envs.rollout import RolloutRunner

    engine = TransformersEngine(model, tokenizer)
    runner = RolloutRunner(
        tokenizer,
        engine,
        max_response_tokens=args.max_response_tokens,
        sampling=SamplingParams(temperature=0.0),
    )
    envs = [CodeInterpreterEnv(problems, tokenizer=tokenizer, sandbox_backend=args.sandbox) for _ in problems]
    try:
        trajectories = runner.run(envs, options=[{"problem": p} for p in problems])
    finally:
        for env in envs:
            env.close()
    for problem, t in zip(problems, trajectories, strict=True):
        print(f"--- {problem.id} gold {problem.answer} correct {t.info.get('correct')}")
        print(tokenizer.decode(t.response_ids))


if __name__ == "__main__":
    main()
