"""The closed-loop tables docs/research/study.md publishes, recomputed from the study CSVs it ships.

``python -m stare_research.tables docs/research/closed_loop_sft48.csv`` prints one table for a
closed-loop study's ``study.csv`` (one row per variant and seed), with both entropy estimators side
by side, each beside the target on its own scale:

- the sampled entropy (the gate's H-bar: the token-mean entropy of the kept batch's sampled tokens),
  against ``H_tgt`` (0.7 x the start's sampled entropy on its first RL draw, as the study set it);
- the held-out bank entropy (``eval/bank_entropy``: teacher-forced on a fixed bank of the start's
  episodes), against ``0.7 x`` the start's bank entropy, the same rule on the bank's scale.

The reward's interval is over the run's own steps (one seed: per-step noise within the run, not
between seeds), and the held-out accuracy is given at every evaluation, never as a best-of.
``stare-agent study --tables-of CSV`` gives the study's own table of the same CSV (AUC, dynamics).
``--paired A B`` adds variant A minus variant B seed by seed on both estimators, late windows, with the
95 % t interval over seeds (:func:`paired_over_seeds`).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stare_agent.intervals import format_ci, mean_sd_ci
from stare_research.study import finite

TARGET_FACTOR = 0.7  # H_tgt = 0.7 x the start's entropy (`stare-agent study --h-tgt-of-start 0.7`)
LATE_STEPS, LATE_EVALS, TRUNCATED_STEPS = 5, 2, 10
BANK, ACCURACY = "eval/bank_entropy", "eval/avg@2"
COLUMNS = (
    "bank entropy at the evaluations",
    f"bank entropy, last {LATE_EVALS} evals",
    f"sampled entropy, kept batch (the paper's H-bar), mean over trained steps / last {LATE_STEPS}",
    "trained steps with it below H_tgt",
    f"sampled entropy, whole draw (the drawn gate's reading), mean / last {LATE_STEPS}",
    "steps gate on",
    "reward on RL draws, mean ± 95 % t over the run's steps (within-run, one seed)",
    "held-out acc (sampled) at the evaluations",
    f"truncated, last {TRUNCATED_STEPS} steps",
    "L+ raising (1st order)",
    "gradient-mass weight",
    "s/step (median)",
)


def read_runs(path: str | Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """The rows of a study CSV by (variant, seed), in file order, empty cells left out."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = (row.pop("variant"), int(row.pop("seed")))
            record = {"step": int(row.pop("step")), **{k: _number(v) for k, v in row.items() if v != ""}}
            runs.setdefault(key, []).append(record)
    return runs


