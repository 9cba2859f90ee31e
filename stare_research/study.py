"""`stare-agent study`: does STARE hold entropy? GRPO-ds against STARE through the real Trainer.

1. cold start   one SFT model shared by every run (``STUDY/sft_model``, reused when present)
2. calibration  the SFT policy's mean reward on the first RL draws, sampled as RL samples
                (``env.temperature``): GRPO needs groups with reward variance, so a start in
                [0.3, 0.7] is the useful band; the result is printed and kept in calibration.json
3. runs         every variant x seed with the same config but the algorithm (``VARIANTS``), each in
                ``STUDY/runs/<variant>-s<seed>``; a finished run is skipped, an interrupted one
                resumes from its last checkpoint, so an interrupted study picks up where it was
4. report       ``study.csv`` (every logged step of every run), ``study.png`` (entropy with H_tgt,
                reward, held-out accuracy, response length: mean and min-max band over seeds) and
                ``study.md`` (late and area-under-curve entropy, best and final held-out accuracy,
                mean +- the 95 % t interval over seeds and the sample SD, seconds per step)

The settings live in one training config (``configs/study.yaml``); the study adds only
``trainer.seed``, ``trainer.run_dir``, ``model.name_or_path`` (the SFT model) and the variant's
``algorithm.*`` overrides, so variants differ in the algorithm alone.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeGuard

from stare_agent.config import ConfigError, RunConfig
from stare_agent.intervals import format_ci, mean_sd_ci
from stare_agent.metrics import gate_fraction
from stare_research.config import load_research_config

# name -> algorithm overrides. The last three are the paper's open-loop ablations: the gate forced
# on (no off state) at W = 1.01, at the default W = 1.1, and at W = 2 (reported to diverge).
VARIANTS: dict[str, tuple[str, ...]] = {
    "grpo-ds": ("algorithm.name=grpo_ds",),
    "stare-o1": ("algorithm.name=stare", "algorithm.variant=O1"),
    "stare-c2": ("algorithm.name=stare", "algorithm.variant=C2"),
    "open-loop-w1.01": ("algorithm.name=stare", "algorithm.gate=always_on", "algorithm.W=1.01"),
    "no-off-state": ("algorithm.name=stare", "algorithm.gate=always_on"),
    "open-loop-w2": ("algorithm.name=stare", "algorithm.gate=always_on", "algorithm.W=2.0"),
}
PAPER_VARIANTS = tuple(VARIANTS)
"""The study's default: the paper's methods and ablations."""
# The field's other entropy controls (docs/algorithm.md), at their papers' defaults: ablation arms
# named with --variants, not run by default.
VARIANTS |= {
    "entropy-bonus": ("algorithm.name=entropy_bonus",),
    "kl-cov": ("algorithm.name=kl_cov",),
    "clip-cov": ("algorithm.name=clip_cov",),
    "forking-tokens": ("algorithm.name=forking_tokens",),
}
# The field's token-weighting methods (docs/algorithm.md), at their sources' defaults (the first-order
# weighting's are ours): ablation arms named with --variants, not run by default. STAPO is the sharp
# contrast to STARE: it silences the rare positive-advantage tokens STARE's L+ amplifies.
VARIANTS |= {
    "steer": ("algorithm.name=steer",),
    "stapo": ("algorithm.name=stapo",),
    "entroadv": ("algorithm.name=entroadv",),
    "adaptive-entropy": ("algorithm.name=adaptive_entropy",),
    "first-order": ("algorithm.name=first_order",),
}
# The closed loop's best chance by the dynamics lab (docs/research/lab.md): O1 at W = 3 with the gate read on the
# whole draw (ours, not the paper's: the paper reads the kept groups).
VARIANTS |= {
    "stare-o1-w3-drawn": (
        "algorithm.name=stare",
        "algorithm.variant=O1",
        "algorithm.W=3.0",
        "research.gate_batch=drawn",
    ),
}
# L+ restricted to the tokens whose reinforcement raises their position's entropy at first order (ours):
# at the paper's W and gate, and with the closed loop's best-chance W and gate above.
VARIANTS |= {
    "stare-o1-raising": (
        "algorithm.name=stare",
        "algorithm.variant=O1",
        "research.L_plus_rule=top_k_raising",
    ),
    "stare-o1-w3-drawn-raising": (*VARIANTS["stare-o1-w3-drawn"], "research.L_plus_rule=top_k_raising"),
}
# C2's placebo (ours, issue 44): M on a seeded random subset of T- of L-'s size instead of L-, so that
# C2 minus it is the surprisal selection's effect, not that of attenuating some negative tokens at all.
VARIANTS |= {
    "stare-c2-placebo": ("algorithm.name=stare", "algorithm.variant=C2", "research.L_minus_rule=random"),
}
# L+'s placebo (ours, issue 44): W on a seeded random subset of T+ of L+'s size instead of L+, at the paper's
# W and gate and at the closed loop's best-chance W and gate, so that STARE minus it is the surprisal
# selection's effect.
VARIANTS |= {
    "stare-o1-placebo": ("algorithm.name=stare", "algorithm.variant=O1", "research.L_plus_rule=random"),
    "stare-o1-w3-drawn-placebo": (*VARIANTS["stare-o1-w3-drawn"], "research.L_plus_rule=random"),
}
MAIN_VARIANTS = ("grpo-ds", "stare-o1", "stare-c2")
SMOKE_VARIANTS = ("grpo-ds", "stare-o1")
# A few steps of tiny batches: checks that the pipeline produces its figure and table.
SMOKE_OVERRIDES = (
    "trainer.steps=2",
    "trainer.eval_every=2",
    "trainer.checkpoint_every=1",
    "data.prompts_per_step=2",
    "data.samples_per_prompt=2",
    "data.max_sampling_batches=1",
    "data.prompts_per_draw=2",
    "data.eval_limit=4",
    "data.eval_samples=2",
    "sft.procedural_rows=8",
    "sft.epochs=1",
    "sft.batch_size=4",
)
BAND = (0.3, 0.7)
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "study.yaml"
CSV_NAME, FIGURE_NAME, TABLE_NAME, START_NAME = "study.csv", "study.png", "study.md", "start_eval.json"
BANK_NAME = "entropy_bank.jsonl"  # the held-out entropy bank every run of the study reads


def plan(variants: Sequence[str], seeds: int, ablation_seeds: int) -> list[tuple[str, int]]:
    """(variant, seed) pairs: ``seeds`` seeds for the main variants, ``ablation_seeds`` for the rest.

    Seed by seed, main variants before ablations, so that a study stopped early already compares
    every main variant on the same seeds.

    >>> plan(["no-off-state", "grpo-ds", "stare-o1"], seeds=2, ablation_seeds=1)
    [('grpo-ds', 0), ('stare-o1', 0), ('grpo-ds', 1), ('stare-o1', 1), ('no-off-state', 0)]
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown study variant {unknown[0]!r}: use one of {', '.join(VARIANTS)}")
    if seeds < 1 or ablation_seeds < 1:
        raise ConfigError(f"--seeds {seeds} and --ablation-seeds {ablation_seeds} must be >= 1")
    main = [v for v in variants if v in MAIN_VARIANTS]
    ablations = [v for v in variants if v not in MAIN_VARIANTS]
    return [(v, s) for s in range(seeds) for v in main] + [
        (v, s) for s in range(ablation_seeds) for v in ablations
    ]


