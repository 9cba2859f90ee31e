"""The research floor's subcommands of ``stare-agent``: ``study`` and ``replay``, added through the
``stare_agent.commands`` entry points (pyproject.toml), so the product's CLI never imports this package."""

from __future__ import annotations

import argparse
from typing import Any

from stare_agent.cli import positive_int


def add_replay(sub: Any) -> None:
    """``stare-agent replay``: a learner variant on the batches a run saved."""
    p = sub.add_parser(
        "replay",
        help="train a learner variant on the batches a run saved (trainer.save_rollouts): paired ablations, "
        "no rollouts",
        description="Frozen-rollout replay: train on RUN_DIR/rollouts/step_*.jsonl (--from) from the run's starting "
        "weights, step by step, with the run's config and learner overrides (algorithm.*, optim.*, "
        "deepspeed.*, model.*, logger.*, research.*). OUT gets config.yaml, replay.json and metrics.jsonl.",
    )
    p.add_argument(
        "--from",
        dest="run_dir",
        required=True,
        metavar="RUN_DIR",
        help="a run made with trainer.save_rollouts=true",
    )
    p.add_argument("--out", required=True, help="the replay's directory (new)")
    p.add_argument("--model", default=None, help="starting weights (default: the run's model.name_or_path)")
    p.add_argument("--steps", type=positive_int, default=None, help="replay only the first N saved steps")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="learner overrides, e.g. algorithm.W=2.0"
    )
    p.set_defaults(func=_replay)


def add_study(sub: Any) -> None:
    """``stare-agent study``: entropy dynamics of GRPO-ds against STARE over seeds."""
    p = sub.add_parser(
        "study",
        help="entropy dynamics of GRPO-ds vs STARE (and the open-loop ablations) over seeds: figure and table",
    )
    p.add_argument(
        "--config", default=None, help="the training config every run shares (default: configs/study.yaml)"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="default: stare_research.study.PAPER_VARIANTS; any of stare_research.study.VARIANTS",
    )
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds of GRPO-ds, STARE-O1 and STARE-C2")
    p.add_argument("--ablation-seeds", type=positive_int, default=1, help="seeds of each open-loop ablation")
    p.add_argument(
        "--smoke", action="store_true", help="2 variants, 1 seed, 2 tiny steps: checks the pipeline"
    )
    p.add_argument(
        "--report", action="store_true", help="train nothing: figure and table of the runs logged so far"
    )
    p.add_argument(
        "--tables-of",
        default=None,
        metavar="CSV",
        help="train nothing: print the tables of a study.csv (e.g. docs/study.csv) as a study computes them now",
    )
    p.add_argument(
        "--h-tgt-of-start",
        type=float,
        default=None,
        metavar="FACTOR",
        help="algorithm.H_tgt = FACTOR x the start's entropy measured by the calibration (e.g. 0.7: the closed loop)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.steps=20")
    p.set_defaults(func=_study)


def _replay(args: argparse.Namespace) -> int:
    from stare_research.replay import replay

    summary = replay(args.run_dir, args.out, args.overrides, model=args.model, steps=args.steps)
    print(f"replayed {summary['steps']} steps; replay directory: {summary['run_dir']}")
    return 0


def _study(args: argparse.Namespace) -> int:
    from stare_research.study import CONFIG, study, tables_from_csv

    if args.tables_of is not None:
        print(tables_from_csv(args.tables_of), end="")
        return 0
    study(
        args.config or CONFIG,
        args.overrides,
        variants=args.variants,
        seeds=args.seeds,
        ablation_seeds=args.ablation_seeds,
        smoke=args.smoke,
        report_only=args.report,
        h_tgt_of_start=args.h_tgt_of_start,
    )
    return 0
