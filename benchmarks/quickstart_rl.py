"""Does the quickstart's RL part show anything? RL settings from one SFT model, side by side in one run.

From the SFT model of a quickstart run (``RUN/sft_model``), each setting runs the quickstart's RL part
(``stare-agent train --config configs/quickstart.yaml model.name_or_path=RUN/sft_model`` plus the
setting's overrides, each in its own process and run directory), then the SFT model and every RL
policy are evaluated the quickstart's way (greedy, vLLM fp32) on the first ``--problems`` held-out
problems. Per setting: accuracy, RL's change against the SFT model with Newcombe's paired 95 %
interval over the same problems (``stare_agent.intervals.paired_difference_interval``), how many RL
steps trained anything, the sampled entropy of the RL rollouts (the gate's H-bar, first and last
trained step), and the RL wall seconds (process start included).

Criterion, stated before the numbers: a setting shows what RL does when the lower end of its interval
is above 0; the quickstart takes the cheapest such setting, and if none has one its table says RL's
change is not measurable (it prints the interval either way).

Run: ``.venv/bin/python benchmarks/quickstart_rl.py --run runs/quickstart --problems 200``
(``--setting NAME=OVERRIDES`` replaces the default settings; ``--list`` prints them).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
EVAL = "--engine vllm env.vllm.dtype=float32"
SETTINGS = {
    "paper lr 1e-6, 3 steps": "optim.lr=1e-6 trainer.steps=3",
    "lr 1e-5, 3 steps": "optim.lr=1e-5 trainer.steps=3",
    "lr 1e-5, 6 steps": "optim.lr=1e-5 trainer.steps=6",
}


def cli(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("stare-agent")), *args]


def train(sft_model: str, overrides: str, run_dir: Path, config: Path = CONFIG) -> dict:
    """The quickstart's RL part from ``sft_model`` with ``overrides``; its steps and seconds."""
    command = cli(
        "train",
        "--config",
        str(config),
        f"model.name_or_path={sft_model}",
        f"trainer.run_dir={run_dir}",
        *shlex.split(overrides),
    )
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"`{shlex.join(command)}` failed:\n{done.stderr[-2000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [s for s in steps if "step" in s and "summary" not in s]
    entropy = [s["entropy"] for s in steps if s.get("entropy") is not None and s.get("skipped", 0) == 0]
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    return {
        "seconds": time.perf_counter() - t0,
        "steps": len(steps),
        "trained": sum(1 for s in steps if s.get("skipped", 0) == 0 and s.get("kept_groups", 0) > 0),
        "entropy": (entropy[0], entropy[-1]) if entropy else None,
        "model": str(checkpoints[-1] / "hf"),
    }


def evaluate(model: str, problems: int, out: Path, overrides: str = "") -> tuple[list[float], float]:
    """Each problem's score, greedy, the quickstart's way; and the evaluation's mean response tokens."""
    command = cli(
        "eval", "--config", str(CONFIG), "--model", model, "--out", str(out), "--limit", str(problems)
    )
    command += shlex.split(EVAL) + shlex.split(overrides)
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"`{shlex.join(command)}` failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").open()]
    tokens = [n for r in rows for n in r["response_tokens"]]
    return [sum(r["correct"]) / max(len(r["correct"]), 1) for r in rows], sum(tokens) / max(len(tokens), 1)


def settings_of(specs: list[str], defaults: dict[str, str]) -> dict[str, str]:
    """``--setting NAME=SPEC`` options as ``{name: spec}`` (in order), or ``defaults`` when none."""
    return dict(spec.partition("=")[::2] for spec in specs) if specs else dict(defaults)


def main() -> None:
    from stare_agent.intervals import paired_difference_interval

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(REPO / "runs" / "quickstart"), help="a quickstart run directory")
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME=OVERRIDES")
    parser.add_argument("--list", action="store_true")
    parser.add_argument(
        "--scores", default=None, help="also write each problem's score per policy to this JSON"
    )
    parser.add_argument(
        "--config", default=str(CONFIG), help="the RL settings' base config (rl_demo.yaml, ...)"
    )
    args = parser.parse_args()
    settings = settings_of(args.setting, SETTINGS)
    if args.list:
        print("\n".join(f"{name}: {o}" for name, o in settings.items()))
        return
    sft_model = str(Path(args.run) / "sft_model")
    if not Path(sft_model, "config.json").is_file():
        sys.exit(f"no SFT model at {sft_model}: run `stare-agent quickstart` first, or pass --run DIR")
    rows = []
    with tempfile.TemporaryDirectory(prefix="quickstart-rl-") as tmp:
        print(f"[SFT model] eval on {args.problems} problems", flush=True)
        base, _ = evaluate(sft_model, args.problems, Path(tmp) / "eval-sft")
        for i, (name, overrides) in enumerate(settings.items()):
            print(f"[{name}] stare-agent train {overrides}", flush=True)
            rl = train(sft_model, overrides, Path(tmp) / f"rl{i}", Path(args.config))
            scores, _ = evaluate(rl["model"], args.problems, Path(tmp) / f"eval{i}")
            rows.append((name, overrides, rl, scores))
    if args.scores:  # per problem, for a paired comparison of two settings later
        scores = {"sft": base, **{name: sc for name, _, _, sc in rows}}
        Path(args.scores).write_text(json.dumps(scores))
    from stare_agent.provenance import machine

    print(f"\n{sft_model}: {len(base)} held-out problems, greedy, vLLM fp32; {machine()}")
    print(f"SFT model: accuracy {sum(base) / len(base):.3f}\n")
    print(
        "| setting | overrides | accuracy | RL's change, 95 % paired interval | better / worse | "
        "steps trained | H-bar first -> last | RL seconds |"
    )
    print("|---|---|---:|---|---:|---:|---|---:|")
    for name, overrides, rl, scores in rows:
        lo, hi = paired_difference_interval(base, scores)
        change = (sum(scores) - sum(base)) / len(base)
        better = sum(1 for x, y in zip(base, scores, strict=True) if y > x)
        worse = sum(1 for x, y in zip(base, scores, strict=True) if y < x)
        H = f"{rl['entropy'][0]:.3f} -> {rl['entropy'][1]:.3f}" if rl["entropy"] else "-"
        print(
            f"| {name} | `{overrides}` | {sum(scores) / len(scores):.3f} | {change:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{better} / {worse} | {rl['trained']} of {rl['steps']} | {H} | {rl['seconds']:.0f} |"
        )
    if len(rows) > 1:
        print("\npaired between settings (95 % Newcombe over the same problems; one seed each):")
        print_pairs(rows)


def print_pairs(rows: list[tuple[str, str, dict, list[float]]]) -> None:
    """Each pair of settings' paired difference over the same problems (the second minus the first)."""
    from stare_agent.intervals import paired_difference_interval

    for i, (first, _, _, a) in enumerate(rows):
        for second, _, _, b in rows[i + 1 :]:
            lo, hi = paired_difference_interval(a, b)
            better = sum(1 for x, y in zip(a, b, strict=True) if y > x)
            worse = sum(1 for x, y in zip(a, b, strict=True) if y < x)
            print(
                f"{second} - {first}: {(sum(b) - sum(a)) / len(a):+.3f} [{lo:+.3f}, {hi:+.3f}] ({better} better, {worse} worse)"
            )


if __name__ == "__main__":
    main()