def study(
    config_path: str | Path = CONFIG,
    overrides: Sequence[str] = (),
    *,
    variants: Sequence[str] | None = None,
    seeds: int = 3,
    ablation_seeds: int = 1,
    smoke: bool = False,
    report_only: bool = False,
    h_tgt_of_start: float | None = None,
) -> dict[str, Any]:
    """Run (or resume) the study of ``config_path`` and write its report; return the report's numbers.

    ``smoke`` runs ``SMOKE_VARIANTS`` with one seed and ``SMOKE_OVERRIDES`` (before ``overrides``).
    ``report_only`` trains nothing: the report of the runs logged so far (finished or not; the table
    says how many steps each variant has), e.g. while the study runs. The study directory is the
    config's ``trainer.run_dir``. ``h_tgt_of_start``: every run's ``algorithm.H_tgt`` is this multiple
    of the start's entropy as the calibration measured it (``calibration.json``, kept, so a resumed
    study sets the same value), e.g. 0.7 puts H_tgt inside the start's entropy range so that the gate
    can toggle (the closed loop); it replaces an ``algorithm.H_tgt`` in the config or ``overrides``.
    """
    if smoke:
        variants, seeds, ablation_seeds = variants or SMOKE_VARIANTS, 1, 1
        overrides = [*SMOKE_OVERRIDES, *overrides]
    pairs = plan(variants or list(PAPER_VARIANTS), seeds, ablation_seeds)
    base = load_research_config(config_path, list(overrides))
    root = Path(base.trainer.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if report_only:
        calibration_path = root / "calibration.json"
        if not calibration_path.is_file():
            raise ConfigError(f"no study in {root} (no calibration.json): run `stare-agent study` first")
        if h_tgt_of_start is not None:
            overrides = relative_h_tgt(overrides, h_tgt_of_start, json.loads(calibration_path.read_text()))
            base = load_research_config(config_path, list(overrides))
        logged = [(v, s) for v, s in pairs if (root / "runs" / f"{v}-s{s}" / "metrics.jsonl").is_file()]
        report = write_report(
            root, logged, json.loads(calibration_path.read_text()), h_tgt=base.algorithm.H_tgt
        )
        print(f"{(root / TABLE_NAME).read_text()}\nfigure: {root / FIGURE_NAME}\ndata: {root / CSV_NAME}")
        return report

    # One engine for every run: `auto` is resolved once, so a run whose vLLM worker fails to start is
    # an error instead of a run on another engine (whose numbers differ) beside the others.
    from stare_agent.engines.vllm_engine import pick_engine

    engine = pick_engine(base.env.engine, base.env.vllm.python)
    if engine != base.env.engine:
        print(f"[study] env.engine={base.env.engine} resolved to {engine} for every run", flush=True)
        overrides = [*overrides, f"env.engine={engine}"]
        base = load_research_config(config_path, list(overrides))

    sft_dir = cold_start(base, root)
    calibration = calibrate(base, sft_dir, root)
    lo, hi = BAND
    verdict = "in" if lo <= calibration["mean_reward"] <= hi else "OUTSIDE"
    print(
        f"[calibration] SFT policy on the first RL draws at temperature {base.env.temperature:g}: mean reward "
        f"{calibration['mean_reward']:.3f} ({verdict} the {lo}-{hi} band), groups with reward variance "
        f"{calibration['groups_with_variance']:.2f}, entropy on its sampled tokens (the gate's H-bar) "
        f"{calibration.get('entropy', math.nan):.3f} (H_tgt = {base.algorithm.H_tgt:g})",
        flush=True,
    )
    if h_tgt_of_start is not None:
        overrides = relative_h_tgt(overrides, h_tgt_of_start, calibration)
        base = load_research_config(config_path, list(overrides))
        print(
            f"[calibration] algorithm.H_tgt = {h_tgt_of_start:g} x the start's entropy "
            f"{calibration['entropy']:.4f} = {base.algorithm.H_tgt:g} for every run",
            flush=True,
        )
    start_eval(config_path, overrides, sorted({s for _, s in pairs}), sft_dir, root)
    for variant, seed in pairs:
        train_one(config_path, overrides, variant, seed, sft_dir, root)
    report = write_report(root, pairs, calibration, h_tgt=base.algorithm.H_tgt)
    report["total_s"] = time.perf_counter() - start
    print(f"\n{(root / TABLE_NAME).read_text()}\nfigure: {root / FIGURE_NAME}\ndata: {root / CSV_NAME}")
    return report


def relative_h_tgt(overrides: Sequence[str], factor: float, calibration: dict[str, Any]) -> list[str]:
    """``overrides`` with ``algorithm.H_tgt`` = ``factor`` x the calibration's entropy (4 significant digits).

    >>> relative_h_tgt(["trainer.steps=2"], 0.7, {"entropy": 0.08712})
    ['trainer.steps=2', 'algorithm.H_tgt=0.06098']
    """
    entropy = calibration.get("entropy")
    if not factor > 0 or not finite(entropy) or not entropy > 0:
        raise ConfigError(
            f"--h-tgt-of-start {factor} x the start's entropy {entropy}: needs a factor > 0 and a calibration "
            "with a positive entropy (delete calibration.json to measure it again)"
        )
    return [*overrides, f"algorithm.H_tgt={factor * entropy:.4g}"]


def cold_start(config: RunConfig, root: Path) -> Path:
    """SFT once for the whole study; a finished SFT model in ``root/sft_model`` is reused."""
    out = root / "sft_model"
    if (out / "config.json").is_file():
        print(f"[sft] reusing {out}")
        return out
    from stare_agent.train.sft import sft

    cfg = replace(
        config,
        sft=replace(config.sft, output_dir=str(out)),
        trainer=replace(config.trainer, run_dir=str(root / "sft")),
    )
    summary = sft(cfg, overwrite=True)  # no finished model: an interrupted SFT of this study is redone
    return Path(summary["output_dir"])


def calibrate(config: RunConfig, sft_dir: Path, root: Path) -> dict[str, Any]:
    """Mean reward of the SFT policy on the problems of the first RL draw, sampled as in RL, the
    fraction of those groups whose rewards differ, and the policy's entropy on the model-written tokens
    of those episodes (``policy_entropy``: the gate's H-bar, to compare with H_tgt)."""
    path = root / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from stare_agent.engines import TransformersEngine
    from stare_agent.evaluation import evaluate
    from stare_agent.metrics import policy_entropy
    from stare_agent.models import load_policy
    from stare_agent.recipes.quickstart import run_precision
    from stare_agent.resources import open_sandboxes, train_source
    from stare_envs.engine import SamplingParams
    from stare_envs.problems import ProblemStream

    data, env = config.data, config.env
    model, tokenizer = load_policy(sft_dir)
    autocast = torch.bfloat16 if run_precision(config) == "bf16-autocast" else None
    problems = ProblemStream(train_source(config), seed=config.trainer.seed, difficulty=data.difficulty).take(
        data.prompts_per_draw or data.prompts_per_step
    )
    t0 = time.perf_counter()
    pool = open_sandboxes(config.sandbox)
    try:
        report = evaluate(
            problems,
            engine=TransformersEngine(model, tokenizer, autocast_dtype=autocast),
            tokenizer=tokenizer,
            samples=data.samples_per_prompt,
            sampling=SamplingParams(temperature=env.temperature, top_p=env.top_p, seed=config.trainer.seed),
            max_response_tokens=env.max_response_tokens,
            batch_size=config.sandbox.pool_size,
            env_id=env.id,
            env_kwargs={**env.env_kwargs(), "pool": pool},  # training's env: sampled as in RL
            progress=False,
            keep_trajectories=True,
        )
    finally:
        pool.close()
    device = next(model.parameters()).device.type
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast is not None):
        entropy = policy_entropy(model, report.trajectories, tokenizer.pad_token_id or 0)
    results = report.problems
    result = {
        "problems": len(results),
        "samples_per_problem": data.samples_per_prompt,
        "temperature": env.temperature,
        "mean_reward": sum(sum(r.correct) for r in results) / max(sum(len(r.correct) for r in results), 1),
        "groups_with_variance": sum(0 < sum(r.correct) < len(r.correct) for r in results)
        / max(len(results), 1),
        "entropy": entropy,
        "seconds": time.perf_counter() - t0,
    }
    path.write_text(json.dumps(result, indent=2))
    return result


