"""Issue 31's entropy controls and STARE, paired on the saved batches of one closed-loop run (issue 25 item 6).

Every method trains, from the run's starting weights (the study's SFT model), on the SAME batches: the
episodes the GRPO-ds run of ``configs/closed_loop.yaml`` drew and saved (``trainer.save_rollouts``),
through ``stare-agent replay`` (``stare_research.replay.replay``: the trainer's own learner code). The
baseline is the replay of the run with its own config (GRPO-ds, which repeats the run's learner), in the
same table. Methods (``stare_research.study.VARIANTS``, at their defaults; H_tgt is the run's):
grpo-ds, entropy-bonus, kl-cov, clip-cov, forking-tokens, stare-o1 (W 1.1, the paper's gate on the
kept groups), stare-o1-w3-drawn (W 3, the gate on the whole draw: ours), both with L+ restricted to
the tokens whose reinforcement raises their position's entropy (ours, ``research.L_plus_rule=top_k_raising``),
and both with W on a random subset of T+ of L+'s size instead of L+ (their placebos,
``research.L_plus_rule=random``: STARE minus its placebo is the surprisal selection's share).

What a replay can show: how each learner moves the policy's entropy given the same data, on the
run's sampled tokens (``entropy``: the replayed policy teacher-forced on the run's kept episodes,
off-policy after step 1) and on the held-out bank (``eval/bank_entropy``, at the run's evaluation
steps and the last). What it cannot: reward (no episode is played, so every method's reward column
is the run's), and the closed loop itself (the samples never come from the replayed policy, so a
method's entropy cannot feed back into what it trains on, and the gate reads the replayed policy on
GRPO-ds's samples).

    .venv/bin/python benchmarks/closed_loop_replay.py --run runs/closed_loop/runs/grpo-ds-s0 \\
        --out runs/closed_loop/replay [--steps N] [--methods grpo-ds stare-o1 ...] [--csv replay.csv]
    .venv/bin/python benchmarks/closed_loop_replay.py --from-csv docs/research/replay_placebo.csv

With a STARE method and its placebo replayed beside GRPO-ds, a second table splits STARE minus GRPO-ds
into the surprisal selection's share (STARE minus its placebo) and any extra weight's (the placebo
minus GRPO-ds), with the criterion docs/research/study.md stated before the run. ``--csv`` keeps the
run's and the replays' per-step metrics (:data:`CSV_KEYS`), from which ``--from-csv`` prints the tables.

Resumable: a method whose replay finished is read, not rerun; an unfinished one is replayed again from
its start (a replay has no checkpoints). ``--table-only`` prints the table of what finished.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stare_agent.metrics import read_metrics
from stare_agent.provenance import machine
from stare_research.replay import ReplayError, check_overrides, replay, step_files
from stare_research.study import BANK_EVALS, BANK_KEY, EDGE_STEPS, VARIANTS, finite, run_numbers
from stare_research.tables import read_runs

METHODS = (
    "grpo-ds",
    "entropy-bonus",
    "kl-cov",
    "clip-cov",
    "forking-tokens",
    "stare-o1",
    "stare-o1-w3-drawn",
    "stare-o1-raising",
    "stare-o1-w3-drawn-raising",
    "stare-o1-placebo",
    "stare-o1-w3-drawn-placebo",
)


def finished(out: Path, steps: int) -> bool:
    if not (out / "metrics.jsonl").is_file():
        return False
    records = read_metrics(out)
    return bool(records) and records[-1]["step"] >= steps


def run_method(run: Path, out_root: Path, method: str, steps: int, overrides: Sequence[str] = ()) -> None:
    """Replay ``run``'s first ``steps`` with the study variant ``method``'s overrides, then ``overrides``
    (e.g. ``algorithm.ppo_epochs=4`` for every method), into ``out_root/method``."""
    out = out_root / method
    if finished(out, steps):
        print(f"[{method}] finished earlier: {out}", flush=True)
        return
    if out.exists():  # an interrupted replay: no checkpoints, so again from the start
        shutil.rmtree(out)
    t0 = time.perf_counter()
    settings = [*VARIANTS[method], *overrides]
    print(f"[{method}] replaying {steps} steps of {run} with {' '.join(settings)}", flush=True)
    replay(run, out, settings, steps=steps)
    gc.collect()
    print(f"[{method}] {time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)


CSV_KEYS = (
    "entropy",
    "gate_on",
    BANK_KEY,
    "reward_mean",
    "stare/L_plus",
    "stare/L_plus_placebo_overlap",
    "stare/entropy_kept",
    "stare/mean_weight",
    "frac_reweighted",
    "time/step_s",
)
"""The per-step metrics ``--csv`` keeps of each replay (and of the source run, as method ``run``): what
the tables read, and the placebo's overlap with L+."""
RUN = "run"