def closed_loop_table(path: str | Path) -> str:
    """The markdown table of a closed-loop study CSV (see the module's docstring)."""
    runs = read_runs(path)
    h_tgt = next(float(r["H_tgt"]) for recs in runs.values() for r in recs if finite(r.get("H_tgt")))
    bank_start = next(
        (float(r[BANK]) for recs in runs.values() for r in recs if r["step"] == 0 and finite(r.get(BANK))),
        math.nan,
    )
    evals = sorted(
        {r["step"] for recs in runs.values() for r in recs if r["step"] > 0 and finite(r.get(BANK))}
    )
    lines = [
        f"H_tgt = {h_tgt:.4g} (sampled entropy: {TARGET_FACTOR:g} x the start's {h_tgt / TARGET_FACTOR:.3f}); "
        f"bank entropy at the start {bank_start:.4f}, {TARGET_FACTOR:g} x that = {TARGET_FACTOR * bank_start:.4f} "
        f"(the same rule on the bank's scale); evaluations at steps {', '.join(map(str, evals))}.",
        "",
        "| variant | " + " | ".join(COLUMNS) + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    one_seed = len({v for v, _ in runs}) == len(runs)
    for (variant, seed), records in runs.items():
        name = variant if one_seed else f"{variant} s{seed}"
        lines.append(f"| {name} | " + " | ".join(_cells(records, h_tgt)) + " |")
    return "\n".join(lines) + "\n"


def _cells(records: list[dict[str, Any]], h_tgt: float) -> list[str]:
    steps = [r for r in records if r["step"] > 0]
    trained = [r for r in steps if not r.get("skipped") and finite(r.get("entropy"))]
    bank = [float(r[BANK]) for r in steps if finite(r.get(BANK))]
    # the paper's H-bar is the kept batch's; under research.gate_batch=drawn `entropy` is the whole
    # draw's (the gate's reading) and `stare/entropy_kept` the kept batch's
    drawn = any(finite(r.get("stare/entropy_kept")) for r in trained)
    sampled = [float(r["stare/entropy_kept"] if drawn else r["entropy"]) for r in trained]
    whole = [float(r["entropy"]) for r in trained] if drawn else []
    gate = [r for r in trained if finite(r.get("gate_on"))]
    rewards = [float(r["reward_mean"]) for r in steps if finite(r.get("reward_mean"))]
    truncated = [float(r["truncated_fraction"]) for r in steps if finite(r.get("truncated_fraction"))]
    gate_text = f"{sum(int(r['gate_on']) for r in gate)} of {len(gate)}"
    applies = any(finite(r.get("stare/L_plus")) for r in steps)  # GRPO-ds logs the gate it would have had
    return [
        ", ".join(f"{b:.4f}" for b in bank) or "-",
        f"{_mean(bank[-LATE_EVALS:]):.3f}" if bank else "-",
        f"{_mean(sampled):.3f} / {_mean(sampled[-LATE_STEPS:]):.3f}" if sampled else "-",
        f"{sum(h < h_tgt for h in sampled)} of {len(sampled)}",
        f"{_mean(whole):.3f} / {_mean(whole[-LATE_STEPS:]):.3f}" if whole else "-",
        gate_text if applies else f"({gate_text}, not applied)",
        format_ci(mean_sd_ci(rewards)) + f" (n {len(rewards)})" if rewards else "-",
        ", ".join(f"{float(r[ACCURACY]):.3f}" for r in steps if finite(r.get(ACCURACY))) or "-",
        f"{_mean(truncated[-TRUNCATED_STEPS:]):.3f}" if truncated else "-",
        _mean_of(steps, "stare/L_plus_raising"),
        _mean_of(steps, "stare/mass_weight"),
        _median_of(steps, "time/step_s"),
    ]


PAIRED_BANK_EVALS, PAIRED_SAMPLED_STEPS = 3, 10  # the placebo closed loop's late windows, stated first


def paired_over_seeds(path: str | Path, a: str, b: str) -> dict[str, Any]:
    """Variant ``a`` minus variant ``b``, seed by seed, on both estimators of a closed-loop study CSV.

    Per run: ``bank``, the mean held-out bank entropy of its last ``PAIRED_BANK_EVALS`` evaluations
    (steps 20, 25 and 30 of a 30-step run evaluated every 5), and ``sampled``, the mean H-bar of its
    last ``PAIRED_SAMPLED_STEPS`` trained steps (the kept batch's sampled entropy, H_tgt's estimator).
    Returns ``{"seeds", "a", "b", "bank", "sampled"}``, each estimator ``{"diffs", "stats"}`` with the
    per-seed differences and ``mean_sd_ci`` over them (95 % t, n - 1 degrees of freedom: between seeds).
    Only seeds both variants have count; none is a ``ValueError``.
    """
    runs = read_runs(path)
    seeds = sorted(s for v, s in runs if v == a and (b, s) in runs)
    if not seeds:
        have = sorted({v for v, _ in runs})
        raise ValueError(f"{path} has no seed with both {a!r} and {b!r} (variants: {', '.join(have)})")
    out: dict[str, Any] = {"seeds": seeds, "a": a, "b": b}
    for name, late in (("bank", _late_bank), ("sampled", _late_sampled)):
        diffs = [late(runs[(a, s)]) - late(runs[(b, s)]) for s in seeds]
        out[name] = {"diffs": diffs, "stats": mean_sd_ci(diffs)}
    return out


def _late_bank(records: list[dict[str, Any]]) -> float:
    bank = [float(r[BANK]) for r in records if r["step"] > 0 and finite(r.get(BANK))]
    return _mean(bank[-PAIRED_BANK_EVALS:]) if bank else math.nan


def _late_sampled(records: list[dict[str, Any]]) -> float:
    trained = [r for r in records if r["step"] > 0 and not r.get("skipped") and finite(r.get("entropy"))]
    key = "stare/entropy_kept" if any(finite(r.get("stare/entropy_kept")) for r in trained) else "entropy"
    sampled = [float(r[key]) for r in trained]
    return _mean(sampled[-PAIRED_SAMPLED_STEPS:]) if sampled else math.nan


def paired_table(path: str | Path, pairs: Sequence[tuple[str, str]]) -> str:
    """The markdown table of :func:`paired_over_seeds` for each ``(a, b)`` of ``pairs``."""
    lines = [
        "| difference | estimator | per seed | mean ± 95 % t over seeds | 95 % interval above 0 |",
        "|---|---|---|---:|---|",
    ]
    for a, b in pairs:
        paired = paired_over_seeds(path, a, b)
        for name, label in (
            ("bank", f"bank entropy, last {PAIRED_BANK_EVALS} evals"),
            ("sampled", f"sampled H-bar, last {PAIRED_SAMPLED_STEPS} trained steps"),
        ):
            diffs, stats = paired[name]["diffs"], paired[name]["stats"]
            per_seed = ", ".join(f"s{s} {d:+.4f}" for s, d in zip(paired["seeds"], diffs, strict=True))
            above = "yes" if stats["mean"] - stats["ci95"] > 0 else "no" if stats["n"] > 1 else "n/a (1 seed)"
            lines.append(
                f"| {a} - {b} | {label} | {per_seed} | {format_ci(stats, 4)} (n {stats['n']}) | {above} |"
            )
    return "\n".join(lines) + "\n"


def _mean_of(records: list[dict[str, Any]], key: str) -> str:
    values = [float(r[key]) for r in records if finite(r.get(key))]
    return f"{_mean(values):.3f}" if values else "-"


def _median_of(records: list[dict[str, Any]], key: str) -> str:
    values = sorted(float(r[key]) for r in records if finite(r.get(key)))
    return f"{values[len(values) // 2]:.0f}" if values else "-"


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path, help="a closed-loop study's study.csv")
    parser.add_argument(
        "--paired",
        nargs=2,
        action="append",
        default=[],
        metavar=("A", "B"),
        help="also variant A minus variant B, seed by seed, with its interval over seeds (repeatable)",
    )
    args = parser.parse_args(argv)
    for path in args.csv:
        print(f"{path}\n\n{closed_loop_table(path)}")
        if args.paired:
            try:
                print(paired_table(path, [tuple(p) for p in args.paired]))
            except ValueError as exc:
                parser.exit(2, f"error: {exc}\n")


__all__ = ["closed_loop_table", "paired_over_seeds", "paired_table", "read_runs"]


if __name__ == "__main__":
    main()
