"""The field's entropy controls and STARE with several optimizer steps a batch, from one start (issue 44 item 5).

The one-step table of docs/research/study.md ("STARE beside the field's entropy controls") took ONE
optimizer step per batch. There the importance ratio is 1, so KL-Cov's penalty has no gradient and no
clip binds: KL-Cov and clip-higher are GRPO-ds exactly, a property of the step count, not of the
methods. This benchmark takes each method's real update of several optimizer steps per batch
(``algorithm.ppo_epochs``, the trainer's own code) and measures what it does to the held-out entropy.

Design (written before the first real run):

1. The start, its bank and its batches come from a run whose weights never move (``--from-run``, the
   lr = 1e-30 "draws" run of ``benchmarks/adam_lever.py``): its ``model.name_or_path``, its
   ``research.entropy_bank`` (or ``--bank``) and every saved step's drawn and kept groups, in order.
2. Each arm is a ``stare_research.trainer.ResearchTrainer`` built from the run's config with the arm's
   overrides (``stare_research.study.VARIANTS[name]``, plus any ``:key=value,...`` of the arm's spec),
   ``algorithm.ppo_epochs = --epochs``, ``optim.lr = --lr``, and, for STARE arms,
   ``algorithm.gate=always_on`` (the start's entropy is above H_tgt, where the gate would turn STARE
   into GRPO-ds: the arm measures the lever). Its rollout engine is ``FrozenRollouts``: nothing is
   sampled. The update is ``Trainer.learn(drawn, kept)``, the trainer's own steps 4-8: advantages,
   pre-update log-probs (the ratio's old policy for every one of the ``--epochs`` optimizer steps),
   the method's selection per mini-batch, the updates.
3. Warm Adam, the same for every arm: a GRPO-ds trainer at the run's own lr (1e-30: no weight moves,
   checked) learns the first ``--warm`` batches with the same ``--epochs``, so m and v hold
   ``warm * epochs`` GRPO-ds gradients of the start; its optimizer state is loaded into every arm's
   optimizer (and the lr set to ``--lr``) before every measured batch, and the start's weights are
   restored.
4. On each of the next ``--batches`` batches, per arm: one ``learn`` from the start and the warm state,
   then the held-out bank's entropy (fp32 logits, each token's entropy summed in fp64,
   ``benchmarks/entropy_response.bank_entropy_by_rows``): ``dH = H_after - H_start``. An arm's paired
   effect is ``dH_arm - dH_grpo_ds`` on the same batch; an arm whose dH equals GRPO-ds's bit for bit
   on a batch is counted (``identical``): that is what one step a batch gave KL-Cov and clip-higher.
5. Statistics: mean ± 95 % t half-width over the batches (sample SD, t with n - 1 degrees of freedom,
   ``stare_agent.intervals.mean_sd_ci``), the batches above 0. The intervals are over the batches of ONE
   start and ONE bank: they do not cover other starts, banks or seeds.

Pre-stated reading (before any real number was seen): an arm moves the held-out entropy differently
from GRPO-ds with several steps a batch if its paired effect's 95 % t interval excludes 0 (above:
raises it against GRPO-ds; below: lowers it). For KL-Cov and clip-higher the question is first whether
they still equal GRPO-ds (``identical`` on every batch); an interval that holds 0 is "not shown", not
"no effect".

    .venv/bin/python benchmarks/multi_step_response.py --from-run runs/closed_loop_sft48/runs/draws \\
        --warm 4 --batches 8 --epochs 4 --lr 1e-5 --out runs/multi_step_sft48
    .venv/bin/python benchmarks/multi_step_response.py --from-csv runs/multi_step_sft48/records.csv

Resumable: ``records.json`` is written after every arm and batch; a rerun with the same ``--out`` and
the same settings measures only the (arm, batch) pairs it lacks.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import adam_lever  # noqa: E402
from benchmarks.adam_lever import interval, machine_line  # noqa: E402

BASELINE = "grpo-ds"
# The table of docs/research/study.md, every arm at its defaults, and KL-Cov's k and Clip-Cov's r swept
# to 10x (at ~500 tokens a batch their defaults select one token); clip-higher as GRPO-ds's eps_high.
ARMS = (
    "grpo-ds",
    "stare-o1",
    "stare-c2",
    "stare-o1:algorithm.W=3.0",
    "entropy-bonus",
    "kl-cov",
    "kl-cov:algorithm.kl_cov_k=0.02",
    "clip-cov",
    "clip-cov:algorithm.clip_cov_r=0.002",
    "forking-tokens",
    "grpo-ds:algorithm.eps_high=0.2",
    "grpo-ds:algorithm.eps_high=0.4",
)
CSV_FIELDS = (
    "arm",
    "batch",
    "step",
    "tokens",
    "H_start",
    "H_after",
    "dH",
    "loss",
    "grad_norm",
    "lr",
    "updates",
    "clip_frac",
    "selected_frac",
    "epochs",
    "warm",
)
SETTINGS = ("run", "bank", "warm", "epochs", "lr")  # a resumed run must match these


# ------------------------------------------------------------------------------------ pure part


def arm_overrides(spec: str, variants: dict[str, tuple[str, ...]]) -> list[str]:
    """The config overrides of an arm ``name[:key=value,...]``: the study variant ``name``'s, then the
    spec's own; a STARE arm gets ``algorithm.gate=always_on`` first (its own spec may set another)."""
    name, _, extra = spec.partition(":")
    if name not in variants:
        raise SystemExit(f"arm {spec!r}: unknown variant {name!r}: use one of {', '.join(variants)}")
    own = [item for item in extra.split(",") if item]
    bad = [item for item in own if "=" not in item]
    if bad:
        raise SystemExit(f"arm {spec!r}: {bad[0]!r} is not key=value (e.g. kl-cov:algorithm.kl_cov_k=0.02)")
    base = list(variants[name])
    gate = ["algorithm.gate=always_on"] if "algorithm.name=stare" in base else []
    return [*gate, *base, *own]


