"""The `stare-agent` command line. Each subcommand imports what it needs lazily so that
`stare-agent sandbox doctor` works even where torch is broken."""

from __future__ import annotations

import argparse
import errno
import json
import re
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A Docker image reference: [host[:port]/]name[/name...][:tag], lowercase names.
IMAGE_REFERENCE = re.compile(
    r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
)


def _sandbox_build(args: argparse.Namespace) -> int:
    from stare_agent.config import ConfigError
    from stare_sandbox.build import build_image, image_exists
    from stare_sandbox.config import DEFAULT_IMAGE

    if not IMAGE_REFERENCE.fullmatch(args.tag):
        raise ConfigError(
            f"--tag {args.tag!r} is not a Docker image reference: use lowercase name[:tag], e.g. {DEFAULT_IMAGE}"
        )

    if image_exists(args.tag) and not args.force:
        print(f"sandbox image {args.tag} present (use --force to rebuild)")
        return 0
    build_image(args.tag, force=args.force)
    return 0


def _sandbox_doctor(args: argparse.Namespace) -> int:
    from stare_sandbox.doctor import diagnose, diagnose_ray

    if args.backend == "ray":
        checks = diagnose_ray(
            args.address, namespace=args.namespace, node_resource=args.resource, wait_s=args.timeout
        )
    else:
        checks = diagnose()
    failed = 0
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        print(f"[{mark}] {check.name}: {check.message}")
        failed += not check.ok
    return 1 if failed else 0


def _doctor_tokens(args: argparse.Namespace) -> int:
    from stare_agent.models import load_tokenizer
    from stare_envs.qualification import format_table, qualify

    tokenizer = load_tokenizer(args.model)
    results = {fmt: qualify(tokenizer, fmt) for fmt in args.formats}
    print(format_table(args.model, results))
    return 1 if any(r.exact is False for rows in results.values() for r in rows) else 0


def _sandbox_demo(args: argparse.Namespace) -> int:
    from stare_sandbox import make_sandbox

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


# `stare-agent eval` flags and the config fields they set (one way: flags are overrides).
EVAL_FLAGS = {
    "model": "model.name_or_path",
    "data": "data.eval",
    "samples": "data.eval_samples",
    "limit": "data.eval_limit",
    "temperature": "data.eval_temperature",
    "top_p": "data.eval_top_p",
    "seed": "trainer.seed",
    "max_response_tokens": "env.max_response_tokens",
    "max_turns": "env.max_turns",
    "format": "env.format",
    "env": "env.id",
    "backend": "sandbox.backend",
}


def _eval(args: argparse.Namespace) -> int:
    from stare_agent import run_dirs
    from stare_agent.config import load_config
    from stare_agent.eval_files import check_resume, config_resume_settings
    from stare_agent.evaluation import evaluate_config
    from stare_agent.models import resolve_policy_path
    from stare_agent.provenance import model_settings
    from stare_agent.resources import eval_source, make_env
    from stare_envs.problems import eval_problems

    _check_eval_flags(args)
    flags = [
        f"{key}={getattr(args, name)}" for name, key in EVAL_FLAGS.items() if getattr(args, name) is not None
    ]
    config = load_config(args.config, [*args.overrides, *flags])
    data, env = config.data, config.env
    # The user's inputs first (the model path, the env id and its problems), then this machine's (the
    # env's sandbox backend: Docker), all before loading a model. The probe env leases no sandbox.
    resolve_policy_path(_eval_tokenizer_path(args, config))
    problems = eval_problems(
        eval_source(config), seed=config.trainer.seed, difficulty=data.difficulty, limit=data.eval_limit
    )
    with make_env(env, evaluation=True, sandbox_backend=config.sandbox.backend) as probe:
        print(f"env: {env.id} (format {probe.format.name}, tools: {', '.join(probe.tools)})")
    # --out: writable, not in use, and holding no evaluation unless resumed or overwritten; held until
    # the evaluation ends, checked before an engine starts
    model = model_settings(config.model.name_or_path)
    with run_dirs.locked(args.out, "--out") as out:
        run_dirs.check_evaluation(out, resume=args.resume, overwrite=args.overwrite)
        if args.resume:  # other settings are refused before a model loads, not after
            check_resume(out, config_resume_settings(config, problems, model))
        engine, tokenizer = _eval_engine(args, config)
        try:
            report = evaluate_config(
                config,
                engine=engine,
                tokenizer=tokenizer,
                batch_size=args.batch_size,
                problems=problems,
                out_dir=out,
                resume=args.resume,
                save_episodes=args.save_episodes,
                settings={"model": model},
            )
        finally:
            if hasattr(engine, "close"):
                engine.close()
    print(report.table())
    print(f"per-problem results: {args.out}/results.jsonl")
    return 0