def run_config(
    config_path: str | Path, overrides: Sequence[str], variant: str, seed: int, sft_dir: Path, run_dir: Path
) -> RunConfig:
    """The training config of one run: the study's config, ``overrides``, the variant's algorithm, the
    seed, the run directory and the SFT model; nothing else differs between runs. Every run reads the
    study's held-out entropy bank (``STUDY/entropy_bank.jsonl``, ``run_dir``'s grandparent)."""
    return load_research_config(
        config_path,
        [
            *overrides,
            *VARIANTS[variant],
            f"trainer.seed={seed}",
            f"trainer.run_dir={run_dir}",
            f"model.name_or_path={sft_dir}",
            f"research.entropy_bank={run_dir.parent.parent / BANK_NAME}",
        ],
    )


def start_eval(
    config_path: str | Path, overrides: Sequence[str], seeds: Sequence[int], sft_dir: Path, root: Path
) -> dict[int, dict[str, float]]:
    """Held-out accuracy of the shared start (the SFT model) on each seed's held-out problems, evaluated
    as that seed's runs evaluate at their steps (the same Trainer code, engine, problems and sampling
    seeds): the step 0 of the figure; and the start's entropy on the held-out entropy bank, which the
    first seed's evaluation samples from the start (``STUDY/entropy_bank.jsonl``,
    ``stare_research.entropy_bank``). Kept in ``start_eval.json``; a seed evaluated earlier (with the
    bank's entropy) is reused."""
    from stare_research.entropy_bank import BANK_METRIC
    from stare_research.trainer import ResearchTrainer

    path = root / START_NAME
    done = _read_starts(root)
    for seed in [s for s in seeds if BANK_METRIC not in done.get(s, {})]:
        config = run_config(
            config_path, overrides, MAIN_VARIANTS[0], seed, sft_dir, root / "start" / f"s{seed}"
        )
        trainer = ResearchTrainer(config)
        try:
            metrics = {f"eval/{k}": v for k, v in trainer.evaluate().metrics.items()}
            assert trainer.bank is not None  # run_config sets research.entropy_bank
            metrics[BANK_METRIC] = trainer.bank.entropy(
                trainer
            )  # sampled from the start if the study has none
            if config.data.eval_greedy:
                metrics.update(
                    {f"eval_greedy/{k}": v for k, v in trainer.evaluate(greedy=True).metrics.items()}
                )
        finally:
            trainer.close()
            del trainer
            gc.collect()
        done[seed] = metrics
        path.write_text(json.dumps(done, indent=2))
        print(
            f"[start seed {seed}] held-out accuracy of the SFT policy: "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "/avg@" in k),
            flush=True,
        )
    return done