def reading(stats: dict[str, float], identical: int) -> str:
    """The pre-stated reading of a paired effect: ``identical`` when every batch's dH equals
    GRPO-ds's, else ``raises`` / ``lowers`` when the 95 % interval lies above / below 0, else
    ``not shown``."""
    if identical == stats["n"]:
        return "identical"
    if stats["n"] < 2 or math.isnan(stats["ci95"]):
        return "not shown"
    if stats["low"] > 0:
        return "raises"
    if stats["high"] < 0:
        return "lowers"
    return "not shown"


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: its dH over the batches every arm has, and its paired effect against GRPO-ds."""
    by = {(r["arm"], int(r["batch"])): r for r in records}
    arms = list(dict.fromkeys(r["arm"] for r in records))
    if BASELINE not in arms:
        raise ValueError(f"the records hold no {BASELINE} arm: every arm is paired with it")
    batches = sorted({b for _, b in by if all((a, b) in by for a in arms)})
    out: dict[str, Any] = {"batches": len(batches), "arms": {}}
    for arm in arms:
        dH = [float(by[(arm, b)]["dH"]) for b in batches]
        base = [float(by[(BASELINE, b)]["dH"]) for b in batches]
        paired = [x - y for x, y in zip(dH, base, strict=True)]
        same = sum(x == y for x, y in zip(dH, base, strict=True))
        out["arms"][arm] = {
            "dH": interval(dH),
            "paired": interval(paired),
            "identical": same,
            "reading": "baseline" if arm == BASELINE else reading(interval(paired), same),
            "clip_frac": _mean([by[(arm, b)].get("clip_frac") for b in batches]),
            "selected_frac": _mean([by[(arm, b)].get("selected_frac") for b in batches]),
        }
    return out


def _mean(xs: Sequence[Any]) -> float:
    vals = [float(x) for x in xs if x not in (None, "") and not math.isnan(float(x))]
    return sum(vals) / len(vals) if vals else math.nan


def _fmt(s: dict[str, float]) -> str:
    if math.isnan(s["ci95"]):
        return f"{s['mean']:+.2e}"
    return f"{s['mean']:+.2e} ± {s['ci95']:.1e}"


def tables(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The result as a markdown table: each arm's dH and its paired effect with the reading."""
    n = summary["batches"]
    lines = [
        f"{meta['epochs']} optimizer steps a batch (algorithm.ppo_epochs) at lr {meta['lr']:g} from the start "
        f"(H_bank {meta['H_start']:.4f}) and one warm Adam state ({meta['warm']} GRPO-ds batches); "
        f"STARE arms with the gate forced on; mean ± 95 % t half-width over {n} batches of one start and one bank",
        "",
        "| arm | dH_bank | batches > 0 | minus GRPO-ds (paired) | batches > 0 | batches identical to GRPO-ds | reading | clip fraction | selected fraction |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for arm, a in summary["arms"].items():
        paired = "0" if arm == BASELINE else _fmt(a["paired"])
        above = "-" if arm == BASELINE else f"{a['paired']['above_0']}/{n}"
        same = "-" if arm == BASELINE else f"{a['identical']}/{n}"
        sel = "-" if math.isnan(a["selected_frac"]) else f"{a['selected_frac']:.4f}"
        clip = "-" if math.isnan(a["clip_frac"]) else f"{a['clip_frac']:.4f}"
        lines.append(
            f"| {arm} | {_fmt(a['dH'])} | {a['dH']['above_0']}/{n} | {paired} | {above} | {same} | "
            f"{a['reading']} | {clip} | {sel} |"
        )
    return "\n".join(lines)


def write_csv(records: Sequence[dict[str, Any]], path: Path) -> None:
    adam_lever.write_csv(records, path, CSV_FIELDS)


def read_csv(path: Path) -> list[dict[str, Any]]:
    return adam_lever.read_csv(path, CSV_FIELDS, ())


def csv_meta(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = rows[0]
    return {
        "epochs": int(first["epochs"]),
        "lr": float(first["lr"]),
        "H_start": float(first["H_start"]),
        "warm": int(first["warm"]),
    }


def tables_of_csv(path: str | Path) -> str:
    """The published table of a shipped ``records.csv``, as ``--from-csv`` prints it."""
    rows = read_csv(Path(path))
    return tables(summarize(rows), csv_meta(rows))


def update_fractions(metrics: dict[str, Any]) -> tuple[float, float]:
    """(clip fraction, selected fraction) of a ``learn``'s metrics: the ratio's clip fraction over the
    update's steps (``actor/pg_clipfrac``), and the share of tokens the method selected (KL-Cov, Clip-Cov, forking tokens:
    ``<method>/frac_selected``; STARE: ``frac_reweighted``); NaN where the metric is absent."""
    clip = metrics.get("actor/pg_clipfrac", math.nan)
    selected = next(
        (float(v) for k, v in metrics.items() if k.endswith("/frac_selected")),
        float(metrics["frac_reweighted"]) if "frac_reweighted" in metrics else math.nan,
    )
    return float(clip), selected


# ------------------------------------------------------------------------------------ the run


def measure(args: argparse.Namespace, policy: Callable[[], tuple[Any, Any]] | None = None) -> dict[str, Any]:
    """Warm Adam once, then every arm on every batch; ``policy`` loads the start's model and tokenizer
    (a test's tiny model), else each trainer loads ``model.name_or_path``."""
    from benchmarks.entropy_response import bank_entropy_by_rows, episode_rows
    from stare_agent.config import CONFIG_FILENAME
    from stare_research.config import load_research_config
    from stare_research.entropy_bank import read_bank
    from stare_research.replay import FrozenRollouts, load_step, step_files
    from stare_research.study import VARIANTS
    from stare_research.trainer import ResearchTrainer

    t0 = time.time()

    def log(*a: Any) -> None:
        print(f"[{time.time() - t0:7.1f}s]", *a, flush=True)

    run = args.from_run
    config_file = run / CONFIG_FILENAME
    if not config_file.is_file():
        raise SystemExit(f"--from-run {run}: no {CONFIG_FILENAME}: pass a run directory (trainer.run_dir)")
    specs = {spec: arm_overrides(spec, VARIANTS) for spec in args.arms}
    base_config = load_research_config(config_file)
    bank_path = args.bank or base_config.research.entropy_bank
    if not bank_path:
        raise SystemExit(f"--from-run {run}: the run has no research.entropy_bank: pass --bank BANK.jsonl")
    bank = read_bank(bank_path)
    data = [(step, *load_step(path)) for step, path in step_files(run)]
    data = [(step, drawn, kept) for step, drawn, kept in data if kept]
    if len(data) < args.warm + args.batches:
        raise SystemExit(
            f"--from-run {run}: {len(data)} batches with a kept group, --warm {args.warm} + --batches "
            f"{args.batches} needs {args.warm + args.batches}: lower them or make the draws run longer"
        )
    common = [
        f"algorithm.ppo_epochs={args.epochs}",
        "research.mechanism_metrics=false",
    ]

    def trainer_of(overrides: list[str], out: Path) -> Any:
        config = load_research_config(config_file, [*overrides, *common, f"trainer.run_dir={out}"])
        model, tok = policy() if policy is not None else (None, None)
        return ResearchTrainer(config, model=model, tokenizer=tok, engine=FrozenRollouts(run))

    settings = {
        "run": str(run),
        "bank": str(bank_path),
        "warm": args.warm,
        "epochs": args.epochs,
        "lr": args.lr,
    }
    records: list[dict[str, Any]] = []
    saved = args.out / "records.json"
    meta: dict[str, Any] = {**settings, "arms": list(args.arms)}
    if saved.is_file():
        earlier = json.loads(saved.read_text())
        differ = {
            k: (settings[k], earlier["meta"].get(k))
            for k in SETTINGS
            if settings[k] != earlier["meta"].get(k)
        }
        if differ:
            raise SystemExit(
                f"--out {args.out} holds a run with other settings ("
                + ", ".join(f"{k} {a} here, {b} there" for k, (a, b) in differ.items())
                + "): pass a new --out"
            )
        records = earlier["records"]
        meta = {**earlier["meta"], "arms": list(dict.fromkeys([*earlier["meta"]["arms"], *args.arms]))}
        log(f"resuming: {len(records)} records in {saved}")
    done = {(r["arm"], int(r["batch"])) for r in records}

    def save() -> None:
        saved.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        write_csv(records, args.out / "records.csv")

    # 3. warm Adam: GRPO-ds at the run's own lr on the first --warm batches, --epochs steps each
    warm_trainer = trainer_of(["algorithm.name=grpo_ds"], args.out / "trainers" / "warm")
    lr_run = warm_trainer.config.optim.lr
    if lr_run > 1e-20:
        warm_trainer.close()
        raise SystemExit(
            f"--from-run {run}: its optim.lr is {lr_run:g}: use a run at optim.lr=1e-30 (the draws run)"
        )
    module = warm_trainer.learner.module
    params = [p for p in module.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    pad = warm_trainer.learner.pad_id
    b_ids, b_attn, b_score = episode_rows(bank, pad)

    def H_bank(m: Any) -> float:
        with torch.no_grad():
            return bank_entropy_by_rows(m, b_ids, b_attn, b_score)

    H_start = H_bank(module)
    warm_metrics = []
    for step, drawn, kept in data[: args.warm]:
        warm_trainer.step = step
        out = warm_trainer.learn(drawn, kept)
        warm_metrics.append({"step": step, "loss": out.get("loss"), "grad_norm": out.get("grad_norm")})
        log(f"warm on step {step}: loss {out.get('loss')}, grad norm {out.get('grad_norm')}")
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(params, start, strict=True))
    if moved > 1e-20:
        warm_trainer.close()
        raise SystemExit(f"warming Adam moved a weight by {moved:.3g}: the start must not move")
    warm_state = copy.deepcopy(warm_trainer.learner.ds_model.optimizer.state_dict())
    warm_trainer.close()
    del warm_trainer, module, params
    gc.collect()
    meta.update(
        {
            "H_start": H_start,
            "start": str(base_config.model.name_or_path),
            "warm_steps": warm_metrics,
            "bank_episodes": len(bank),
            "bank_tokens": int(b_score.sum()),
            "machine": machine_line(),
            "command": " ".join(["python", *sys.argv]),
        }
    )
    log(
        f"start H_bank {H_start:.6f} ({len(bank)} episodes, {int(b_score.sum())} tokens); warm state of {args.warm} batches"
    )

    measured = data[args.warm : args.warm + args.batches]
    for spec, overrides in specs.items():
        todo = [(i, item) for i, item in enumerate(measured) if (spec, i) not in done]
        if not todo:
            continue
        ta = time.time()
        safe = spec.replace(":", "_").replace("=", "-").replace(",", "_")
        trainer = trainer_of([*overrides, f"optim.lr={args.lr}"], args.out / "trainers" / safe)
        module = trainer.learner.module
        params = [p for p in module.parameters() if p.requires_grad]
        opt = trainer.learner.ds_model.optimizer
        if not all(torch.equal(p, s) for p, s in zip(params, start, strict=True)):
            raise SystemExit(f"arm {spec}: its trainer did not load the start's weights")
        H0 = H_bank(module)
        if H0 != H_start:
            raise SystemExit(f"arm {spec}: H_bank at the start {H0!r} is not the warm trainer's {H_start!r}")
        for i, (step, drawn, kept) in todo:
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            opt.load_state_dict(copy.deepcopy(warm_state))  # load_state_dict may alias the tensors
            for group in opt.param_groups:
                group["lr"] = args.lr
            trainer.step = step
            out = trainer.learn(drawn, kept)
            if out.get("skipped"):
                raise SystemExit(
                    f"arm {spec}: the update of step {step} was skipped: {out.get('skip_reason')}"
                )
            H_after = H_bank(module)
            clip, selected = update_fractions(out)
            records.append(
                {
                    "arm": spec,
                    "batch": i,
                    "step": step,
                    "tokens": int(out.get("tokens", 0)),
                    "H_start": H_start,
                    "H_after": H_after,
                    "dH": H_after - H_start,
                    "loss": out.get("loss"),
                    "grad_norm": out.get("grad_norm"),
                    "lr": args.lr,
                    "updates": int(out.get("ppo/optimizer_steps", 1)),
                    "clip_frac": clip,
                    "selected_frac": selected,
                    "epochs": args.epochs,
                    "warm": args.warm,
                }
            )
            save()
            log(
                f"{spec} batch {i} (step {step}): dH {H_after - H_start:+.3e}, clip {clip:.4f}, selected {selected:.4f}"
            )
        trainer.close()
        del trainer, module, params, opt
        gc.collect()
        log(f"{spec}: {time.time() - ta:.0f} s")
    meta["wall_s"] = time.time() - t0
    meta["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    save()
    summary = summarize(records)
    (args.out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1))
    print(tables(summary, meta))
    print(
        f"\nmachine: {meta['machine']}\ncommand: {meta['command']}\nwall: {meta['wall_s']:.0f} s; {meta['date']}"
    )
    return summary


def main(
    argv: Sequence[str] | None = None, policy: Callable[[], tuple[Any, Any]] | None = None
) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--from-run",
        type=Path,
        default=None,
        help="the lr = 1e-30 run whose start, bank and batches are used",
    )
    ap.add_argument(
        "--bank", type=Path, default=None, help="the held-out bank (default: the run's research.entropy_bank)"
    )
    ap.add_argument("--warm", type=int, default=4, help="batches that warm Adam (GRPO-ds at the run's lr)")
    ap.add_argument("--batches", type=int, default=8, help="batches measured after the warm ones")
    ap.add_argument("--epochs", type=int, default=4, help="optimizer steps a batch (algorithm.ppo_epochs)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="study variants, each name[:key=value,...]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-csv", type=Path, default=None, help="reprint the table of a records.csv and exit")
    args = ap.parse_args(argv)
    if args.from_csv is not None:
        print(tables_of_csv(args.from_csv))
        return summarize(read_csv(args.from_csv))
    if args.out is None or args.from_run is None:
        ap.error("--from-run RUN and --out DIR are required (or --from-csv CSV to reprint a table)")
    if args.warm < 1 or args.batches < 1 or args.epochs < 1:
        ap.error(f"--warm {args.warm}, --batches {args.batches}, --epochs {args.epochs}: each must be >= 1")
    if BASELINE not in args.arms:
        ap.error(f"--arms must include {BASELINE}: every arm is paired with it")
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    return measure(args, policy)


if __name__ == "__main__":
    main()