def collect(run: Path, out_root: Path, methods: list[str], steps: int) -> dict[str, list[dict[str, Any]]]:
    """Each finished replay's records by method (one cut short, e.g. by ``timeout``, is left out: it
    reads as not run), and the source run's first ``steps`` as ``run``, led by the start's evaluation
    (step 0) where the study saved it."""
    starts = run.parent.parent / "start_eval.json"
    start = json.loads(starts.read_text()).get("0", {}) if starts.is_file() else {}
    records = {RUN: ([{"step": 0, **start}] if start else []) + read_metrics(run)[:steps]}
    for method in methods:
        if finished(out_root / method, steps):
            records[method] = read_metrics(out_root / method)
    return records


def write_csv(records: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """``records`` as a study-format CSV (``variant`` = the method, ``seed`` 0), :data:`CSV_KEYS` only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["variant", "seed", "step", *CSV_KEYS], extrasaction="ignore")
        writer.writeheader()
        for method, recs in records.items():
            writer.writerows({"variant": method, "seed": 0, **r} for r in recs)


def read_csv(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The records :func:`write_csv` wrote, by method, else exit with the cause."""
    runs = read_runs(path)
    if not runs or (RUN, 0) not in runs:
        raise SystemExit(
            f"{path}: not a replay CSV of this benchmark (no '{RUN}' rows; write one with --csv)"
        )
    return {method: recs for (method, _), recs in runs.items()}


def table(records: dict[str, list[dict[str, Any]]], methods: list[str]) -> str:
    """The replays' table: each method's entropy on the run's samples and on the held-out bank, minus
    GRPO-ds's replay; led by the source run's numbers."""
    ran = run_numbers([r for r in records[RUN] if r["step"] > 0])
    rows = [
        "| method | steps | sampled-token entropy, first 5 | sampled-token entropy, last 5 | "
        f"bank entropy, last {BANK_EVALS} evals | - GRPO-ds's replay | bank entropy, each eval | gate on | "
        "s/step (median) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    base_bank = run_numbers(records["grpo-ds"]).get("bank_entropy_late") if "grpo-ds" in records else None
    for method in methods:
        if method not in records:
            rows.append(f"| {method} | - | not run | | | | | | |")
            continue
        recs = records[method]
        n = run_numbers(recs)
        bank = ", ".join(f"{r['step']}: {r[BANK_KEY]:.4f}" for r in recs if finite(r.get(BANK_KEY)))

        def cell(key: str, digits: int = 4, n=n) -> str:
            return f"{n[key]:.{digits}f}" if key in n else "-"

        late = n.get("bank_entropy_late")
        diff = "-" if late is None or base_bank is None or method == "grpo-ds" else f"{late - base_bank:+.4f}"
        rows.append(
            f"| {method} | {recs[-1]['step']} | {cell('entropy_early')} | {cell('entropy_late')} | "
            f"{cell('bank_entropy_late')} | {diff} | {bank} | {cell('gate_on', 2)} | {cell('seconds_per_step', 1)} |"
        )
    start = next((r[BANK_KEY] for r in records[RUN] if r["step"] == 0 and finite(r.get(BANK_KEY))), None)
    head = (
        f"Reward on these batches (the run's, the same for every method): {ran.get('reward', math.nan):.3f} "
        f"(mean over steps). The run itself: sampled-token entropy first/last {EDGE_STEPS} steps "
        f"{ran.get('entropy_early', math.nan):.4f} / {ran.get('entropy_late', math.nan):.4f}, "
        f"bank entropy last {BANK_EVALS} evals {ran.get('bank_entropy_late', math.nan):.4f}"
        + (f"; the start's bank entropy {start:.4f}." if start is not None else ".")
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def _bank(records: list[dict[str, Any]]) -> dict[int, float]:
    return {r["step"]: float(r[BANK_KEY]) for r in records if r["step"] > 0 and finite(r.get(BANK_KEY))}


def placebo_table(records: dict[str, list[dict[str, Any]]]) -> str:
    """Each STARE method whose placebo (``<method>-placebo``) and GRPO-ds replayed: STARE minus GRPO-ds
    split into the surprisal selection's share (STARE minus its placebo) and the extra weight's (the
    placebo minus GRPO-ds), at each evaluation and late (the mean of the last :data:`BANK_EVALS`), and
    the criterion the study stated before the run: the selection carries STARE's lowering if STARE
    minus GRPO-ds is below 0 late, STARE minus its placebo is below 0 at all evaluations but at most
    one, and late it is at least half of STARE minus GRPO-ds. Every other method (no placebo beside it)
    gets its row minus GRPO-ds. Empty without GRPO-ds's replay or another method."""
    if "grpo-ds" not in records:
        return ""
    pairs = [m for m in records if f"{m}-placebo" in records]
    alone = [
        m
        for m in records
        if m not in (RUN, "grpo-ds")
        and m not in pairs
        and not (m.endswith("-placebo") and m[: -len("-placebo")] in pairs)
    ]
    if not pairs and not alone:
        return ""
    base = _bank(records["grpo-ds"])
    evals = sorted(base)
    lines = [
        "| difference of bank entropy | "
        + " | ".join(f"step {s}" for s in evals)
        + f" | late (last {BANK_EVALS}) | evaluations below 0 |",
        "|---|" + "---:|" * (len(evals) + 2),
    ]
    verdicts = []

    def row(label: str, a: dict[int, float], b: dict[int, float]) -> tuple[list[float], float]:
        d = [a[s] - b[s] for s in evals]
        late = sum(d[-BANK_EVALS:]) / BANK_EVALS
        below = sum(x < 0 for x in d)
        lines.append(
            f"| {label} | " + " | ".join(f"{x:+.5f}" for x in d) + f" | {late:+.5f} | {below}/{len(d)} |"
        )
        return d, late

    def bank_of(method: str, name: str) -> dict[int, float]:
        bank = _bank(records[name])
        if set(bank) != set(evals):
            whose = "its replay" if name == method else "its replay or its placebo's"
            raise SystemExit(f"{method}: {whose} is unfinished (evaluations differ from GRPO-ds's)")
        return bank

    for method in alone:
        row(f"{method} - grpo-ds", bank_of(method, method), base)
    for method in pairs:
        stare, placebo = bank_of(method, method), bank_of(method, f"{method}-placebo")
        _, total = row(f"{method} - grpo-ds", stare, base)
        sel, sel_late = row(f"{method} - {method}-placebo (the selection)", stare, placebo)
        row(f"{method}-placebo - grpo-ds (any extra weight)", placebo, base)
        share = sel_late / total if total else math.nan
        below = sum(x < 0 for x in sel)
        met = total < 0 and below >= len(sel) - 1 and share >= 0.5
        overlap = [
            float(r["stare/L_plus_placebo_overlap"])
            for r in records[f"{method}-placebo"]
            if finite(r.get("stare/L_plus_placebo_overlap"))
        ]
        verdicts.append(
            f"criterion, {method}: minus GRPO-ds late {total:+.5f}, minus its placebo below 0 at {below}/{len(sel)} "
            f"evaluations, late {sel_late:+.5f} = {share:.2f} of minus GRPO-ds: "
            + (
                "MET (the surprisal selection carries the lowering)"
                if met
                else "NOT MET (the lowering is not put on the selection)"
            )
            + (
                f"; the placebo's draw shares {sum(overlap) / len(overlap):.2f} of its tokens with L+ (mean over steps)"
                if overlap
                else ""
            )
        )
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(verdicts) + "\n" if verdicts else "")


def tables_of_csv(path: str | Path) -> str:
    """The tables of a shipped ``--csv`` (no machine line: the page gives it), as ``--from-csv`` prints
    them; tests/research/test_published_tables.py compares them with the page."""
    records = read_csv(Path(path))
    methods = [m for m in records if m != RUN]
    text = table(records, methods)
    paired = placebo_table(records)
    return text + ("\n" + paired if paired else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, help="the GRPO-ds run of the closed-loop study")
    ap.add_argument("--out", type=Path, help="one replay directory per method under it")
    ap.add_argument("--steps", type=int, default=None, help="replay only the first N saved steps")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument(
        "--overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="learner settings for every method, after its own (e.g. algorithm.ppo_epochs=4)",
    )
    ap.add_argument("--table-only", action="store_true", help="replay nothing: the table of what finished")
    ap.add_argument("--csv", type=Path, help="also write the run's and the replays' per-step metrics here")
    ap.add_argument("--from-csv", type=Path, help="replay nothing: the tables of a CSV --csv wrote")
    args = ap.parse_args()
    if args.from_csv:
        print(tables_of_csv(args.from_csv))
        return
    if args.run is None or args.out is None:
        ap.error("--run and --out are required (or --from-csv)")
    try:
        check_overrides(args.overrides)
    except ReplayError as e:
        raise SystemExit(f"--overrides: {e}") from None
    steps = len(step_files(args.run, args.steps))
    if not args.table_only:
        for method in args.methods:
            run_method(args.run, args.out, method, steps, args.overrides)
    records = collect(args.run, args.out, args.methods, steps)
    paired = placebo_table(records)
    text = (
        f"Replays of {args.run} (first {steps} steps)"
        + (f" with {' '.join(args.overrides)} for every method" if args.overrides else "")
        + f", {machine()}, load average {os.getloadavg()[0]:.1f} at the end. {table(records, args.methods)}"
        + ("\n" + paired if paired else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_table.md").write_text(text)
    if args.csv:
        write_csv(records, args.csv)
    print(text)


if __name__ == "__main__":
    main()