def _check_eval_flags(args: argparse.Namespace) -> None:
    """Flags argparse cannot check, refused before anything loads."""
    from stare_agent.config import ConfigError

    for name, key in EVAL_FLAGS.items():
        if getattr(args, name) == "":
            raise ConfigError(
                f"--{name.replace('_', '-')} is empty: give it a value ({key}), or leave it out"
            )
    if args.engine == "openai" and not args.base_url:
        raise ConfigError(
            "--engine openai needs --base-url: pass the server's API root, e.g. http://127.0.0.1:8000/v1"
        )
    if args.base_url and not args.base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"--base-url {args.base_url!r} is not an http(s) URL: pass e.g. http://127.0.0.1:8000/v1"
        )
    if args.engine != "openai":
        _check_device(args.device)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: pass a directory for results.jsonl and summary.json")
    if args.resume and not (out / "results.jsonl").is_file():
        raise ConfigError(
            f"--resume: {out / 'results.jsonl'} not found: pass the --out of the evaluation to continue"
        )


def _check_device(device: str) -> None:
    import torch

    from stare_agent.config import ConfigError

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a torch device: use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count()
        if not count or (parsed.index is not None and parsed.index >= count):
            raise ConfigError(
                f"--device {device}: this machine has {count} CUDA device(s) visible: use --device cpu"
            )
    elif parsed.type != "cpu":
        raise ConfigError(f"--device {device!r}: stare-agent eval runs on cpu or cuda[:N]")


def _eval_tokenizer_path(args: argparse.Namespace, config: Any) -> str:
    """The rollouts' tokenizer: ``--tokenizer`` for an OpenAI-compatible server, else the model's."""
    name = args.engine or config.env.engine
    return str((args.tokenizer if name == "openai" else None) or config.model.name_or_path)


def _eval_engine(args: argparse.Namespace, config: Any) -> tuple[Any, Any]:
    """The engine `stare-agent eval --engine` names (default: env.engine), and the rollouts' tokenizer."""
    from stare_agent.engines import start_engine
    from stare_agent.models import load_tokenizer

    name = args.engine or config.env.engine
    if name == "sglang":
        raise SystemExit("stare-agent eval has no --engine sglang: use --engine vllm, transformers or openai")
    tokenizer = load_tokenizer(_eval_tokenizer_path(args, config))
    if config.data.eval_fp32:  # decoded as the quickstart's table is (the transformers engine: fp32 already)
        from dataclasses import replace

        config = replace(config, env=replace(config.env, vllm=replace(config.env.vllm, dtype="float32")))
    description, engine = start_engine(
        config, None, tokenizer, name=name, device=args.device, base_url=args.base_url, api_key=args.api_key
    )
    print(f"engine: {description}")
    return engine, tokenizer


def _train(args: argparse.Namespace) -> int:
    from stare_agent.config import ConfigError, load_config
    from stare_agent.train.trainer import Trainer

    config = load_config(args.config, args.overrides)
    if args.resume and not Path(config.trainer.run_dir).is_dir():
        raise ConfigError(
            f"--resume: the run directory {config.trainer.run_dir} does not exist: pass the trainer.run_dir "
            "of the run to continue, or leave out --resume to start a new run"
        )
    summary = Trainer(config, resume=args.resume, overwrite=args.overwrite).fit()
    steps, skipped = summary["steps"], summary["skipped_steps"]
    if skipped:  # a step with no group to learn from took no update: not "trained"
        print(
            f"ran {steps} steps, {steps - skipped} trained and {skipped} skipped (nothing to train: see "
            f"skip_reason in metrics.jsonl); run directory: {summary['run_dir']}"
        )
    else:
        print(f"trained {steps} steps; run directory: {summary['run_dir']}")
    if summary.get("stopped_by"):  # a signal stopped it at a step boundary: 128 + the signal, as a shell says
        return 128 + int(signal.Signals[summary["stopped_by"]])
    return 0


