"""Does a seeded run reproduce bit for bit? The same short study run twice, compared episode by episode.

Runs ``stare-agent study --variants VARIANT --seeds 1`` twice, each in its own directory (cold-start
SFT, calibration, RL steps with held-out evaluations; ``trainer.save_rollouts=true``), one after the
other on this machine, then compares, in order of the pipeline: the SFT losses, the calibration, the
start's evaluation, every step's metrics (all but wall times) and every saved episode (its token
ids and reward) of each step's draws and of each evaluation. Prints one row per artefact: items compared, identical, and the first
difference. Wall times are compared too (medians and their ratio), as the second run had other load.

Same machine, same CPU type and thread count: bf16 kernels round differently on another CPU (e.g. AMX
vs AVX-512), so a run on another machine type differs from the first token whose rounding differs.

Run: ``.venv/bin/python benchmarks/reproducibility.py`` (about 20 minutes on the 2-core CPU: two runs of
6 steps, evaluations at steps 5 and 6); ``--steps``, ``--variant`` and extra overrides after ``--``.
``--compare A B`` compares two study dirs already run; ``--runs A B`` two run dirs (steps and episodes
only), e.g. ``runs/study/runs/stare-o1-s0`` and ``no-off-state-s0``, the same algorithm wherever
STARE's gate stays on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "study.yaml"
TIME_KEYS = ("time/", "duration", "cpu_s", "_per_s", "seconds")


def run(root: Path, variant: str, steps: int, extra: list[str]) -> float:
    """One study of ``variant``, seed 0, in ``root``; its wall seconds."""
    cli = Path(sys.executable).with_name("stare-agent")
    args = [str(cli), "study", "--config", str(CONFIG), "--variants", variant, "--seeds", "1"]
    args += [f"trainer.steps={steps}", "trainer.save_rollouts=true", f"trainer.run_dir={root}", *extra]
    t0 = time.perf_counter()
    with open(root.with_suffix(".log"), "w") as log:
        subprocess.run(args, check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def _timeless(value: object) -> object:
    """``value`` without wall times and measured durations, which no two runs share."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if not any(t in k for t in TIME_KEYS)}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def compare(name: str, a: list, b: list, label: Callable[[int, Any], str]) -> dict:
    """One row: how many items, how many identical, the first that differs. Items are compared as
    JSON, so that a NaN (a skipped step's entropy) equals itself."""
    equal = [_json(x) == _json(y) for x, y in zip(a, b, strict=False)]
    same = sum(equal)
    first = next((label(i, a[i]) for i, eq in enumerate(equal) if not eq), "")
    if len(a) != len(b):
        first = first or f"lengths {len(a)} vs {len(b)}"
    return {"artefact": name, "items": max(len(a), len(b)), "identical": same, "first difference": first}


def study_rows(a: Path, b: Path) -> list[dict]:
    """Rows for two study dirs' shared stages: SFT losses, calibration, the start's evaluation (of the
    seeds both ran: a study of more seeds evaluates the start on each seed's held-out problems)."""
    evals_a, evals_b = (json.loads((r / "start_eval.json").read_text()) for r in (a, b))
    seeds = sorted(set(evals_a) & set(evals_b))
    return [
        compare(
            "SFT losses",
            [r.get("loss") for r in _lines(a / "sft" / "sft_log.jsonl")],
            [r.get("loss") for r in _lines(b / "sft" / "sft_log.jsonl")],
            lambda i, _: f"SFT step {i + 1}",
        ),
        compare(
            "calibration",
            [_timeless(json.loads((a / "calibration.json").read_text()))],
            [_timeless(json.loads((b / "calibration.json").read_text()))],
            lambda i, _: "calibration.json",
        ),
        compare(
            "start's evaluation (seeds in both)",
            [_timeless(evals_a[seed]) for seed in seeds],
            [_timeless(evals_b[seed]) for seed in seeds],
            lambda i, _: f"start_eval.json seed {seeds[i]}",
        ),
    ]


def compare_runs(run_a: Path, run_b: Path) -> list[dict]:
    """Rows for two run dirs: every step's metrics (no times) and every saved episode."""
    ma, mb = (_lines(r / "metrics.jsonl") for r in (run_a, run_b))
    rows = [
        compare(
            "step metrics (no times)",
            [_timeless(r) for r in ma],
            [_timeless(r) for r in mb],
            lambda i, r: (
                f"step {r.get('step')}: "
                + ", ".join(k for k in r if _json(r[k]) != _json(_timeless(mb[i]).get(k)))[:60]
            ),
        )
    ]
    names = sorted({p.name for r in (run_a, run_b) for p in (r / "rollouts").glob("*.jsonl")})
    for kind in ("step", "eval", "eval_greedy"):
        files = [n for n in names if n.rsplit("_", 1)[0] == kind]
        ea = [(n, e["response_ids"], e["reward"]) for n in files for e in _lines(run_a / "rollouts" / n)]
        eb = [(n, e["response_ids"], e["reward"]) for n in files for e in _lines(run_b / "rollouts" / n)]
        rows.append(
            compare(f"episodes: {kind} ({len(files)} files)", ea, eb, lambda i, e: f"{e[0]} episode {i}")
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="stare-o1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--keep", type=Path, help="keep both runs under this directory")
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar="STUDY",
        help="run nothing: compare two study dirs of VARIANT",
    )
    parser.add_argument(
        "--runs",
        nargs=2,
        type=Path,
        metavar="RUN",
        help="run nothing: compare two run dirs' steps and episodes (e.g. two variants of one study"
        " that are the same algorithm where STARE's gate stays on)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for both runs")
    args = parser.parse_args()
    walls: list[float] = []
    rows: list[dict] = []
    if args.runs:
        run_a, run_b = args.runs
        base = run_a.parent
    elif args.compare:
        roots, base = list(args.compare), args.compare[0].parent
    else:
        base = args.keep or Path(tempfile.mkdtemp(prefix="stare-repro-"))
        base.mkdir(parents=True, exist_ok=True)
        roots = [base / "first", base / "second"]
        for root in roots:
            walls.append(run(root, args.variant, args.steps, args.overrides))
            print(f"{root.name}: {walls[-1]:.0f} s", flush=True)

    if not args.runs:
        rows += study_rows(*roots)
        run_a, run_b = (r / "runs" / f"{args.variant}-s0" for r in roots)
    rows += compare_runs(run_a, run_b)
    ma, mb = (_lines(r / "metrics.jsonl") for r in (run_a, run_b))
    steps_a = [r["time/step_s"] for r in ma if "time/step_s" in r]
    steps_b = [r["time/step_s"] for r in mb if "time/step_s" in r]

    from stare_agent.provenance import machine

    print(f"\nmachine: {machine()}; runs in {base}")
    width = max(len(r["artefact"]) for r in rows)
    print(f"{'artefact':<{width}}  {'items':>6}  {'identical':>9}  first difference")
    for r in rows:
        print(
            f"{r['artefact']:<{width}}  {r['items']:>6}  {r['identical']:>9}  {r['first difference'] or '-'}"
        )
    if steps_a and steps_b:
        ma_s, mb_s = statistics.median(steps_a), statistics.median(steps_b)
        wall = f"; wall: first {walls[0]:.0f} s, second {walls[1]:.0f} s" if walls else ""
        print(f"\nmedian s/step: first {ma_s:.1f}, second {mb_s:.1f} (ratio {mb_s / ma_s:.2f}){wall}")
    return 0 if all(r["identical"] == r["items"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
