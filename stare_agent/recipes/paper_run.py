"""The paper's headline run on one 8-GPU node, in one command: cold-start SFT, then RL.

``stare-agent paper-run`` (``bash scripts/launch_paper_run.sh`` wraps it) runs, one after the other:

1. ``stare-agent sft --config configs/sft_retool_qwen2.5_7b.yaml``: Qwen2.5-7B (base) on ReTool's
   2,000 cold-start traces;
2. ``stare-agent train --config configs/<arm>_retool_qwen2.5_7b.yaml`` for each arm asked for
   (``--arms``; default STARE-O1, with GRPO-ds and STARE-C2 as the paper's other arms), from the SFT
   model, at the paper's settings: 64 prompts x 8 samples, dynamic sampling, 2,000 steps, W 1.1,
   H_tgt 0.3, lr 1e-6 (``tests/stare_agent/test_paper_configs.py`` checks them against the paper).

Each under ``torchrun --standalone --nproc_per_node N -m stare_agent.cli``, the launch
``docs/scaling.md`` gives (DeepSpeed's own launcher narrows ``CUDA_VISIBLE_DEVICES`` to its ranks'
GPUs, which would hide the engine GPUs of ``--placement separate``). The rollout engines are placed as
the worked layouts of docs/engines.md ("Placement"): ``colocated``, 8 learner ranks each sharing its
GPU with an SGLang engine at half its memory, asleep during the update; ``separate``, 4 learner ranks
on GPUs 0-3 and their engines on GPUs 4-7, weights over NCCL.

Runs go to ``--runs`` (``runs/``): ``sft_retool_qwen2.5_7b/`` (the model in ``sft_model/``) and one
directory per arm, checkpointed every 50 steps (``trainer.checkpoint_every``). Nothing is written over
unasked: a directory holding an earlier SFT or run is refused before anything starts, naming
``--resume`` (keep a finished SFT, continue each run from its last checkpoint, skip finished ones)
and ``--overwrite`` (the commands delete their own earlier results first). ``--dry-run`` prints the
commands and runs nothing; without it fewer CUDA GPUs than ``--gpus`` is one line of error.

Example:
    >>> steps = plan(["stare-o1"], runs="/tmp/never-written")
    >>> [(s.name, s.command, s.nproc) for s in steps]
    [('sft', 'sft', 8), ('stare-o1', 'train', 8)]
    >>> [o for o in steps[1].overrides if o.startswith("env.placement")]
    ['env.placement.mode=colocated', 'env.placement.memory_fraction=0.5', 'env.placement.sleep_between_steps=true']
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stare_agent import run_dirs
from stare_agent.config import ConfigError, RunConfig, load_config
from stare_agent.errors import StareError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SFT_CONFIG = "sft_retool_qwen2.5_7b.yaml"
ARMS = {
    "stare-o1": "stare_o1_retool_qwen2.5_7b.yaml",
    "grpo-ds": "grpo_ds_retool_qwen2.5_7b.yaml",
    "stare-c2": "stare_c2_retool_qwen2.5_7b.yaml",
}
"""The paper's tool-use arms and their configs (the paper's Table: GRPO-ds, STARE-O1, STARE-C2)."""
GPUS = 8
PLACEMENTS = ("colocated", "separate")
COLOCATED_MEMORY_FRACTION = 0.5
"""docs/engines.md's 8 x 80 GB layout: the engine (15 GB of bf16 weights and its KV cache) takes half."""


class LaunchError(StareError, RuntimeError):
    """This machine cannot run the launch as asked (too few GPUs, a step that failed). One line."""


@dataclass(frozen=True)
class Step:
    """One command of the launch.

    Attributes:
        name: ``sft`` or the arm (``stare-o1``, ...).
        command: The ``stare-agent`` subcommand: ``sft`` or ``train``.
        config: The YAML config it reads.
        overrides: Dotted overrides after the config (the launcher's, then the user's).
        flags: ``--resume`` or ``--overwrite``, when asked for and needed.
        nproc: Learner ranks on this node (``torchrun --nproc_per_node``).
        skip: Why the step is not run (finished already, under ``--resume``), or None.
    """

    name: str
    command: str
    config: Path
    overrides: tuple[str, ...]
    flags: tuple[str, ...] = ()
    nproc: int = GPUS
    skip: str | None = None

    def argv(self, launcher: Sequence[str] = ()) -> list[str]:
        """The command line: ``launcher`` (default: this interpreter's ``torchrun``) on this node."""
        return [
            *(launcher or torchrun()),
            "--standalone",
            "--nproc_per_node",
            str(self.nproc),
            "-m",
            "stare_agent.cli",
            self.command,
            "--config",
            _shown(self.config),
            *self.flags,
            *self.overrides,
        ]