def train_one(
    config_path: str | Path, overrides: Sequence[str], variant: str, seed: int, sft_dir: Path, root: Path
) -> Path:
    """Train one variant and seed from the SFT model; skip it when finished, resume it when interrupted."""
    from stare_agent.metrics import read_metrics
    from stare_research.trainer import ResearchTrainer

    run_dir = root / "runs" / f"{variant}-s{seed}"
    config = run_config(config_path, overrides, variant, seed, sft_dir, run_dir)
    done = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if done and done[-1]["step"] >= config.trainer.steps:
        print(f"[{variant} seed {seed}] finished earlier: {run_dir}")
        return run_dir
    print(f"[{variant} seed {seed}] training {config.trainer.steps} steps in {run_dir}", flush=True)
    trainer = ResearchTrainer(config, resume=True)
    try:
        trainer.fit()
    finally:
        trainer.close()
        del trainer
        gc.collect()
    return run_dir


# ---------------------------------------------------------------------------------------- report


def write_report(
    root: Path, pairs: Sequence[tuple[str, int]], calibration: dict[str, Any], *, h_tgt: float
) -> dict[str, Any]:
    """``study.csv``, ``study.png`` and ``study.md`` from the runs' ``metrics.jsonl``, each run led by
    its seed's evaluation of the start as step 0 (``start_eval.json``, where the study made it)."""
    from stare_agent.metrics import read_metrics
    from stare_research.plots import plot_study

    starts = _read_starts(root)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for variant, seed in pairs:
        start = [{"step": 0, **starts[seed]}] if seed in starts else []
        runs.setdefault(variant, {})[seed] = start + read_metrics(root / "runs" / f"{variant}-s{seed}")
    rows = [
        {"variant": v, "seed": s, **r}
        for v, by_seed in runs.items()
        for s, recs in by_seed.items()
        for r in recs
    ]
    keys = ["variant", "seed", "step", *sorted({k for r in rows for k in r} - {"variant", "seed", "step"})]
    with open(root / CSV_NAME, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    plot_study(runs, root / FIGURE_NAME, h_tgt=h_tgt)
    summary, start_numbers = summarize_runs(runs, {s: starts[s] for _, s in pairs if s in starts})
    (root / TABLE_NAME).write_text(format_table(summary, calibration, h_tgt, start_numbers))
    report = {"calibration": calibration, "start": start_numbers, "variants": summary}
    (root / "study.json").write_text(json.dumps(report, indent=2))
    return report


def summarize_runs(
    runs: dict[str, dict[int, list[dict[str, Any]]]], starts: dict[int, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """Each variant's :func:`summarize` (paired with GRPO-ds's runs on the same seed), and the start's
    held-out accuracy and bank entropy over the seeds of ``starts`` (seed -> the start's metrics)."""
    baseline = runs.get(MAIN_VARIANTS[0])
    summary = {
        v: summarize(by_seed, baseline if v != MAIN_VARIANTS[0] else None) for v, by_seed in runs.items()
    }
    start_numbers = {
        name: _stats(v)
        for name, v in (
            (
                name,
                [
                    float(start[k])
                    for _, start in sorted(starts.items())
                    for k in start
                    if k.startswith(prefix)
                ],
            )
            for name, prefix in (
                ("heldout_sampled", "eval/avg@"),
                ("heldout_greedy", "eval_greedy/avg@"),
                ("bank_entropy", BANK_KEY),
            )
        )
        if v
    }
    return summary, start_numbers


def tables_from_csv(path: str | Path) -> str:
    """The tables of a study from its ``study.csv`` alone (e.g. the copy a document ships), computed as
    ``study.md`` is today: a CSV written by an older version gets the current columns and intervals.
    Step 0 rows are the start's evaluation. The calibration is not in the CSV, so the first line gives
    only the start's held-out numbers.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no study CSV at {path}: pass the study.csv a study wrote (`stare-agent study`)")
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    starts: dict[int, dict[str, Any]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                variant, seed, step = row.pop("variant"), int(row.pop("seed")), int(row.pop("step"))
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"{path} is not a study CSV (needs variant, seed, step columns): {e}"
                ) from e
            record: dict[str, Any] = {"step": step, **{k: _number(v) for k, v in row.items() if v != ""}}
            runs.setdefault(variant, {}).setdefault(seed, []).append(record)
            if step == 0:
                starts.setdefault(seed, record)
    summary, start_numbers = summarize_runs(runs, starts)
    return format_table(summary, None, None, start_numbers)


def summarize(
    by_seed: dict[int, list[dict[str, Any]]], baseline: dict[int, list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Per-seed numbers of one variant, then their mean, sample SD and 95 % t interval (``intervals``).

    With ``baseline`` (GRPO-ds's runs by seed), also ``entropy_auc_vs_baseline``: this variant's entropy
    AUC minus the baseline's on the same seed, over the seeds both have. Within a seed every variant
    trains on the same prompts and is evaluated on the same problems, so the paired difference leaves
    out what the seeds' data adds to the spread.

    >>> run = lambda *h: [{"step": i + 1, "entropy": x} for i, x in enumerate(h)]
    >>> out = summarize({0: run(0.3, 0.3), 1: run(0.2, 0.2)}, baseline={0: run(0.1, 0.1), 1: run(0.2, 0.2)})
    >>> round(out["entropy_auc"]["mean"], 6), round(out["entropy_auc_vs_baseline"]["mean"], 6)
    (0.25, 0.1)
    """
    per_seed: dict[str, list[float]] = {}
    for seed, records in by_seed.items():
        numbers = run_numbers(records)
        if baseline is not None and seed in baseline:
            base_numbers = run_numbers(baseline[seed])
            for key in ("entropy_auc", "kept_entropy_auc"):
                base = base_numbers.get(key)
                if base is not None and key in numbers:
                    numbers[f"{key}_vs_baseline"] = numbers[key] - base
        for name, value in numbers.items():
            per_seed.setdefault(name, []).append(value)
    return {name: _stats(v) for name, v in per_seed.items()}


def run_numbers(records: list[dict[str, Any]]) -> dict[str, float]:
    """One run's numbers: entropy (``entropy``, the gate's reading) at the last step and its area under
    the curve per step (trapezoid over the logged steps, divided by the steps it spans), its mean over
    the first and over the last ``EDGE_STEPS`` logged steps and its standard deviation over the steps
    (step-to-step noise); whether the gate read the whole draw (``research.gate_batch=drawn``, which
    logs the kept batch's H-bar as ``stare/entropy_kept``) and the kept batch's late mean and AUC
    (the gate's reading itself where the gate reads the kept batch), best
    and final held-out accuracy (sampled ``eval/avg@k`` and greedy ``eval_greedy/avg@1``, over the
    trained steps: not the start's step 0), the mean over steps of the fraction of tokens STARE
    reweighted, of its mean token weight (how far its update is from GRPO-ds's), of ``|L+|`` and of
    the fraction of L+ whose reinforcement raises entropy at first order, the update's gradient-mass
    weighted mean weight and the first-order entropy change of its L+ part (stare_research.entropy_effect), and
    the median seconds per step and of its log-prob pass (GRPO-ds takes none).

    >>> r = [{"step": 1, "entropy": 0.5}, {"step": 2, "entropy": 0.3}, {"step": 3, "entropy": 0.1}]
    >>> run_numbers(r)["entropy_final"], round(run_numbers(r)["entropy_auc"], 6)
    (0.1, 0.3)
    """
    out: dict[str, float] = {}
    H = [(r["step"], float(r["entropy"])) for r in records if finite(r.get("entropy"))]
    if H:
        out["entropy_final"] = H[-1][1]
        out["entropy_auc"] = _auc(H)
    # `entropy` is the gate's reading: the kept batch's (the paper's H-bar), or under
    # research.gate_batch=drawn the whole draw's, which logs the kept batch's as `stare/entropy_kept`
    drawn = any(finite(r.get(KEPT_KEY)) for r in records)
    kept = [(r["step"], float(r[KEPT_KEY])) for r in records if finite(r.get(KEPT_KEY))] if drawn else H
    if H:
        out["gate_reads_whole_draw"] = float(drawn)
    if kept:
        out["kept_entropy_late"] = _mean([h for _, h in kept][-EDGE_STEPS:])
        out["kept_entropy_auc"] = _auc(kept)
    for tag, prefix in (("sampled", "eval/avg@"), ("greedy", "eval_greedy/avg@")):
        acc = [
            float(r[k]) for r in records if r["step"] > 0 for k in r if k.startswith(prefix) and finite(r[k])
        ]
        if acc:
            out[f"heldout_{tag}_best"], out[f"heldout_{tag}_final"] = max(acc), acc[-1]
    if H:
        values = [h for _, h in H]
        out["entropy_early"], out["entropy_late"] = _mean(values[:EDGE_STEPS]), _mean(values[-EDGE_STEPS:])
        out["entropy_step_std"] = _std(values)
    bank = [(r["step"], float(r[BANK_KEY])) for r in records if finite(r.get(BANK_KEY))]
    if bank:
        out["bank_entropy_start"] = bank[0][1] if bank[0][0] == 0 else math.nan
        trained = [h for s, h in bank if s > 0]
        if trained:
            out["bank_entropy_late"] = _mean(trained[-BANK_EVALS:])
    rewards = [float(r["reward_mean"]) for r in records if r["step"] > 0 and finite(r.get("reward_mean"))]
    if rewards:
        out["reward"], out["reward_late"] = _mean(rewards), _mean(rewards[-EDGE_STEPS:])
    gate, _ = gate_fraction([r for r in records if r["step"] > 0 and finite(r.get("gate_on"))])
    if gate is not None:
        out["gate_on"] = gate
    for key, name in (
        ("frac_reweighted", "reweighted"),
        ("stare/mean_weight", "mean_weight"),
        ("stare/L_plus", "L_plus"),
        ("stare/L_plus_raising", "L_plus_raising"),
        ("stare/mass_weight", "mass_weight"),
        ("stare/dH_first_order_L_plus", "dH_first_order_L_plus"),
    ):
        values = [float(r[key]) for r in records if finite(r.get(key))]
        if values:
            out[name] = _mean(values)
    for key, name in (("time/step_s", "seconds_per_step"), ("time/logprob_s", "logprob_seconds")):
        times = sorted(float(r[key]) for r in records if finite(r.get(key)))
        if times:
            out[name] = times[len(times) // 2]
    if records:
        out["steps"] = float(records[-1]["step"])
    return out


EDGE_STEPS = 5  # "early" and "late" entropy: the mean over this many steps at each end of a run
BANK_KEY, BANK_EVALS = "eval/bank_entropy", 2  # "late" bank entropy: the mean of its last 2 evaluations
KEPT_KEY = "stare/entropy_kept"  # the kept batch's H-bar, logged where the gate reads the whole draw
DYNAMICS_COLUMNS = (
    ("entropy_early", f"entropy, first {EDGE_STEPS} steps"),
    ("entropy_late", f"entropy, last {EDGE_STEPS} steps"),
    ("entropy_step_std", "entropy std over steps"),
    ("bank_entropy_late", f"bank entropy, last {BANK_EVALS} evals"),
    ("gate_on", "steps gate on"),
    ("L_plus", "L+ tokens per step"),
    ("L_plus_raising", "L+ raising entropy (1st order)"),
    ("mass_weight", "gradient-mass mean weight"),
    ("dH_first_order_L_plus", "1st-order dH of L+"),
)
COLUMNS = (
    ("steps", "steps logged"),
    ("entropy_late", f"entropy, last {EDGE_STEPS} steps"),
    ("entropy_auc", "entropy AUC/step"),
    ("entropy_auc_vs_baseline", "AUC - GRPO-ds's, same seed"),
    ("bank_entropy_late", f"held-out bank entropy, last {BANK_EVALS} evals"),
    ("reward", "reward on RL draws"),
    ("heldout_sampled_best", "best held-out acc (sampled)"),
    ("heldout_sampled_final", "final held-out acc (sampled)"),
    ("heldout_greedy_best", "best held-out acc (greedy)"),
    ("heldout_greedy_final", "final held-out acc (greedy)"),
    ("reweighted", "tokens reweighted"),
    ("mean_weight", "mean token weight"),
    ("seconds_per_step", "s/step"),
    ("logprob_seconds", "log-prob pass s/step"),
)
# Both sampled-entropy estimators side by side, printed when a variant's gate reads the whole draw
# (research.gate_batch=drawn): the tables above give each run's gate reading, the whole draw's for
# those variants and the kept batch's for the others; the kept batch is the estimator every run logs.
ESTIMATOR_COLUMNS = (
    ("gate_reads_whole_draw", "the gate reads"),
    ("entropy_late", f"gate's reading, last {EDGE_STEPS} steps"),
    ("entropy_auc", "gate's reading AUC/step"),
    ("kept_entropy_late", f"kept batch (the paper's H-bar), last {EDGE_STEPS} steps"),
    ("kept_entropy_auc", "kept-batch AUC/step"),
    ("kept_entropy_auc_vs_baseline", "kept-batch AUC - GRPO-ds's, same seed"),
)


def format_table(
    summary: dict[str, dict[str, Any]],
    calibration: dict[str, Any] | None,
    h_tgt: float | None,
    start: dict[str, dict[str, float]] | None = None,
) -> str:
    """The markdown tables, mean +- 95 % t interval (sample SD) over seeds per variant, after a line on the start (the
    calibration, and ``start``: its held-out accuracy over the seeds' held-out sets): the main one
    (``COLUMNS``), then the entropy's dynamics and STARE's reach (``DYNAMICS_COLUMNS``), both on each
    run's gate reading; where a variant's gate reads the whole draw, a third table sets that reading
    beside the kept batch's and compares with GRPO-ds on the kept batch (``ESTIMATOR_COLUMNS``). Without
    ``calibration`` (a table redone from a CSV) the line gives the start's held-out numbers alone."""
    held_out = "".join(
        f", held-out accuracy ({tag}) {n['mean']:.3f}"
        + (
            f" ± {n['ci95']:.3f} (95 % t interval, SD {n['sd']:.3f}) over {n['n']} seeds"
            if n["n"] > 1
            else ""
        )
        for tag, n in ((tag, (start or {}).get(f"heldout_{tag}")) for tag in ("sampled", "greedy"))
        if n
    )
    bank = (start or {}).get("bank_entropy")
    held_out += f", entropy on the held-out bank {bank['mean']:.4f}" if bank else ""
    lines = [
        f"Start (SFT policy, temperature {calibration['temperature']:g}): mean reward "
        f"{calibration['mean_reward']:.3f} on {calibration['problems']} x {calibration['samples_per_problem']} "
        f"RL draws, entropy on those sampled tokens {calibration.get('entropy', math.nan):.3f}{held_out}; "
        f"H_tgt = {h_tgt:g}."
        if calibration is not None
        else f"Start (the study's step 0){held_out or ': no evaluation logged'}."
    ]
    tables = [COLUMNS, DYNAMICS_COLUMNS]
    drawn = [v for v, numbers in summary.items() if numbers.get("gate_reads_whole_draw", {}).get("mean")]
    if drawn:
        tables.append(ESTIMATOR_COLUMNS)
    for columns in tables:
        if columns is ESTIMATOR_COLUMNS:
            lines += [
                "",
                "Entropy above is each run's gate reading: the kept batch's sampled entropy (the paper's "
                f"H-bar), but the whole draw's for {', '.join(drawn)} (research.gate_batch=drawn), whose "
                "AUC - GRPO-ds's therefore compares two estimators. Both side by side, and the difference "
                "from GRPO-ds on the kept batch, the estimator every run logs:",
            ]
        lines += [
            "",
            "| variant | seeds | " + " | ".join(title for _, title in columns) + " |",
            "|---|---:|" + "---:|" * len(columns),
        ]
        for variant, numbers in summary.items():
            seeds = max((n["n"] for n in numbers.values()), default=0)
            cells = [_cell(key, numbers.get(key)) for key, _ in columns]
            lines.append(f"| {variant} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(key: str, n: dict[str, float] | None) -> str:
    """One table cell: the mean over seeds, with its interval and SD over more than one seed."""
    if n is None:
        return "-"
    if key == "steps":  # mean over seeds
        return f"{n['mean']:g}"
    if key == "gate_reads_whole_draw":
        return "whole draw" if n["mean"] == 1 else "kept batch" if n["mean"] == 0 else "mixed"
    return f"{format_ci(n)} (SD {n['sd']:.3f})" if n["n"] > 1 else f"{n['mean']:.3f}"


def _read_starts(root: Path) -> dict[int, dict[str, float]]:
    """The start's held-out metrics by seed (``start_eval.json``), or nothing before ``start_eval``."""
    path = root / START_NAME
    return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.is_file() else {}


def _stats(xs: list[float]) -> dict[str, float]:
    return mean_sd_ci(xs)


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def finite(x: Any) -> TypeGuard[int | float]:
    """Whether ``x`` is a number and finite (not NaN, not infinite): a metric that was logged."""
    return isinstance(x, int | float) and math.isfinite(x)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _auc(H: list[tuple[int, float]]) -> float:
    """Area under (step, entropy) by the trapezoid rule, per step of the span it covers."""
    span = H[-1][0] - H[0][0]
    area = sum((s1 - s0) * (h0 + h1) / 2 for (s0, h0), (s1, h1) in zip(H, H[1:], strict=False))
    return area / span if span else H[0][1]


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


__all__ = [
    "MAIN_VARIANTS",
    "VARIANTS",
    "plan",
    "run_config",
    "run_numbers",
    "start_eval",
    "study",
    "summarize_runs",
    "tables_from_csv",
    "write_report",
]
