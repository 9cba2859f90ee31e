"""The `stare-agent` command line. Each subcommand imports what it needs lazily so that
`stare-agent sandbox doctor` works even where torch is broken."""

from __future__ import annotations

import argparse
import json
import sys


def _sandbox_build(args: argparse.Namespace) -> int:
    from sandbox.build import build_image, image_exists

    if image_exists(args.tag) and not args.force:
        print(f"sandbox image {args.tag} present (use --force to rebuild)")
        return 0
    build_image(args.tag, force=args.force)
    return 0


def _sandbox_doctor(args: argparse.Namespace) -> int:
    from sandbox.doctor import diagnose

    failed = 0
    for check in diagnose():
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.message}")
        failed += not check.ok
    return 1 if failed else 0


def _sandbox_demo(args: argparse.Namespace) -> int:
    from sandbox import make_sandbox

    cells = [
        "import sympy as sp\nn = 2**127 - 1\nsp.isprime(n)",
        "x = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
        "n % 1000",
        "1 / 0",
    ]
    with make_sandbox(args.backend) as sb:
        print(f"backend: {sb.backend}")
        for code in cells:
            result = sb.run(code)
            shown = result.stdout.strip() or (
                f"{result.error.type}: {result.error.message}" if result.error else ""
            )
            print(f">>> {code.splitlines()[-1]}\n{shown}   [{result.duration_s * 1000:.1f} ms]")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from envs.problems import load_problems
    from envs.rollout import SamplingParams
    from stare_agent.engines import TransformersEngine
    from stare_agent.evaluation import evaluate
    from stare_agent.models import load_policy

    problems = load_problems(args.data)  # fail on a bad path before loading a model
    model, tokenizer = load_policy(args.model, device=args.device)
    engine = TransformersEngine(model, tokenizer)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    report = evaluate(
        problems,
        engine=engine,
        tokenizer=tokenizer,
        samples=args.samples,
        sampling=sampling,
        max_response_tokens=args.max_response_tokens,
        batch_size=args.batch_size,
        limit=args.limit,
        env_kwargs={"format": args.format, "sandbox_backend": args.backend, "max_turns": args.max_turns},
        out_dir=args.out,
    )
    print(report.table())
    print(f"per-problem results: {args.out}/results.jsonl")
    return 0


def _train(args: argparse.Namespace) -> int:
    from stare_agent.config import load_config
    from stare_agent.trainer import Trainer

    config = load_config(args.config, args.overrides)
    summary = Trainer(config, resume=args.resume).fit()
    print(f"trained {summary['steps']} steps; run directory: {summary['run_dir']}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from stare_agent.cold_start import sft
    from stare_agent.config import load_config

    summary = sft(load_config(args.config, args.overrides))
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from stare_agent.quickstart import CONFIG, quickstart

    quickstart(args.config or CONFIG, args.overrides)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from stare_agent.plots import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stare-agent", description="Train and evaluate tool-using LLM agents with STARE."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sandbox = sub.add_parser("sandbox", help="build, check or try the code sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    from sandbox.config import DEFAULT_IMAGE

    p = sandbox_sub.add_parser("build", help="build the sandbox image from Debian packages")
    p.add_argument("--tag", default=DEFAULT_IMAGE)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.set_defaults(func=_sandbox_build)
    p = sandbox_sub.add_parser("doctor", help="check daemon, image and permissions; one line per problem")
    p.set_defaults(func=_sandbox_doctor)
    p = sandbox_sub.add_parser("demo", help="run a few cells in a sandbox")
    p.add_argument("--backend", default="auto", choices=["auto", "docker", "local"])
    p.set_defaults(func=_sandbox_demo)

    p = sub.add_parser("eval", help="tool-use accuracy (avg@k, pass@k, maj@k) on a problem set")
    p.add_argument(
        "--model", default="embedded:smollm2-135m-instruct", help="HF id, local path or embedded:NAME"
    )
    p.add_argument(
        "--data",
        required=True,
        help="a built-in set (aime2024, aime2025, amc23, math500), a JSONL/Parquet file of "
        "{id, problem, answer}, or a hub name",
    )
    p.add_argument("--samples", type=int, default=4, help="k: sampled episodes per problem")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N problems")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-response-tokens", type=int, default=1024)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--format", default="retool", choices=["retool", "hermes"])
    p.add_argument("--backend", default="auto", choices=["auto", "docker", "local"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="runs/eval", help="directory for results.jsonl and summary.json")
    p.set_defaults(func=_eval)

    p = sub.add_parser("sft", help="cold-start SFT on ReTool-format traces (model-written tokens only)")
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.epochs=3 sft.data=traces.jsonl")
    p.set_defaults(func=_sft)

    p = sub.add_parser(
        "train", help="RL training with GRPO-ds or STARE (launch with torchrun/deepspeed for >1 rank)"
    )
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/quickstart.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.W=1.2 trainer.steps=10")
    p.set_defaults(func=_train)

    p = sub.add_parser("plot", help="draw a run's training dynamics as PNG files")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    p.set_defaults(func=_plot)

    p = sub.add_parser("quickstart", help="the main job: baseline eval, cold-start SFT, STARE RL, eval again")
    p.add_argument("--config", default=None, help="default: configs/quickstart.yaml")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=5 sandbox.backend=local"
    )
    p.set_defaults(func=_quickstart)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message already names the cause and the fix: shown as one line."""
    from envs.problems import ProblemSourceError
    from sandbox.errors import SandboxError

    errors: list[type[BaseException]] = [ProblemSourceError, SandboxError, FileNotFoundError]
    try:  # these need torch; a broken torch install must not hide the original error
        from stare_agent.config import ConfigError
        from stare_agent.engines.sglang_engine import SGLangUnavailableError
        from stare_agent.models import ModelLoadError
        from stare_agent.sft_data import SFTDataError

        errors += [ConfigError, ModelLoadError, SGLangUnavailableError, SFTDataError]
    except ImportError:
        pass
    return tuple(errors)


# Left out of the slim install (`pip install stare-agent`: sandbox and envs only).
TRAIN_PACKAGES = frozenset({"torch", "transformers", "accelerate", "deepspeed", "omegaconf", "matplotlib"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TRAIN_PACKAGES:
            raise
        print(
            f"error: `stare-agent {args.command}` needs {exc.name}, which the slim install leaves out: "
            "pip install 'stare-agent[train]'",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