def torchrun() -> list[str]:
    """The ``torchrun`` beside this interpreter (a virtualenv's), else the one on ``PATH``."""
    beside = Path(sys.executable).with_name("torchrun")
    return [str(beside) if beside.is_file() else "torchrun"]


def placement_overrides(placement: str, gpus: int) -> tuple[int, tuple[str, ...]]:
    """Learner ranks and ``env.placement`` overrides for ``gpus`` GPUs of one node.

    >>> placement_overrides("separate", 8)
    (4, ('env.placement.mode=separate', 'env.placement.engine_gpus=[4,5,6,7]'))
    """
    if placement == "colocated":
        return gpus, (
            "env.placement.mode=colocated",
            f"env.placement.memory_fraction={COLOCATED_MEMORY_FRACTION}",
            "env.placement.sleep_between_steps=true",
        )
    if placement == "separate":
        if gpus < 2 or gpus % 2:
            raise ConfigError(
                f"--placement separate splits the GPUs in two halves (learners, engines): --gpus {gpus} "
                "must be even, e.g. 8, or use --placement colocated"
            )
        ranks = gpus // 2
        engines = ",".join(str(g) for g in range(ranks, gpus))
        return ranks, ("env.placement.mode=separate", f"env.placement.engine_gpus=[{engines}]")
    raise ConfigError(f"--placement {placement!r} is not valid: use one of {', '.join(PLACEMENTS)}")


