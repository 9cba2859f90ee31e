"""One RL step of the quickstart configuration, old path vs new path, side by side in one run.

Each path is a real ``Trainer`` (the code ``stare-agent train`` runs) on ``configs/quickstart.yaml``,
started from the quickstart's cold-start SFT model, for ``--steps`` steps with the same seed; it runs
in its own process so that neither inherits the other's threads or caches. Per path the table shows
the medians over the steps (the first step is left out when there are three or more: it pays one-off
allocations) of:

- ``rollout``: the draw (all prompt batches dynamic sampling drew), reward checking included;
- ``log-prob``: the pre-update log-prob / entropy pass and STARE's weights;
- ``update``: the optimizer step; ``sync``: the weight hand-over to the engine (inside ``update``'s
  time in the trainer's own metrics, shown apart here when the trainer logs ``time/sync_s``);
- ``step``: the whole step; ``gen tok/s``: sampled tokens of the draw per second of rollout;
- ``setup``: building the trainer (model load, engine start), once per path.

A step whose draws kept fewer groups with reward variance than ``data.prompts_per_step`` trains on
the ones it kept (the quickstart's ``data.on_short_batch=train``); one that kept none trains nothing
and counts for the rollout columns only.

The paths are override lists on top of the config: ``--old`` (default: the path before the speed
work: the transformers engine, and the learner scoring every position, padding in batch order and
running every sample's prompt, and up to two draws of 4 prompts, the second one when the first kept
fewer than 4 groups with reward variance), ``--new`` (default: the fastest engine available,
``env.engine=auto``, the learner's defaults and the config's one draw of 8 prompts) and any
``--path NAME=OVERRIDES`` (repeatable), each with its ratio to the old path, e.g. ``--path
'draw4=env.engine=auto data.prompts_per_draw=4 data.max_sampling_batches=2'`` (the engine alone).

Run: ``.venv/bin/python benchmarks/rl_step.py`` (needs ``runs/quickstart/sft_model``: make it with
``.venv/bin/stare-agent sft --config configs/quickstart.yaml``; ``--model`` picks another).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"
OLD = (
    "env.engine=transformers deepspeed.score_response_only=false deepspeed.bucket_by_length=false "
    "deepspeed.share_prompts=false data.prompts_per_draw=4 data.max_sampling_batches=2"
)
NEW = "env.engine=auto"
COLUMNS = ("rollout", "log-prob", "update", "sync", "step")


def run_path(model: str, steps: int, overrides: list[str], out: Path) -> None:
    """Train ``steps`` steps with ``overrides`` (in this process) and write per-step timings to ``out``."""
    from stare_agent.config import load_config
    from stare_agent.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="rl-step-") as run_dir:
        config = load_config(
            CONFIG,
            [
                f"model.name_or_path={model}",
                f"trainer.steps={steps}",
                "trainer.checkpoint_every=0",
                "trainer.eval_every=0",
                f"trainer.run_dir={run_dir}",
                *overrides,
            ],
        )
        t0 = time.perf_counter()
        trainer = Trainer(config)
        setup_s = time.perf_counter() - t0
        engine = type(trainer.engine).__name__
        trainer.fit()
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    data, nan = config.data, float("nan")
    per_draw = (data.prompts_per_draw or data.prompts_per_step) * data.samples_per_prompt
    steps_out = []
    for m in rows:
        episodes = m.get("ds/batches_drawn", 1) * per_draw
        sampled = m["sampled_tokens_mean"] * episodes
        sync = m.get("time/sync_s", nan)
        steps_out.append(
            {
                "rollout": m["time/rollout_s"],
                "log-prob": m.get("time/logprob_s", nan),  # absent: the step trained nothing
                "update": m.get("time/update_s", nan) - (0.0 if sync != sync else sync),
                "sync": sync,
                "step": m["time/step_s"],
                "sampled_tokens": sampled,
                "episodes": episodes,
                "trained": m.get("kept_groups", 0) * data.samples_per_prompt,  # trajectories updated on
                "reward": m["reward_mean"],
                "entropy": m.get("entropy", nan),
            }
        )
    out.write_text(json.dumps({"engine": engine, "setup_s": setup_s, "steps": steps_out}))


def _median(steps: list[dict], key: str) -> float:
    values = [s[key] for s in (steps[1:] if len(steps) >= 3 else steps)]
    values = [v for v in values if v == v]  # NaN: not logged
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "runs" / "quickstart" / "sft_model"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--old", default=OLD, help=f"overrides of the old path (default: {OLD!r})")
    parser.add_argument("--new", default=NEW, help=f"overrides of the new path (default: {NEW!r})")
    parser.add_argument(
        "--path", action="append", default=[], metavar="NAME=OVERRIDES", help="a further path (repeatable)"
    )
    parser.add_argument("--one-path", default=None, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_path is not None:
        run_path(args.model, args.steps, shlex.split(args.one_path), Path(args.out))
        return
    if not Path(args.model, "config.json").is_file():
        sys.exit(
            f"no model at {args.model}: make the quickstart's SFT model first with "
            "`.venv/bin/stare-agent sft --config configs/quickstart.yaml`, or pass --model DIR"
        )
    paths = {"old": args.old, "new": args.new}
    for spec in args.path:
        name, sep, overrides = spec.partition("=")
        if not sep or not name or name in paths:
            sys.exit(
                f"--path {spec!r}: write NAME=OVERRIDES with a new name, e.g. 'draw8=data.prompts_per_draw=8'"
            )
        paths[name] = overrides
    results = {}
    load = []
    for name, overrides in paths.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
            cmd += ["--one-path", overrides, "--out", out.name]
            print(f"[{name}] {overrides}", flush=True)
            subprocess.run(cmd, check=True, cwd=REPO)
            results[name] = json.loads(Path(out.name).read_text())
        load.append(os.getloadavg()[0])

    from stare_agent.provenance import machine

    print(f"\nOne RL step of configs/quickstart.yaml from {args.model}, {args.steps} steps per path")
    loads = ", ".join(f"{x:.1f}" for x in load)
    print(f"machine: {machine()}, {platform.system()}; load average after each path: {loads}\n")
    header = [
        "path",
        "engine",
        "setup s",
        *(f"{c} s" for c in COLUMNS),
        "gen tok/s",
        "trained",
        "reward",
        "entropy",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    med: dict[str, dict[str, float]] = {}
    for name, r in results.items():
        steps = r["steps"]
        med[name] = {c: _median(steps, c) for c in COLUMNS}
        tok = [s["sampled_tokens"] / s["rollout"] for s in steps]
        med[name]["tok/s"] = statistics.median(tok[1:] if len(tok) >= 3 else tok)
        cells = [name, r["engine"], f"{r['setup_s']:.1f}"]
        cells += [f"{med[name][c]:.1f}" for c in COLUMNS]
        cells += [
            f"{med[name]['tok/s']:.0f}",
            "/".join(str(s["trained"]) for s in steps),
            f"{_median(steps, 'reward'):.2f}",
            f"{_median(steps, 'entropy'):.3f}",
        ]
        print("| " + " | ".join(cells) + " |")
    for name in [n for n in results if n != "old"]:
        ratio = [f"old / {name}", "", ""]
        for c in (*COLUMNS, "tok/s"):
            old, new = med["old"][c], med[name][c]
            if c == "tok/s":
                old, new = new, old  # higher is better: show the speed-up the same way round
            ratio.append(f"{old / new:.2f}x" if new == new and new > 0 and old == old else "-")
        print("| " + " | ".join([*ratio, "", "", ""]) + " |")
    print("\n`trained`: trajectories each step updated on (dynamic sampling keeps different groups on")
    print(
        "each path, so compare log-prob/update seconds per trajectory, or use benchmarks/learner_speed.py)."
    )
    print("\nTargets (issue 13): rollout >= 3x faster than the old path; step <= 40 s.")


if __name__ == "__main__":
    main()
