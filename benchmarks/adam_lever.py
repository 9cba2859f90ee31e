"""Real Adam steps of STARE-C2's L- lever (and of W on L+) from one start, against first order (issue 44).

The one STARE result in the study that points the paper's way (docs/research/study.md, "At the
higher-entropy start (bank 0.368)") is first order only: at that start, attenuating L- by M = 0.9
(C2) moved the held-out bank's entropy up against GRPO-ds's in 23 of 23 batches, +0.0063 ± 0.0015 a
step, for an infinitesimal SGD step. This benchmark takes REAL optimizer steps of the project's
learner instead.

Design (written before the first real run):

1. The start, its bank and its batches come from a run (``--from-run``, e.g. the lr = 1e-30 "draws"
   run of ``grpo-ds-s0``'s config, whose weights never move, so every saved batch is an on-policy
   batch of the start): ``model.name_or_path`` of the run, its ``research.entropy_bank`` and the
   groups its dynamic sampling kept, in order, with the run's rewards.
2. The learner is the project's own (``stare_agent.train.learner.Learner.from_config`` of the run's
   config: DeepSpeed at the config's ZeRO stage and precision, torch AdamW with the config's betas,
   eps and weight decay, gradient clipping at ``optim.grad_clip``). Warm Adam: the first ``--warm``
   kept batches go through ``Learner.update`` with GRPO-ds's loss at the run's own lr (1e-30, below
   float32 resolution: checked, at most 1e-20 per weight; the measured steps start from the saved start
   weights themselves), so m and v hold ``--warm`` GRPO-ds gradients of the start. That optimizer
   state (and the lr schedule's) is kept.
3. On each of the next ``--batches`` kept batches, from the SAME start weights and the SAME warm
   optimizer state (restored before every step), ONE real ``Learner.update`` per arm and per lr
   (``--lrs``, default 1e-6, the paper's, and 1e-5, the closed loop's):

   - ``grpo_ds``: every weight 1 (``weights=None``, GRPO-ds's loss);
   - ``c2_lever``: C2's lever alone, M = ``--M`` (0.9) on L-, W = 1 on L+, the gate forced on;
   - ``lplus_lever``: O1's lever alone, W = ``--W`` (3) on L+, the gate forced on;
   - ``c2_placebo`` (added after the first real run, plan written before its own run): the same M on a
     seeded uniformly random subset of T- of exactly |L-| tokens, drawn inside each selection block of
     L- (each micro-batch in the ``micro_batch`` scope, ``stare_research.placebo.random_subset``), W = 1 elsewhere; the
     seed is ``--placebo-seed * 1_000_003 + the run's step`` (fixed per batch, recorded as
     ``placebo_seed``). ONE draw per batch: the placebo's numbers are one random subset per batch,
     not an expectation over subsets.

   The weights are ``stare_weights`` of the pre-update log-probs with the run's ``algorithm.P`` and
   ``algorithm.scope`` (``micro_batch``: inside the learner's own micro-batches, as the trainer
   selects), the run's advantages (``grpo_advantages`` over the kept groups), ``policy_loss`` inside
   ``Learner.update``: the arms differ in their weights only.
4. After each step the held-out bank's entropy ``H_bank`` is measured (fp32 logits, every token's
   entropy summed in fp64: ``benchmarks/entropy_response.bank_entropy_by_rows``; the study's
   ``eval/bank_entropy``, which sums in fp32, is logged at the start beside it): ``dH = H_after -
   H_start``. The paired LEVER EFFECT of an arm is ``dH_arm - dH_grpo_ds`` (same batch, same lr, same
   start, same Adam state).
5. First order, preconditioned by Adam: the real displacement ``dtheta = theta_after - theta_start``
   of each step is known exactly, and ``h = grad H_bank`` at the start (one backward through the bank,
   fp32, ``benchmarks/entropy_response.bank_entropy_by_rows``), so an arm's first-order prediction is
   ``<h, dtheta_arm>`` and the lever's is ``<h, dtheta_arm - dtheta_grpo_ds>``. Adam's step is
   ``-lr m_hat / (sqrt(v_hat) + eps)`` of the clipped gradient, so the prediction carries Adam's
   preconditioning (v_hat) and its momentum (m_hat: after ``--warm`` steps the new gradient enters
   m_hat with weight (1 - beta1) / (1 - beta1^(warm + 1)), 0.24 for 4 warm steps at beta1 0.9, the
   same for every arm), unlike the SGD direction of ``benchmarks/entropy_response.py``.
6. Statistics: per lr and arm, mean ± 95 % t half-width over the batches (sample SD, t with n - 1
   degrees of freedom: ``stare_agent.intervals.mean_sd_ci``), the batches where it is > 0, the
   measured / predicted ratio per batch and the batches where the two signs agree. The intervals are
   over the batches of ONE start and ONE bank: they do not cover other starts, banks or seeds.

Pre-stated criterion (before any real number was seen): C2's sign survives real Adam steps at a given
lr if the paired lever effect of M 0.9 on L- (``dH_c2_lever - dH_grpo_ds``) has a 95 % t interval over
the batches entirely above 0. The same reading is reported for W 3 on L+ (its sign either way).

Pre-stated placebo criterion (written before the placebo arm's first real run, issue 44): the surprisal
selection matters for the lever at a given lr if C2-lever minus placebo (``dH_c2_lever -
dH_c2_placebo``, same batch) has a 95 % t interval over the batches entirely above 0; if the interval
holds 0, the lever's effect is not shown to depend on which T- tokens are chosen.

``--merge RECORDS_JSON`` measures only ``--arms`` (arms the earlier records lack) on the earlier run's
batches and merges: the same start and bank (H_bank at the start equal to 1e-12), the same warm Adam
state made the same way (the same ``--warm`` batches through ``Learner.update``), the same batches
(step, tokens, |L-|, |L+| checked per batch), the same ``--lrs`` and ``M``; GRPO-ds is re-measured on
the first batch at every lr and must reproduce its recorded dH to 1e-9 (printed as ``CHECK``), else
the run stops without merging. Only the new arm's records are added; the earlier ones are kept as
recorded. The new arm's ``lever_disp_norm`` is NaN on batches without a GRPO-ds step in this run.
The check catches a changed learner: after 58e2ed8 (micro-batches cut at other rows) the warm gradients
differ from the first run's, so the placebo run of the study ran this file on the tree of 58e2ed8's parent.

Output in ``--out``: ``records.json`` (meta and one record per batch x lr x arm, written after every
batch, so a stopped run keeps what it measured), ``records.csv`` (the same records, the table's data:
``--from-csv`` reprints the table from it), ``summary.json``.

    .venv/bin/python benchmarks/adam_lever.py --quick --out /tmp/adam_lever_quick
    .venv/bin/python benchmarks/adam_lever.py --from-run runs/closed_loop_sft48/runs/draws --warm 4 \\
        --batches 10 --out runs/adam_lever_sft48
    .venv/bin/python benchmarks/adam_lever.py --from-run runs/closed_loop_sft48/runs/draws --warm 4 \
        --batches 13 --arms c2_placebo --merge runs/adam_lever_sft48/records.json \
        --out runs/adam_lever_sft48_placebo          # the placebo arm alone, merged with the earlier run
    .venv/bin/python benchmarks/adam_lever.py --from-csv docs/research/adam_lever_sft48.csv   # the table
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stare_agent.intervals import mean_sd_ci  # noqa: E402
from stare_research.placebo import placebo_seed, random_subset  # noqa: E402

ARMS = ("grpo_ds", "c2_lever", "lplus_lever", "c2_placebo")
# the placebo's paired comparison: C2's lever (surprisal-selected L-) minus the same M on a random subset
PLACEBO_PAIR = "c2_lever - c2_placebo"
CSV_FIELDS = (
    "batch",
    "step",
    "tokens",
    "n_L_minus",
    "n_L_plus",
    "lr",
    "arm",
    "H_start",
    "H_after",
    "dH",
    "predicted",
    "grad_norm",
    "loss",
    "disp_norm",
    "lever_disp_norm",
    "warm",
    "M",
    "W",
    "sgd_per_lr",
    "placebo_seed",
)
# columns a CSV written before the placebo arm lacks
OPTIONAL_FIELDS = ("placebo_seed",)


# ------------------------------------------------------------------------------------ pure part


def displacement_response(
    h: Sequence[torch.Tensor], params: Sequence[torch.Tensor], start: Sequence[torch.Tensor]
) -> float:
    """``<h, theta - theta_start>`` in float64, parameter by parameter: the first-order change of the
    function whose gradient is ``h`` along the real displacement of ``params`` from ``start``."""
    total = 0.0
    for hp, p, p0 in zip(h, params, start, strict=True):
        total += float((hp.double() * (p.detach().double() - p0.double())).sum())
    return total


def interval(xs: Sequence[float]) -> dict[str, float]:
    """Mean, 95 % t half-width (NaN for one value), the interval's ends, n and the count above 0."""
    s = mean_sd_ci(list(xs))
    return {
        "mean": s["mean"],
        "ci95": s["ci95"],
        "low": s["mean"] - s["ci95"],
        "high": s["mean"] + s["ci95"],
        "n": s["n"],
        "above_0": sum(x > 0 for x in xs),
    }