def plan(
    arms: Sequence[str] = ("stare-o1",),
    *,
    gpus: int = GPUS,
    placement: str = "colocated",
    runs: str | os.PathLike[str] = "runs",
    resume: bool = False,
    overwrite: bool = False,
    sft_overrides: Sequence[str] = (),
    rl_overrides: Sequence[str] = (),
) -> list[Step]:
    """The launch's commands, each config loaded and validated with its overrides, and each run
    directory checked: an earlier SFT or run is refused unless ``resume`` or ``overwrite`` says what
    to do with it. Nothing is written.

    Raises:
        ConfigError: an unknown arm or placement, a config its overrides break, ``resume`` with
            ``overwrite``, or run directories holding earlier results (all named, in one line).
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the runs and --overwrite deletes them: pass one of them")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ConfigError(f"--arms {' '.join(unknown)}: name one or more of {', '.join(ARMS)}")
    if len(set(arms)) != len(arms):
        raise ConfigError(f"--arms {' '.join(arms)} names an arm twice: name each once")
    nproc, placed = placement_overrides(placement, gpus)
    runs = Path(runs)
    sft_given = (f"trainer.run_dir={runs / Path(SFT_CONFIG).stem}", *sft_overrides)
    sft_config = _load(SFT_CONFIG, sft_given)
    sft_dir = Path(sft_config.trainer.run_dir)  # the user's override, if any, wins
    model = Path(sft_config.sft.output_dir) if sft_config.sft.output_dir else sft_dir / "sft_model"
    taken: list[str] = []  # earlier results no flag said what to do with
    steps = [_sft_step(sft_given, sft_dir, model, gpus, resume, overwrite, taken)]
    for arm in arms:
        given = _load(ARMS[arm], rl_overrides)
        name = Path(_load(ARMS[arm], ()).trainer.run_dir).name
        overrides = (
            f"model.name_or_path={model}",
            f"trainer.run_dir={runs / name}",
            *placed,
            *_pool_override(given, nproc),
            *rl_overrides,
        )
        config = _load(ARMS[arm], overrides)
        shared = [s.name for s in steps if _run_dir(s) == config.trainer.run_dir]
        if shared:
            raise ConfigError(
                f"{arm} and {shared[0]} would both write trainer.run_dir={config.trainer.run_dir}: leave "
                "trainer.run_dir out of --set (each arm gets a directory of its own under --runs)"
            )
        steps.append(_train_step(arm, config, overrides, nproc, resume, overwrite, taken))
    if taken:
        raise ConfigError(
            f"earlier results: {'; '.join(taken)}: continue them with --resume, pick another --runs, "
            "or pass --overwrite to delete them first"
        )
    return steps


def _run_dir(step: Step) -> str | None:
    """The last ``trainer.run_dir=`` override of a step: the directory it writes."""
    given = [o.partition("=")[2] for o in step.overrides if o.startswith("trainer.run_dir=")]
    return given[-1] if given else None


def _pool_override(config: RunConfig, nproc: int) -> tuple[str, ...]:
    """A sandbox for each episode a rank plays at once: the draw's episodes over the ranks (the
    configs' 64 is 64 x 8 / 8 ranks; 4 learner ranks play 128 each)."""
    episodes = config.data.prompts_per_step * config.data.samples_per_prompt
    pool = -(-episodes // nproc)
    return () if pool == config.sandbox.pool_size else (f"sandbox.pool_size={pool}",)


def _load(name: str, overrides: Sequence[str]) -> RunConfig:
    path = CONFIGS / name
    if not path.is_file():
        raise ConfigError(
            f"{path} not found: the paper's configs ship with the repository, run the launcher from a clone"
        )
    return load_config(path, list(overrides))


def _sft_step(
    overrides: tuple[str, ...],
    run_dir: Path,
    model: Path,
    gpus: int,
    resume: bool,
    overwrite: bool,
    taken: list[str],
) -> Step:
    step = Step("sft", "sft", CONFIGS / SFT_CONFIG, overrides, nproc=gpus)
    finished = (model / "config.json").is_file()  # the export is renamed into place whole
    started = run_dirs.present(run_dir, run_dirs.SFT_ARTIFACTS) or (model.is_dir() and any(model.iterdir()))
    if overwrite and (finished or started):
        return replace(step, flags=("--overwrite",))
    if finished and resume:
        return replace(step, skip=f"{model} holds the finished SFT model")
    if finished:
        taken.append(f"{run_dir} holds a finished SFT ({model}/)")
    elif started:
        taken.append(
            f"{run_dir} holds an SFT that did not finish (no {model}/config.json; SFT keeps no "
            "checkpoints, so it cannot resume: --overwrite runs it again)"
        )
    return step


def _train_step(
    arm: str,
    config: RunConfig,
    overrides: tuple[str, ...],
    nproc: int,
    resume: bool,
    overwrite: bool,
    taken: list[str],
) -> Step:
    run_dir = Path(config.trainer.run_dir)
    step = Step(arm, "train", CONFIGS / ARMS[arm], overrides, nproc=nproc)
    if not run_dirs.present(run_dir, run_dirs.RL_ARTIFACTS):
        return step
    if overwrite:
        return replace(step, flags=("--overwrite",))
    if resume:
        last = run_dirs.last_checkpoint_step(run_dir)
        if last is not None and last >= config.trainer.steps:
            return replace(step, skip=f"{run_dir} finished at step {last}")
        return replace(step, flags=("--resume",))
    taken.append(f"{run_dir} holds a run ({run_dirs.describe_run(run_dir)})")
    return step


def check_gpus(needed: int, visible: int | None = None) -> int:
    """The CUDA GPUs this process sees (``torch.cuda.device_count()`` unless ``visible`` is given).

    Raises:
        LaunchError: fewer than ``needed``, in one line with the way on.
    """
    if visible is None:
        import torch

        visible = torch.cuda.device_count()
    if visible >= needed:
        return visible
    narrowed = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={narrowed!r})" if narrowed is not None else ""
    if visible == 0:
        raise LaunchError(
            f"no CUDA GPU visible{where}: the paper run needs {needed} GPUs on one node: run it on a node "
            "with NVIDIA GPUs and a CUDA build of torch, or print its commands with --dry-run"
        )
    raise LaunchError(
        f"{visible} CUDA GPU(s) visible{where} and the paper run asks for {needed}: run it on an "
        f"{needed}-GPU node, pass --gpus {visible} to launch on fewer (the same 64 x 8 batch, more memory "
        "and time per GPU), or print its commands with --dry-run"
    )


def render(steps: Sequence[Step], launcher: Sequence[str] = ()) -> str:
    """The commands, shell-quoted, one a line; a skipped step is a ``#`` line saying why."""
    lines = []
    for step in steps:
        command = shlex.join(step.argv(launcher))
        lines.append(f"# {step.name}: skipped, {step.skip}" if step.skip else command)
    return "\n".join(lines) + "\n"