def _sft(args: argparse.Namespace) -> int:
    from stare_agent.config import load_config
    from stare_agent.train.sft import sft

    summary = sft(load_config(args.config, args.overrides), overwrite=args.overwrite)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _quickstart(args: argparse.Namespace) -> int:
    from stare_agent.recipes.quickstart import CONFIG, quickstart

    quickstart(args.config or CONFIG, args.overrides, overwrite=args.overwrite)
    return 0


def _paper_run(args: argparse.Namespace) -> int:
    from stare_agent.recipes.paper_run import run

    return run(
        args.arms,
        gpus=args.gpus,
        placement=args.placement,
        runs=args.runs,
        resume=args.resume,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        sft_overrides=args.sft_set,
        rl_overrides=args.set,
    )


def _plot(args: argparse.Namespace) -> int:
    from stare_agent.config import ConfigError
    from stare_agent.recipes.plots import plot_dashboard

    if args.labels is not None and len(args.labels) != len(args.run_dirs):
        raise ConfigError(
            f"--labels gives {len(args.labels)} names for {len(args.run_dirs)} run directories: give one per run"
        )
    print(plot_dashboard(args.run_dirs, args.out, args.labels))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line of cause and fix (exit code 2), like every other error;
    ``fields``: config keys that ``--help`` lists with their defaults and docs (read from the config
    dataclasses only then: building the parser imports no torch, for the slim install)."""

    def __init__(self, *args: Any, fields: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields = fields

    def format_help(self) -> str:
        if self.fields and self.epilog is None:
            self.epilog = "main fields (KEY=DEFAULT; every field: docs/configuration.md):\n" + _fields_help(
                self.fields
            )
        return super().format_help()

    def error(self, message: str) -> Any:  # argparse's signature: NoReturn
        self.exit(2, f"error: {self.prog}: {message}: see `{self.prog} --help`\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


# `stare-agent paper-run`'s arms and placements (stare_agent.recipes.paper_run.ARMS and PLACEMENTS, which
# import the config loader: the parser is built without it, for the slim install).
PAPER_ARMS = ("stare-o1", "grpo-ds", "stare-c2")
PAPER_PLACEMENTS = ("colocated", "separate")


# The fields most runs set, listed by `stare-agent train --help` (all of them: docs/configuration.md).
TRAIN_FIELDS = (
    "model.name_or_path",
    "data.train",
    "data.eval",
    "data.prompts_per_step",
    "data.samples_per_prompt",
    "algorithm.name",
    "algorithm.variant",
    "algorithm.W",
    "algorithm.H_tgt",
    "optim.lr",
    "trainer.steps",
    "trainer.run_dir",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.seed",
    "env.id",
    "env.engine",
    "env.max_turns",
    "env.max_response_tokens",
    "sandbox.backend",
    "deepspeed.precision",
    "logger.backends",
)


def _fields_help(keys: tuple[str, ...]) -> str:
    """``key=default`` and its doc for each key, from the config dataclasses."""
    try:
        from stare_agent.config import RunConfig
        from stare_agent.config_reference import attribute_docs, yaml_value
    except ModuleNotFoundError as exc:  # the slim install
        return f"  (listed with pip install 'stare-agent[train]': {exc.name} is missing)"

    lines = []
    for key in keys:
        section_name, _, name = key.rpartition(".")
        section: Any = RunConfig()
        for part in section_name.split("."):
            section = getattr(section, part)
        doc = attribute_docs(type(section)).get(name, "").replace("``", "")
        lines.append(f"  {key}={yaml_value(getattr(section, name))}")
        lines += textwrap.wrap(
            textwrap.shorten(doc, 230, placeholder=" ..."),
            94,
            initial_indent=" " * 6,
            subsequent_indent=" " * 6,
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from stare_agent import __version__
    from stare_agent.options import ENGINE_NAMES
    from stare_sandbox.config import BACKENDS

    parser = _Parser(prog="stare-agent", description="Train and evaluate tool-using LLM agents with STARE.")
    parser.add_argument("--version", action="version", version=f"stare-agent {__version__}")
    # The deepspeed launcher appends --local_rank=N (before the subcommand); the rank is read from
    # the LOCAL_RANK variable it also sets, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    sandbox = sub.add_parser("sandbox", help="build, check or try the code sandbox")
    sandbox_sub = sandbox.add_subparsers(dest="sandbox_command", required=True, parser_class=_Parser)
    from stare_sandbox.config import DEFAULT_IMAGE

    p = sandbox_sub.add_parser("build", help="build the sandbox image from Debian packages")
    p.add_argument("--tag", default=DEFAULT_IMAGE)
    p.add_argument("--force", action="store_true", help="rebuild even if the image exists")
    p.set_defaults(func=_sandbox_build)
    p = sandbox_sub.add_parser("doctor", help="check daemon, image and permissions; one line per problem")
    p.add_argument(
        "--backend",
        default="docker",
        choices=["docker", "ray"],
        help="docker: this machine; ray: the Ray cluster's sandbox nodes, hosts and coordinator",
    )
    p.add_argument("--address", default="auto", help="ray: the cluster (auto, or HOST:PORT)")
    p.add_argument(
        "--namespace", default="stare-agent", help="ray: the fleet's namespace (sandbox.ray.namespace)"
    )
    p.add_argument("--resource", default="stare_sandbox", help="ray: the sandbox nodes' resource")
    p.add_argument("--timeout", type=float, default=120.0, help="ray: seconds to wait for the hosts to start")
    p.set_defaults(func=_sandbox_doctor)
    p = sandbox_sub.add_parser("demo", help="run a few cells in a sandbox")
    p.add_argument("--backend", default="auto", choices=[b for b in BACKENDS if b != "ray"])
    p.set_defaults(func=_sandbox_demo)

    _add_doctor(sub)

    p = sub.add_parser(
        "eval",
        help="tool-use accuracy (avg@k, pass@k, maj@k) on a problem set, with the config's environment",
        description="Evaluate with the env the config trains on (env.id, env.*, env.eval_kwargs) and its "
        "validation sampling (data.eval_*). Each flag sets the config field named in its help; flags win "
        "over the file and the overrides.",
    )
    p.add_argument("--config", default=None, help="YAML config (default: the built-in defaults, the paper's)")
    p.add_argument("--model", help="model.name_or_path: HF id, local path or embedded:NAME")
    p.add_argument(
        "--data", help="data.eval: JSONL/Parquet file of {id, problem, answer}, a hub name or a family"
    )
    p.add_argument("--samples", type=int, help="data.eval_samples: k sampled episodes per problem")
    p.add_argument("--limit", type=int, help="data.eval_limit: evaluate only the first N problems")
    p.add_argument("--temperature", type=float, help="data.eval_temperature")
    p.add_argument("--top-p", type=float, help="data.eval_top_p")
    p.add_argument("--seed", type=int, help="trainer.seed")
    p.add_argument("--max-response-tokens", type=int, help="env.max_response_tokens")
    p.add_argument("--max-turns", type=int, help="env.max_turns")
    p.add_argument("--format", choices=["retool", "hermes"], help="env.format")
    p.add_argument("--env", help="env.id: a Gymnasium id (or module:id) of a tool environment")
    p.add_argument("--backend", choices=BACKENDS, help="sandbox.backend")
    p.add_argument("--batch-size", type=positive_int, default=16, help="episodes advanced together")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--engine",
        choices=[e for e in ENGINE_NAMES if e != "sglang"],
        help="env.engine (default: the config's, transformers): transformers loads --model here; vllm runs "
        "vllm.LLM in a worker (env.vllm.*); auto: vllm when found, else transformers; openai: a served "
        "model behind --base-url (vLLM, SGLang, ...)",
    )
    p.add_argument("--base-url", help="--engine openai: the server's API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", help="--engine openai: the server's API key (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", help="--engine openai: tokenizer name or path (default: --model)")
    p.add_argument("--out", default="runs/eval", help="directory for results.jsonl and summary.json")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted evaluation in --out: its finished problems are not played again",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the evaluation in --out (results.jsonl, summary.json, episodes.jsonl, run.json) first",
    )
    p.add_argument(
        "--save-episodes",
        action="store_true",
        help="also write episodes.jsonl to --out: each episode's text, turn by turn, with tool calls and output",
    )
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. env.max_turns=8 env.eval_kwargs.max_turns=8"
    )
    p.set_defaults(func=_eval)

    p = sub.add_parser("sft", help="cold-start SFT on ReTool-format traces (model-written tokens only)")
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/quickstart.yaml")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier SFT in trainer.run_dir (sft_config.yaml, sft_log.jsonl, its model) first",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.epochs=3 sft.data=traces.jsonl")
    p.set_defaults(func=_sft)

    p = sub.add_parser(
        "train",
        help="RL training with GRPO-ds or STARE (>1 rank: deepspeed --num_gpus N --module "
        "stare_agent.cli train ..., or torchrun --nproc_per_node N -m stare_agent.cli train ...)",
        description="RL training with GRPO-ds or STARE: the defaults (the paper's settings), then --config, "
        "then the dotted overrides. The run directory gets config.yaml, metrics.jsonl, tensorboard/ and "
        "checkpoints/step-N/{hf,learner}. More than one rank: deepspeed --num_gpus N --module stare_agent.cli "
        "train ..., or torchrun --nproc_per_node N -m stare_agent.cli train ...",
        fields=TRAIN_FIELDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML config, e.g. configs/quickstart.yaml")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in trainer.run_dir from its last complete checkpoint (the directory must exist)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in trainer.run_dir (config.yaml, metrics.jsonl, run.json, checkpoints/, rollouts/, plots/) first",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. algorithm.W=1.2 trainer.steps=10",
    )
    p.set_defaults(func=_train)

    p = sub.add_parser("plot", help="draw the training dynamics of one run, or several overlaid, as one PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument(
        "--out",
        default=None,
        help="PNG to write (default RUN_DIR/plots/dashboard.png; several runs: dashboard.png in their common parent)",
    )
    p.add_argument("--labels", nargs="+", default=None, help="legend names, one per RUN_DIR")
    p.set_defaults(func=_plot)

    p = sub.add_parser("quickstart", help="the main job: baseline eval, cold-start SFT, STARE RL, eval again")
    p.add_argument("--config", default=None, help="default: configs/quickstart.yaml")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier quickstart's results in trainer.run_dir first (make quickstart ARGS=--overwrite)",
    )
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=5 sandbox.backend=local"
    )
    p.set_defaults(func=_quickstart)

    p = sub.add_parser(
        "paper-run",
        help="the paper's tool-use run on one 8-GPU node: cold-start SFT of Qwen2.5-7B, then the RL arms",
        description="The paper's tool-use run on one node (docs/scaling.md): cold-start SFT of Qwen2.5-7B "
        "on ReTool's traces, then STARE-O1 (and the other arms asked for) for 2,000 steps at 64 prompts x 8 "
        "samples, each under torchrun on this node's GPUs. Earlier results in --runs are refused unless "
        "--resume or --overwrite says what to do with them.",
    )
    arms = f"any of {', '.join(PAPER_ARMS)}, run in the order given (default stare-o1)"
    p.add_argument("--arms", nargs="+", default=["stare-o1"], metavar="ARM", help=arms)
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs of this node to use (default 8)")
    p.add_argument(
        "--placement",
        choices=PAPER_PLACEMENTS,
        default="colocated",
        help="colocated: an engine on each learner GPU, asleep during the update; separate: half the "
        "GPUs learn, half generate (docs/engines.md, Placement)",
    )
    p.add_argument("--runs", default="runs", help="directory of the SFT's and the arms' run directories")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep a finished SFT, continue each run from its last checkpoint, skip finished runs",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="delete the earlier SFT's and runs' results first"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    p.add_argument(
        "--sft-set", action="append", default=[], metavar="KEY=VALUE", help="an override of the SFT config"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override of every arm's config"
    )
    p.set_defaults(func=_paper_run)

    _add_plugin_commands(sub)
    return parser


def _add_doctor(sub: Any) -> None:
    """`stare-agent doctor tokens`."""
    doctor = sub.add_parser("doctor", help="qualify a model's tokenizer and chat template before a long run")
    doctor_sub = doctor.add_subparsers(dest="doctor_command", required=True, parser_class=_Parser)
    p = doctor_sub.add_parser(
        "tokens",
        help="play the token-exactness cases (docs/tokens.md) with a tokenizer; one row a case",
        description="Plays scripted tool episodes through the rollout runner with the model's tokenizer and "
        "chat template and checks that the trajectory is exactly what the engine was given and produced, "
        "that tool output stays text and that the reward reads only the model's words. Exit 1 when a case "
        "is not exact.",
    )
    p.add_argument(
        "--model", required=True, help="a model directory or id (its tokenizer is all that is read)"
    )
    p.add_argument("--formats", nargs="+", default=["retool", "hermes"], help="tool-call formats to play")
    p.set_defaults(func=_doctor_tokens)


COMMANDS_GROUP = "stare_agent.commands"
"""Entry points that add subcommands: each names a function ``add(subparsers)`` that adds its parser(s)
(``parser_class`` is :class:`_Parser`) with ``set_defaults(func=...)``. The research floor's ``study``
and ``replay`` come in this way, so the product never imports it."""


def _add_plugin_commands(sub: Any) -> None:
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            add = entry.load()
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the CLI
            print(f"warning: stare-agent {entry.name} is unavailable ({entry.value}: {exc})", file=sys.stderr)
            continue
        add(sub)


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message already names the cause and the fix, shown as one line: the error root
    of each package (none of them needs torch, so a broken torch install cannot hide the error)."""
    from stare_agent.errors import StareError
    from stare_envs.errors import EnvError
    from stare_sandbox.errors import SandboxError

    return (SandboxError, EnvError, StareError, FileNotFoundError)


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` came from a Ctrl-C: a ``KeyboardInterrupt`` in its chain, or a subprocess the
    terminal's SIGINT stopped that a library reports in its own words (DeepSpeed's op build through
    ninja: "build stopped: interrupted by user")."""
    return any(isinstance(e, KeyboardInterrupt) or "interrupted by user" in str(e) for e in _chain(exc))


def _disk_full(exc: BaseException) -> str | None:
    """What failed, in a few words, when ``exc`` (or an exception it came from) is a full disk or
    quota: an ``OSError`` with ENOSPC or EDQUOT, or a library's error that wraps one in its message
    (safetensors: "No space left on device (os error 28)"); else None."""
    for current in _chain(exc):
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"writing {current.filename}" if current.filename else str(current.strerror)
        if any(words in str(current) for words in ("No space left on device", "Disk quota exceeded")):
            return f"{type(current).__name__}: {str(current).splitlines()[0][:200]}"
    return None


UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST)


def _unwritable(exc: BaseException) -> str | None:
    """``cannot write PATH (why)`` when ``exc`` (or one it came from) is a file the command could not
    create or write: no permission, a read-only file system, a file where a directory belongs; else None."""
    for current in _chain(exc):
        if isinstance(current, OSError) and current.errno in UNWRITABLE and current.filename:
            return f"cannot write {current.filename} ({current.strerror})"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


# Left out of the slim install (`pip install stare-agent`: sandbox and envs only).
TRAIN_PACKAGES = frozenset({"torch", "transformers", "accelerate", "deepspeed", "omegaconf", "matplotlib"})


def _again(args: argparse.Namespace) -> str:
    """How the command goes on after it stopped halfway: ``--resume`` where it has one (what it wrote
    is kept), else ``--overwrite`` where its half-written results would refuse a rerun."""
    if hasattr(args, "resume"):
        return "run the same command with --resume (what it finished is kept)"
    if hasattr(args, "overwrite"):
        return "run the same command with --overwrite (it starts over: a rerun into its directory is refused)"
    return "run the same command again"


def _stopped_line(args: argparse.Namespace) -> str:
    """The line a Ctrl-C ends with: where a rerun would be refused, how to start over."""
    return (
        "interrupted"
        if hasattr(args, "resume") or not hasattr(args, "overwrite")
        else f"interrupted: {_again(args)}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(_stopped_line(args), file=sys.stderr)
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
        if _interrupted(
            exc
        ):  # Ctrl-C that a library turned into its own error (a build's "interrupted by user")
            print(_stopped_line(args), file=sys.stderr)
            return 130
        unwritable = _unwritable(exc)
        if unwritable is not None:
            print(
                f"error: {unwritable}: pick a place you can write (--out, trainer.run_dir)", file=sys.stderr
            )
            return 2
        full = _disk_full(exc)
        if full is None:
            raise
        # what was written before stays (results and checkpoints are written whole or not at all), so
        # the way on is space, then the same command (with --resume, or --overwrite where it has none)
        print(
            f"error: no space left on the device ({full}): free space (or lower trainer.keep_checkpoints), "
            f"then {_again(args)}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