def compare(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, Any]:
    """A measured quantity against its first-order prediction, batch by batch (paired): the two
    intervals, measured / predicted per batch (batches with a prediction of exactly 0 left out) and
    the ratio of the means, and the batches where the signs agree."""
    if len(measured) != len(predicted) or not measured:
        raise ValueError(f"compare needs paired, non-empty lists: got {len(measured)} and {len(predicted)}")
    ratios = [m / p for m, p in zip(measured, predicted, strict=True) if p != 0]
    mean_pred = sum(predicted) / len(predicted)
    return {
        "measured": interval(measured),
        "predicted": interval(predicted),
        "ratio": interval(ratios) if ratios else None,
        "ratio_of_means": (sum(measured) / len(measured)) / mean_pred if mean_pred else math.nan,
        "sign_agree": sum((m > 0) == (p > 0) for m, p in zip(measured, predicted, strict=True)),
        "n": len(measured),
    }


def criterion_met(stats: dict[str, float]) -> bool:
    """The pre-stated criterion: the 95 % t interval lies entirely above 0 (needs 2 or more batches)."""
    return stats["n"] >= 2 and not math.isnan(stats["ci95"]) and stats["low"] > 0


def arms_of(records: Sequence[dict[str, Any]]) -> list[str]:
    """The arms the records hold, in ``ARMS`` order (GRPO-ds first: every lever is paired with it)."""
    have = {r["arm"] for r in records}
    if "grpo_ds" not in have:
        raise ValueError("the records hold no grpo_ds arm: every lever is paired with it")
    return [a for a in ARMS if a in have]


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per lr: each arm's own dH against ``<h, dtheta>``, and each lever's paired effect (arm minus
    GRPO-ds on the same batch) against ``<h, dtheta_arm - dtheta_grpo_ds>``."""
    out: dict[str, Any] = {}
    lrs = sorted({float(r["lr"]) for r in records})
    present = arms_of(records)
    for lr in lrs:
        by = {(int(r["batch"]), r["arm"]): r for r in records if float(r["lr"]) == lr}
        batches = sorted({b for b, arm in by if all((b, a) in by for a in present)})
        if not batches:
            continue
        per: dict[str, Any] = {"batches": len(batches)}
        for arm in present:
            rows = [by[(b, arm)] for b in batches]
            per[arm] = compare([float(r["dH"]) for r in rows], [float(r["predicted"]) for r in rows])
        pairs = [(arm, "grpo_ds") for arm in present[1:]]
        if "c2_lever" in present and "c2_placebo" in present:
            pairs.append(("c2_lever", "c2_placebo"))
        for arm, base in pairs:
            meas = [float(by[(b, arm)]["dH"]) - float(by[(b, base)]["dH"]) for b in batches]
            pred = [float(by[(b, arm)]["predicted"]) - float(by[(b, base)]["predicted"]) for b in batches]
            lever = compare(meas, pred)
            lever["criterion_met"] = criterion_met(lever["measured"])
            if all(by[(b, a)].get("sgd_per_lr") not in (None, "") for b in batches for a in (arm, base)):
                lever["sgd_per_lr"] = interval(
                    [float(by[(b, arm)]["sgd_per_lr"]) - float(by[(b, base)]["sgd_per_lr"]) for b in batches]
                )
            per[f"{arm} - {base}"] = lever
        out[f"{lr:g}"] = per
    return out


# ------------------------------------------------------------------------------------ the table


def _fmt(s: dict[str, float] | None, digits: int = 2) -> str:
    if s is None:
        return "n/a"
    if math.isnan(s["ci95"]):
        return f"{s['mean']:+.{digits}e}"
    return f"{s['mean']:+.{digits}e} ± {s['ci95']:.{digits - 1}e}"


def _ratio(c: dict[str, Any]) -> str:
    r = c["ratio"]
    per_batch = (
        "n/a"
        if r is None
        else (f"{r['mean']:.2f}" if math.isnan(r["ci95"]) else f"{r['mean']:.2f} ± {r['ci95']:.2f}")
    )
    return f"{per_batch} ({c['ratio_of_means']:.2f})"


def _paired_row(lr: str, name: str, c: dict[str, Any], n: int) -> str:
    """A paired comparison's table row, with the criterion's verdict."""
    verdict = "yes" if c["criterion_met"] else "no"
    return (
        f"| {lr} | {name} | {_fmt(c['measured'])} | {c['measured']['above_0']}/{n} | "
        f"{_fmt(c['predicted'])} | {_ratio(c)} | {c['sign_agree']}/{n} | {verdict} |"
    )


def tables(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The result as markdown tables and the criterion's verdict at each lr."""
    lines = [
        f"One real optimizer step per arm from the start (H_bank {meta['H_start']:.4f}) and the warm Adam "
        f"state ({meta['warm']} GRPO-ds batches); M {meta['M']:g} on L- (c2_lever), W {meta['W']:g} on L+ "
        "(lplus_lever); mean ± 95 % t half-width over the batches of one start and one bank",
        "",
        "| lr | arm | dH_bank measured | batches > 0 | first order <h, dtheta> | measured / predicted, per batch (of means) | signs agree |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for lr, per in summary.items():
        n = per["batches"]
        for arm in (a for a in ARMS if a in per):
            c = per[arm]
            lines.append(
                f"| {lr} | {arm} | {_fmt(c['measured'])} | {c['measured']['above_0']}/{n} | "
                f"{_fmt(c['predicted'])} | {_ratio(c)} | {c['sign_agree']}/{n} |"
            )
    lines += [
        "",
        "| lr | lever (arm minus GRPO-ds, paired) | measured | batches > 0 | first order <h, dtheta_arm - dtheta_grpo_ds> | measured / predicted, per batch (of means) | signs agree | 95 % interval above 0 |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for lr, per in summary.items():
        n = per["batches"]
        for arm in (a for a in ARMS[1:] if a in per):
            lines.append(_paired_row(lr, arm, per[f"{arm} - grpo_ds"], n))
    first = next(iter(summary.values()), None)
    if first is not None and "sgd_per_lr" in first["c2_lever - grpo_ds"]:
        n = first["batches"]
        lines += [
            "",
            "| lever, first order along the SGD direction (the clipped gradient), per unit lr | mean ± 95 % | batches > 0 |",
            "|---|---:|---:|",
        ]
        for arm in (a for a in ARMS[1:] if a in first):
            c = first[f"{arm} - grpo_ds"]["sgd_per_lr"]
            lines.append(f"| {arm} | {_fmt(c)} | {c['above_0']}/{n} |")
    if first is not None and PLACEBO_PAIR in first:
        lines += [
            "",
            f"Placebo: c2_placebo is M {meta['M']:g} on ONE seeded uniformly random subset of T- per batch, of "
            "exactly |L-| tokens in each micro-batch (one draw, not an expectation over subsets)",
            "",
            "| lr | C2's lever minus placebo (paired) | measured | batches > 0 | first order | measured / predicted, per batch (of means) | signs agree | 95 % interval above 0 |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for lr, per in summary.items():
            n = per["batches"]
            lines.append(_paired_row(lr, PLACEBO_PAIR, per[PLACEBO_PAIR], n))
    lines.append("")
    for lr, per in summary.items():
        c = per["c2_lever - grpo_ds"]
        verdict = "MET" if c["criterion_met"] else "NOT met"
        lines.append(
            f"criterion at lr {lr}: C2's lever {_fmt(c['measured'])} "
            f"[{c['measured']['low']:+.2e}, {c['measured']['high']:+.2e}]: {verdict}"
        )
    for lr, per in summary.items():
        if PLACEBO_PAIR not in per:
            continue
        c = per[PLACEBO_PAIR]
        verdict = (
            "MET (the surprisal selection matters)"
            if c["criterion_met"]
            else "NOT met (the lever's effect is not shown to depend on which T- tokens are chosen)"
        )
        lines.append(
            f"placebo criterion at lr {lr}: C2's lever minus placebo {_fmt(c['measured'])} "
            f"[{c['measured']['low']:+.2e}, {c['measured']['high']:+.2e}]: {verdict}"
        )
    return "\n".join(lines)


def table(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """:func:`tables`, then the machine and the command."""
    lines = [
        tables(summary, meta),
        "",
        f"machine: {meta.get('machine', '?')}",
        f"command: {meta.get('command', '?')}",
    ]
    if meta.get("wall_s") is not None:
        lines.append(f"wall: {meta['wall_s']:.0f} s; {meta.get('date', '')}")
    return "\n".join(lines)


def write_csv(records: Sequence[dict[str, Any]], path: Path, fields: Sequence[str] = CSV_FIELDS) -> None:
    """The records' ``fields`` as a CSV (other keys left out)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)


def read_csv(
    path: Path, fields: Sequence[str] = CSV_FIELDS, optional: Sequence[str] = OPTIONAL_FIELDS
) -> list[dict[str, Any]]:
    """The rows of a records CSV with every one of ``fields`` but the ``optional`` ones, else exit."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or set(fields) - set(optional) - set(rows[0]):
        raise SystemExit(f"{path}: not a records.csv of this benchmark (columns {', '.join(fields)})")
    return rows


def csv_meta(path: Path, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The table's header numbers from a CSV and its ``.json`` neighbour, when there is one."""
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text()) if side.is_file() else {}
    meta.setdefault("H_start", float(rows[0]["H_start"]))
    meta.setdefault("warm", int(rows[0]["warm"]))
    for key in ("M", "W"):
        meta.setdefault(key, float(rows[0][key]))
    return meta


def tables_of_csv(path: str | Path) -> str:
    """The published tables and criterion lines of a shipped ``records.csv`` (no machine line: the page
    gives it), as ``--from-csv`` prints them; tests/research/test_published_tables.py compares them."""
    rows = read_csv(Path(path))
    return tables(summarize(rows), csv_meta(Path(path), rows))


# ------------------------------------------------------------------------------------ the run


def quick_data(tok: Any, n_batches: int, seed: int = 0):
    """Tiny synthetic batches (2 groups of 4 episodes, random tokens, rewards with variance) and a
    bank of 4 episodes, for the ``--quick`` smoke run on the tiny random model."""
    from stare_envs.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)
    vocab = min(int(tok.vocab_size), 2000)

    def episode(reward: float) -> Trajectory:
        prompt = torch.randint(10, vocab, (6,), generator=g).tolist()
        n = int(torch.randint(4, 12, (1,), generator=g))
        response = torch.randint(10, vocab, (n,), generator=g).tolist()
        return Trajectory(prompt, response, [1] * n, [0.0] * n, [(0, n)], reward)

    batches = []
    for b in range(n_batches):
        rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
        episodes = [episode(r) for r in rewards]
        batches.append(
            {
                "step": b + 1,
                "episodes": episodes,
                "rewards": torch.tensor(rewards),
                "group_index": torch.tensor([0] * 4 + [1] * 4),
                "sequence_ids": torch.arange(8),
            }
        )
    return batches, [episode(0.0) for _ in range(4)]


def run_batches(run_dir: Path):
    """The kept groups of every saved step of a run, in step order (``stare_research.replay.load_step``)."""
    from stare_research.replay import load_step, step_files

    out = []
    for step, path in step_files(run_dir):
        _, kept = load_step(path)
        if kept:
            out.append(
                {
                    "step": step,
                    "episodes": [t for g in kept for t in g.trajectories],
                    "rewards": torch.tensor([r for g in kept for r in g.rewards], dtype=torch.float32),
                    "group_index": torch.tensor([i for i, g in enumerate(kept) for _ in g.rewards]),
                    "sequence_ids": torch.tensor([gid for g in kept for gid in g.global_ids]),
                }
            )
    return out


def machine_line() -> str:
    """:func:`stare_agent.provenance.machine`, then the run's torch threads, load average, OS and torch."""
    import os
    import platform

    from stare_agent.provenance import machine

    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{machine()}, {torch.get_num_threads()} torch threads, load average {load}, "
        f"{platform.platform()}, torch {torch.__version__}"
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--from-run", type=Path, default=None, help="the run whose start, bank and kept batches are used"
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: tiny random model, synthetic batches and bank"
    )
    ap.add_argument(
        "--warm", type=int, default=4, help="kept batches that warm Adam (GRPO-ds at the run's lr)"
    )
    ap.add_argument("--batches", type=int, default=10, help="kept batches measured after the warm ones")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--M", type=float, default=0.9, help="C2's weight on L- (c2_lever)")
    ap.add_argument("--W", type=float, default=3.0, help="the weight on L+ (lplus_lever)")
    ap.add_argument(
        "--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms measured (default: all)"
    )
    ap.add_argument(
        "--placebo-seed",
        type=int,
        default=0,
        help="c2_placebo's subset of a batch is drawn with seed placebo_seed * 1_000_003 + the run's step",
    )
    ap.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="a records.json of an earlier run of the same start: measure only --arms (not in it) on its "
        "batches, re-measure grpo_ds on the first batch as a check (|dH - recorded| <= 1e-9 at every lr, "
        "else stop), and write the merged records to --out",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-csv", type=Path, default=None, help="reprint the table of a records.csv and exit")
    args = ap.parse_args(argv)
    if args.from_csv is not None:
        rows = read_csv(args.from_csv)
        summary = summarize(rows)
        print(table(summary, csv_meta(args.from_csv, rows)))
        return summary
    if args.out is None:
        ap.error("--out is required (or --from-csv CSV to reprint a table)")
    if args.quick == (args.from_run is not None):
        ap.error("give exactly one of --from-run RUN (the real measurement) and --quick (the smoke run)")
    if args.warm < 1 or args.batches < 1:
        ap.error(
            f"--warm {args.warm} --batches {args.batches}: both must be >= 1 (Adam is warmed, then measured)"
        )
    if args.from_run is not None and not (args.from_run / "config.yaml").is_file():
        raise SystemExit(
            f"--from-run {args.from_run}: no config.yaml: pass a run directory (trainer.run_dir)"
        )
    if args.quick:
        args.batches, args.warm = min(args.batches, 2), min(args.warm, 1)
    if "grpo_ds" not in args.arms and args.merge is None:
        ap.error(
            "--arms must include grpo_ds (every lever is paired with it), or --merge an earlier run's records"
        )
    if args.merge is not None:
        earlier = json.loads(args.merge.read_text())
        old_meta, old_records = earlier["meta"], earlier["records"]
        have = {r["arm"] for r in old_records}
        if set(args.arms) & have:
            ap.error(
                f"--merge {args.merge} already holds arms {sorted(set(args.arms) & have)}: leave them out of --arms"
            )
        old_lrs = sorted({float(r["lr"]) for r in old_records})
        clash = {
            "--from-run": (
                str(args.from_run) if args.from_run else "quick (tiny random model)",
                old_meta.get("run"),
            ),
            "--warm": (args.warm, old_meta.get("warm")),
            "--M": (args.M, old_meta.get("M")),
            "--lrs": (sorted(args.lrs), old_lrs),
            "--batches": (args.batches, 1 + max(int(r["batch"]) for r in old_records)),
        }
        bad = {k: v for k, v in clash.items() if v[0] != v[1]}
        if bad:
            ap.error(
                f"--merge {args.merge}: this run differs from the earlier one in "
                + ", ".join(f"{k} {a} (earlier {b})" for k, (a, b) in bad.items())
            )
        args.merge_data = earlier
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    return measure(args)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.entropy_response import bank_entropy_by_rows, episode_rows
    from stare_agent.algorithms.advantages import broadcast_to_tokens, grpo_advantages
    from stare_agent.algorithms.selection import selection_blocks
    from stare_agent.algorithms.stare import stare_weights
    from stare_agent.config import CONFIG_FILENAME
    from stare_agent.train.batch import collate
    from stare_agent.train.learner import Learner
    from stare_research.config import load_research_config
    from stare_research.entropy_bank import bank_entropy, read_bank

    t0 = time.time()

    def log(*a: Any) -> None:
        print(f"[{time.time() - t0:7.1f}s]", *a, flush=True)

    if args.quick:
        from stare_agent.models import tiny_model

        config = load_research_config(
            None,
            [
                "deepspeed.precision=fp32",
                "optim.lr=1e-30",
                "optim.weight_decay=0",
                "algorithm.rollout_correction.mode=none",
            ],
        )
        model, tok = tiny_model()
        data, bank = quick_data(tok, args.warm + args.batches)
    else:
        from stare_agent.train.deepspeed_setup import load_training_policy

        config_file = args.from_run / CONFIG_FILENAME
        if not config_file.is_file():
            raise SystemExit(
                f"--from-run {args.from_run}: no {CONFIG_FILENAME}: pass a run directory (trainer.run_dir)"
            )
        config = load_research_config(config_file)
        if not config.research.entropy_bank:
            raise SystemExit(
                f"--from-run {args.from_run}: the run has no research.entropy_bank: use a study run's"
            )
        data = run_batches(args.from_run)
        bank = read_bank(config.research.entropy_bank)
        model, tok = load_training_policy(config)
    need = args.warm + 1
    if len(data) < need:
        raise SystemExit(
            f"{args.from_run}: {len(data)} kept batches, --warm {args.warm} needs at least {need}: "
            "run the draws run with more trainer.steps, or lower --warm"
        )
    alg = config.algorithm
    if (
        alg.ppo_epochs != 1
        or alg.ppo_mini_batch_size is not None
        or alg.rollout_correction.mode not in ("none",)
    ):
        raise SystemExit(
            "the run takes several optimizer steps a batch or corrects rollouts (algorithm.ppo_*, "
            "rollout_correction): this benchmark takes one on-policy step a batch; use a run with the defaults"
        )
    learner = Learner.from_config(model, tok, config)
    module, opt, pad = learner.module, learner.ds_model.optimizer, learner.pad_id
    if not isinstance(opt, torch.optim.AdamW):
        raise SystemExit(
            f"the learner's optimizer is {type(opt).__name__}: expected torch AdamW (ZeRO stage 0, fp32)"
        )
    params = [p for p in module.parameters() if p.requires_grad]
    log(
        f"start {config.model.name_or_path}: {sum(p.numel() for p in params)} parameters, {params[0].dtype}, "
        f"precision {learner.precision}, optimizer {type(opt).__name__} betas {config.optim.betas} eps "
        f"{config.optim.eps} weight decay {config.optim.weight_decay} clip {config.optim.grad_clip}; "
        f"{len(data)} kept batches"
    )

    # the bank: H_start as the study measures it, and h = grad H_bank (fp32) for the first-order predictions
    H_start = bank_entropy(module, bank, pad)
    b_ids, b_attn, b_score = episode_rows(bank, pad)
    module.zero_grad(set_to_none=True)
    H_grad = bank_entropy_by_rows(module, b_ids, b_attn, b_score, grad=True)
    h = [p.grad.detach().clone() for p in params]
    module.zero_grad(set_to_none=True)
    h_norm = math.sqrt(sum(float(x.double().pow(2).sum()) for x in h))

    def H_bank() -> float:
        """The bank's entropy as dH is measured: fp32 logits, each token's entropy summed in fp64 (the
        study's metric sums in fp32, whose rounding is a visible step on the tiny model)."""
        with torch.no_grad():
            return bank_entropy_by_rows(module, b_ids, b_attn, b_score)

    H_measure = H_bank()
    log(
        f"bank: {len(bank)} episodes, {int(b_score.sum())} tokens, H_bank {H_start:.6f} (study's metric), "
        f"{H_grad:.6f} (the gradient's pass), {H_measure:.6f} (without gradient: dH's reference), |h| {h_norm:.4g}"
    )

    # the measurement's floor: H_bank after a random displacement 1 % of the norm of an Adam step of the
    # smallest lr (lr sqrt(#params)), minus its first-order change: float rounding, not the step
    start = [p.detach().clone() for p in params]
    n_params = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(0)
    floor = []
    for _ in range(2):
        noise = [torch.randn(p.shape, generator=gen) for p in params]
        scale = (
            0.01 * min(args.lrs) * math.sqrt(n_params) / math.sqrt(sum(float(x.pow(2).sum()) for x in noise))
        )
        with torch.no_grad():
            for p, x in zip(params, noise, strict=True):
                p.add_(x.to(p.dtype), alpha=scale)
        floor.append(abs(H_bank() - H_measure - displacement_response(h, params, start)))
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
    log(
        f"measurement floor (|measured - first order| of a random displacement 1 % of a step): {max(floor):.2g}"
    )

    def advantages(batch: dict[str, Any]) -> torch.Tensor:
        return grpo_advantages(batch["rewards"], group_index=batch["group_index"])[0]

    # warm Adam at the run's lr (1e-30 for a draws run: the weights do not move)
    warm_metrics = []
    for batch in data[: args.warm]:
        out = learner.update(batch["episodes"], advantages(batch))
        warm_metrics.append(
            {"step": batch["step"], "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"]}
        )
        log(
            f"warm step on the run's step {batch['step']}: loss {out['loss']:.6g}, grad norm {out['grad_norm']:.6g}"
        )
    # the measured steps start from `start` itself (restored before each); the warm steps' gradients were
    # taken at start + at most `warm_moved` per weight (an Adam step of 1e-30 moves only weights near 0)
    warm_moved = max(float((p.detach() - s).abs().max()) for p, s in zip(params, start, strict=True))
    moved = sum(not torch.equal(p, s) for p, s in zip(params, start, strict=True))
    log(
        f"after warming: {moved} parameter tensors not bit-identical to the start, max |change| {warm_moved:.3g}"
    )
    if warm_moved > 1e-20:
        raise SystemExit(
            f"warming Adam moved a weight by {warm_moved:.3g} (lr {config.optim.lr:g}): the start must not move; "
            "use a run at optim.lr=1e-30 (the draws run)"
        )
    # -<h, g> of the gradient the optimizer steps on (after clipping): an SGD step's first-order dH per unit lr
    captured: dict[str, float] = {}
    adam_step = opt.step

    def capturing_step(*a: Any, **k: Any) -> Any:
        captured["sgd_per_lr"] = -sum(
            float((hp.double() * p.grad.double()).sum())
            for hp, p in zip(h, params, strict=True)
            if p.grad is not None
        )
        return adam_step(*a, **k)

    opt.step = capturing_step  # type: ignore[method-assign]
    warm_opt = copy.deepcopy(opt.state_dict())
    warm_sched = copy.deepcopy(learner.scheduler.state_dict())

    def restore() -> None:
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
        opt.load_state_dict(copy.deepcopy(warm_opt))  # load_state_dict may alias the given tensors
        learner.scheduler.load_state_dict(copy.deepcopy(warm_sched))

    meta: dict[str, Any] = {
        "run": str(args.from_run) if args.from_run else "quick (tiny random model)",
        "start": str(config.model.name_or_path),
        "H_start": H_start,
        "H_start_grad_pass": H_grad,
        "H_start_measure": H_measure,
        "measurement_floor": max(floor),
        "h_norm": h_norm,
        "bank_episodes": len(bank),
        "bank_tokens": int(b_score.sum()),
        "warm": args.warm,
        "warm_steps": warm_metrics,
        "warm_moved_max": warm_moved,
        "warm_moved_tensors": moved,
        "M": args.M,
        "W": args.W,
        "P": alg.P,
        "scope": alg.scope,
        "optim": {
            "betas": list(config.optim.betas),
            "eps": config.optim.eps,
            "weight_decay": config.optim.weight_decay,
            "grad_clip": config.optim.grad_clip,
        },
        "precision": learner.precision,
        "machine": machine_line(),
        "command": " ".join(["python", *sys.argv]),
        "arms": list(args.arms),
        "placebo_seed": args.placebo_seed,
    }
    records: list[dict[str, Any]] = []
    merge = getattr(args, "merge_data", None)
    if merge is not None:
        recorded = {(int(r["batch"]), float(r["lr"]), r["arm"]): r for r in merge["records"]}
        if abs(H_measure - float(merge["meta"]["H_start_measure"])) > 1e-12:
            raise SystemExit(
                f"--merge: H_bank at the start {H_measure!r} is not the earlier run's "
                f"{merge['meta']['H_start_measure']!r}: not the same start or bank; not merged"
            )
        meta["merge"] = {
            "from": str(args.merge),
            "earlier_command": merge["meta"].get("command"),
            "check": [],
        }

    def save() -> None:
        out_records = (
            records if merge is None else [*merge["records"], *(r for r in records if not r.get("check"))]
        )
        out_meta = meta if merge is None else {**merge["meta"], "placebo_run": meta}
        (args.out / "records.json").write_text(
            json.dumps({"meta": out_meta, "records": out_records}, indent=1)
        )
        write_csv(out_records, args.out / "records.csv")

    for i, batch in enumerate(data[args.warm : args.warm + args.batches]):
        tb = time.time()
        restore()
        trajectories, A = batch["episodes"], advantages(batch)
        logp, _ = learner.compute_logprobs_and_entropy(trajectories)
        mask = collate(trajectories, pad)["response_mask"].to(logp.device)
        A_tok = broadcast_to_tokens(A.to(logp.device), mask)
        split = learner.micro_batches(trajectories) if alg.scope == "micro_batch" else None

        levers = {}
        for variant, W, M in (("C2", 1.0, args.M), ("O1", args.W, 1.0)):
            levers[variant] = stare_weights(
                A_tok, logp, mask, gate_on=True, variant=variant, P=alg.P, W=W, M=M,  # type: ignore[arg-type]
                scope=alg.scope, micro_batches=split, sequence_ids=batch["sequence_ids"],  # type: ignore[arg-type]
            )  # fmt: skip
        w_c2, _, L_minus, _ = levers["C2"]
        w_plus, L_plus, _, _ = levers["O1"]
        # the placebo: the same M on a seeded uniformly random subset of T-, |L-| tokens in each block of
        # L-'s own scope; 1 elsewhere (C2's L+ weight is 1 here)
        T_minus = mask.bool() & (A_tok < 0)
        seed = placebo_seed(args.placebo_seed, int(batch["step"]))
        blocks = selection_blocks(mask.shape[0], alg.scope, split, None, mask.device)
        placebo = random_subset(L_minus, T_minus, blocks, seed)
        w_placebo = torch.ones_like(w_c2)
        w_placebo[placebo] = args.M
        all_arms = {"grpo_ds": None, "c2_lever": w_c2, "lplus_lever": w_plus, "c2_placebo": w_placebo}
        run_arms = [a for a in ARMS if a in args.arms or (a == "grpo_ds" and merge is not None and i == 0)]
        arms = {a: all_arms[a] for a in run_arms}
        common = {
            "batch": i,
            "step": batch["step"],
            "tokens": int(mask.sum()),
            "n_L_minus": int(L_minus.sum()),
            "n_L_plus": int(L_plus.sum()),
            "H_start": H_measure,
            "warm": args.warm,
            "M": args.M,
            "W": args.W,
            "placebo_seed": seed,
        }
        if merge is not None:
            old = recorded.get((i, float(args.lrs[0]), "grpo_ds"))
            same = old is not None and all(
                int(old[k]) == common[k] for k in ("step", "tokens", "n_L_minus", "n_L_plus")
            )
            if not same:
                raise SystemExit(
                    f"--merge: batch {i} is not the earlier run's (step, tokens, |L-|, |L+|): "
                    f"{[common[k] for k in ('step', 'tokens', 'n_L_minus', 'n_L_plus')]} against "
                    f"{None if old is None else [old[k] for k in ('step', 'tokens', 'n_L_minus', 'n_L_plus')]}; not merged"
                )
        for lr in args.lrs:
            after_grpo: list[torch.Tensor] | None = None
            for arm, weights in arms.items():
                restore()
                for group in opt.param_groups:
                    group["lr"] = lr
                captured.clear()
                out = learner.update(trajectories, A, weights)
                H_after = H_bank()
                with torch.no_grad():
                    disp = math.sqrt(
                        sum(
                            float((p.double() - s.double()).pow(2).sum())
                            for p, s in zip(params, start, strict=True)
                        )
                    )
                    if arm == "grpo_ds":
                        after_grpo = [p.detach().clone() for p in params]
                        lever_disp = 0.0
                    elif after_grpo is None:  # no grpo_ds step on this batch (a --merge run)
                        lever_disp = math.nan
                    else:
                        lever_disp = math.sqrt(
                            sum(
                                float((p.double() - g.double()).pow(2).sum())
                                for p, g in zip(params, after_grpo, strict=True)
                            )
                        )
                rec = {
                    **common,
                    "lr": lr,
                    "arm": arm,
                    "H_after": H_after,
                    "dH": H_after - H_measure,
                    "predicted": displacement_response(h, params, start),
                    "grad_norm": out["grad_norm"],
                    "loss": out["loss"],
                    "disp_norm": disp,
                    "lever_disp_norm": lever_disp,
                    "sgd_per_lr": captured.get("sgd_per_lr", math.nan),
                }
                if merge is not None and arm == "grpo_ds":
                    # the check: the same start, warm state and step reproduce the recorded dH
                    old = recorded[(i, float(lr), "grpo_ds")]
                    diff = abs(rec["dH"] - float(old["dH"]))
                    check = {
                        "batch": i,
                        "lr": lr,
                        "dH": rec["dH"],
                        "recorded_dH": float(old["dH"]),
                        "abs_diff": diff,
                        "bit_identical": rec["dH"] == float(old["dH"]),
                        "grad_norm_identical": rec["grad_norm"] == float(old["grad_norm"]),
                    }
                    meta["merge"]["check"].append(check)
                    rec["check"] = True
                    log(
                        f"CHECK grpo_ds batch {i} lr {lr:g}: dH {rec['dH']!r} recorded {float(old['dH'])!r}, "
                        f"|diff| {diff:.3g} ({'bit-identical' if check['bit_identical'] else 'not bit-identical'}), "
                        f"grad norm {'identical' if check['grad_norm_identical'] else 'DIFFERS'}"
                    )
                    if not diff <= 1e-9:
                        save()
                        raise SystemExit(
                            f"--merge: grpo_ds does not reproduce its recorded dH on batch {i} at lr {lr:g} "
                            f"(|diff| {diff:.3g} > 1e-9): the single-arm run is not the same measurement; not merged"
                        )
                records.append(rec)
            by_arm = {r["arm"]: r for r in records if r["batch"] == i and r["lr"] == lr}
            log(
                f"batch {i} (step {batch['step']}, {common['tokens']} tokens, |L-| {common['n_L_minus']}, "
                f"|L+| {common['n_L_plus']}) lr {lr:g}: "
                + ", ".join(
                    f"{a} dH {r['dH']:+.3e} (1st order {r['predicted']:+.3e})" for a, r in by_arm.items()
                )
                + f"; |dtheta| {next(iter(by_arm.values()))['disp_norm']:.3g}"
            )
        save()
        log(f"batch {i} took {time.time() - tb:.0f} s")

    restore()
    H_check = H_bank()
    meta["H_start_after_restore"] = H_check
    meta["wall_s"] = time.time() - t0
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    save()
    saved = json.loads((args.out / "records.json").read_text())
    summary = summarize(saved["records"])
    (args.out / "summary.json").write_text(json.dumps({"meta": saved["meta"], "summary": summary}, indent=1))
    log(
        f"restored start: H_bank {H_check:.6f} ({'bit-identical' if H_check == H_measure else 'DIFFERS'} to the first)"
    )
    print()
    print(table(summary, meta))
    return summary


if __name__ == "__main__":
    main()