def launch(steps: Sequence[Step], launcher: Sequence[str] = (), *, resume_hint: str = "") -> int:
    """Run the steps in order, each to its end, and stop at the first that fails.

    Ctrl-C reaches the ranks from the terminal, as with torchrun typed by hand (the trainer stops at
    the step boundary with a checkpoint); this process waits for them instead of dying first, and a
    SIGTERM it gets is passed on to the step that runs.

    Raises:
        LaunchError: a step exited non-zero (its exit status, and the command that continues).
    """
    for step in steps:
        if step.skip:
            print(f"[{step.name}] skipped: {step.skip}", flush=True)
            continue
        argv = step.argv(launcher)
        print(f"[{step.name}] {shlex.join(argv)}", flush=True)
        code = _run(argv)
        if code:
            raise LaunchError(
                f"{step.name} ({step.command}) exited with status {code}: fix the cause printed above, then "
                f"continue with {resume_hint or 'the same command'} --resume"
            )
        print(f"[{step.name}] done", flush=True)
    return 0


def _run(argv: list[str]) -> int:
    """``argv`` to its end; SIGINT is the child's (from the terminal), SIGTERM is passed on."""
    child = subprocess.Popen(argv)  # before SIG_IGN below: an ignored signal stays ignored across exec

    def forward(signum: int, frame: Any) -> None:
        child.send_signal(signum)

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, forward)
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when under it (shorter commands), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run(
    arms: Sequence[str] = ("stare-o1",),
    *,
    gpus: int = GPUS,
    placement: str = "colocated",
    runs: str | os.PathLike[str] = "runs",
    resume: bool = False,
    overwrite: bool = False,
    dry_run: bool = False,
    sft_overrides: Sequence[str] = (),
    rl_overrides: Sequence[str] = (),
) -> int:
    """``stare-agent paper-run``: check this node's GPUs (not for a dry run), :func:`plan` the steps,
    then print them (``dry_run``) or :func:`launch` them. Returns the exit status (0).

    Raises:
        ConfigError: what :func:`plan` refuses.
        LaunchError: too few GPUs, or a step that failed (the command that continues is named).
    """
    if not dry_run:
        check_gpus(gpus)
    steps = plan(
        arms,
        gpus=gpus,
        placement=placement,
        runs=runs,
        resume=resume,
        overwrite=overwrite,
        sft_overrides=sft_overrides,
        rl_overrides=rl_overrides,
    )
    if dry_run:
        print(render(steps), end="")
        return 0
    again = continue_command(
        arms,
        gpus=gpus,
        placement=placement,
        runs=runs,
        sft_overrides=sft_overrides,
        rl_overrides=rl_overrides,
    )
    return launch(steps, resume_hint=again)


def continue_command(
    arms: Sequence[str] = ("stare-o1",),
    *,
    gpus: int = GPUS,
    placement: str = "colocated",
    runs: str | os.PathLike[str] = "runs",
    sft_overrides: Sequence[str] = (),
    rl_overrides: Sequence[str] = (),
) -> str:
    """The ``stare-agent paper-run`` command of these options (the ones not at their defaults), to
    which a failed launch's message adds ``--resume``.

    >>> continue_command(["stare-o1", "grpo-ds"], gpus=4, rl_overrides=["trainer.seed=3"])
    'stare-agent paper-run --arms stare-o1 grpo-ds --gpus 4 --set trainer.seed=3'
    """
    argv = ["stare-agent", "paper-run"]
    if list(arms) != ["stare-o1"]:
        argv += ["--arms", *arms]
    if gpus != GPUS:
        argv += ["--gpus", str(gpus)]
    if placement != "colocated":
        argv += ["--placement", placement]
    if str(runs) != "runs":
        argv += ["--runs", str(runs)]
    for override in sft_overrides:
        argv += ["--sft-set", override]
    for override in rl_overrides:
        argv += ["--set", override]
    return shlex.join(argv)


__all__ = [
    "ARMS",
    "LaunchError",
    "Step",
    "check_gpus",
    "continue_command",
    "launch",
    "placement_overrides",
    "plan",
    "run",
]


if __name__ == "__main__":  # the launcher's old entry: it runs as one subcommand of the CLI now
    print(
        "error: python -m stare_agent.recipes.paper_run is now a subcommand: run "
        "`stare-agent paper-run` (or `python -m stare_agent.cli paper-run`) with the same options",
        file=sys.stderr,
    )
    sys.exit(2)
