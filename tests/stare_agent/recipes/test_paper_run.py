"""The paper run's launcher (`stare-agent paper-run`, stare_agent.recipes.paper_run, and its wrapper
scripts/launch_paper_run.sh) on a CPU: the commands its dry run prints load through the project's config
loader with the paper's settings, earlier runs are refused unless resumed or overwritten, and bad input
or a machine without the GPUs gets the CLI's one line of error. Nothing here starts a GPU process: the
8-GPU run itself is not tested here."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from stare_agent import cli
from stare_agent.config import ConfigError, RunConfig, load_config
from stare_agent.recipes import paper_run
from stare_agent.recipes.paper_run import LaunchError, Step, check_gpus, continue_command, launch, plan

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "launch_paper_run.sh"


def _script(*args: str, **environ: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PYTHON": sys.executable, **environ},
    )


def main(argv: list[str]) -> int:
    """``stare-agent paper-run ARGV`` through the CLI's own entry (its parser and its error handling)."""
    return cli.main(["paper-run", *argv])


def _loaded(line: str) -> tuple[list[str], RunConfig]:
    """A printed command: its torchrun part, checked, then the config it names loaded as the CLI
    would load it (the CLI's own parser reads the arguments after ``-m stare_agent.cli``)."""
    argv = shlex.split(line)
    module = argv.index("stare_agent.cli")
    assert Path(argv[0]).name == "torchrun" and argv[1:module] == [
        "--standalone",
        "--nproc_per_node",
        argv[3],
        "-m",
    ]
    args = cli.build_parser().parse_args(argv[module + 1 :])
    return argv, load_config(args.config, args.overrides)


def test_the_dry_run_prints_commands_whose_configs_load_with_the_overrides_it_passes(tmp_path):
    runs = tmp_path / "runs"
    done = _script("--dry-run", "--arms", "stare-o1", "grpo-ds", "stare-c2", "--runs", str(runs))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and not runs.exists()  # a dry run writes nothing
    commands = [shlex.split(line)[shlex.split(line).index("stare_agent.cli") + 1] for line in lines]
    assert commands == ["sft", "train", "train", "train"]

    argv, sft = _loaded(lines[0])
    assert argv[3] == "8" and sft.trainer.run_dir == str(runs / "sft_retool_qwen2.5_7b")
    model = str(runs / "sft_retool_qwen2.5_7b" / "sft_model")  # where the SFT exports its model
    for line, arm in zip(lines[1:], ("stare_o1", "grpo_ds", "stare_c2"), strict=True):
        argv, config = _loaded(line)
        assert argv[3] == "8"  # colocated: one learner rank and its engine on each of the 8 GPUs
        assert config.model.name_or_path == model
        assert config.trainer.run_dir == str(runs / f"{arm}_retool_qwen2.5_7b")
        placement = config.env.placement
        assert (placement.mode, placement.memory_fraction, placement.sleep_between_steps) == (
            "colocated",
            0.5,
            True,
        )
        assert config.sandbox.pool_size == 64  # 64 x 8 episodes over 8 ranks: one sandbox each


def test_separate_engines_take_half_the_gpus_and_the_overrides_come_last(capsys, tmp_path):
    code = main(
        ["--dry-run", "--placement", "separate", "--runs", str(tmp_path), "--set", "trainer.seed=3"]
        + ["--sft-set", "sft.epochs=2"]
    )
    assert code == 0
    sft_line, rl_line = capsys.readouterr().out.splitlines()
    assert _loaded(sft_line)[1].sft.epochs == 2
    argv, config = _loaded(rl_line)
    assert argv[3] == "4"  # learner ranks on GPUs 0-3, their engines on 4-7 (docs/engines.md)
    assert (config.env.placement.mode, config.env.placement.engine_gpus) == ("separate", [4, 5, 6, 7])
    assert config.sandbox.pool_size == 128  # each of the 4 ranks plays 64 x 8 / 4 episodes at once
    assert config.trainer.seed == 3


def test_the_recipe_is_the_papers_tool_use_setting(capsys, tmp_path):
    """The paper's values (arXiv 2606.19236, as docs/paper-settings.md maps them), written out by hand:
    Qwen2.5-7B after ReTool's cold start, 64 prompts x 8 samples, ~2,000 steps, W 1.1, H_tgt 0.3."""
    assert main(["--dry-run", "--arms", "stare-o1", "grpo-ds", "stare-c2", "--runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    sft = _loaded(lines[0])[1]
    assert (sft.model.name_or_path, sft.sft.data, sft.sft.format) == (
        "Qwen/Qwen2.5-7B",
        "JoeYing/ReTool-SFT",
        "retool",
    )
    arms = {c.algorithm.name + (c.algorithm.variant if c.algorithm.name == "stare" else ""): c for c in (
        _loaded(line)[1] for line in lines[1:]
    )}  # fmt: skip
    assert sorted(arms) == ["grpo_ds", "stareC2", "stareO1"]
    for config in arms.values():
        data, env, alg, optim = config.data, config.env, config.algorithm, config.optim
        assert (data.prompts_per_step, data.samples_per_prompt) == (64, 8)
        assert (data.dynamic_sampling, data.max_sampling_batches) == (True, 10)
        assert data.train == "BytedTsinghua-SIA/DAPO-Math-17k"
        assert (data.eval, data.eval_samples) == ("aime2024", 32)  # AIME avg@32
        assert config.trainer.steps == 2000
        assert (env.format, env.max_turns, env.max_response_tokens) == ("retool", 16, 16384)
        assert (env.temperature, env.top_p) == (1.0, 1.0)
        assert (alg.eps_low, alg.eps_high, alg.clip_c, alg.loss_agg) == (0.2, 0.28, 10.0, "token-mean")
        assert (alg.ppo_epochs, alg.ppo_mini_batch_size) == (1, None)  # one optimizer step per batch
        assert (optim.lr, optim.grad_clip) == (1e-6, 1.0)
        assert config.trainer.max_staleness == 0  # synchronous, as the paper
    for name in ("stareO1", "stareC2"):
        alg = arms[name].algorithm
        assert (alg.P, alg.W, alg.H_tgt, alg.gate, alg.adaptive) == (0.1, 1.1, 0.3, "entropy", False)
    assert arms["stareC2"].algorithm.M == 0.9


def _finished_sft(runs: Path) -> None:
    model = runs / "sft_retool_qwen2.5_7b" / "sft_model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (runs / "sft_retool_qwen2.5_7b" / "sft_log.jsonl").write_text('{"step": 1}\n')


def _run(runs: Path, arm: str, checkpoint: int) -> None:
    run = runs / f"{arm}_retool_qwen2.5_7b"
    (run / "checkpoints" / f"step-{checkpoint:06d}").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {n}}}\n' for n in range(1, checkpoint + 3)))


def test_earlier_runs_are_refused_unless_resumed_or_overwritten(tmp_path):
    runs = tmp_path / "runs"
    _finished_sft(runs)
    _run(runs, "stare_o1", 50)
    _run(runs, "grpo_ds", 2000)
    arms = ["stare-o1", "grpo-ds", "stare-c2"]
    with pytest.raises(ConfigError) as refused:
        plan(arms, runs=runs)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("earlier results: ")
    assert f"{runs}/sft_retool_qwen2.5_7b holds a finished SFT" in message
    assert (
        f"{runs}/stare_o1_retool_qwen2.5_7b holds a run (steps logged up to 52, a checkpoint of step 50)"
        in message
    )
    assert message.endswith(
        "continue them with --resume, pick another --runs, or pass --overwrite to delete them first"
    )

    resumed = {s.name: s for s in plan(arms, runs=runs, resume=True)}
    assert resumed["sft"].skip and "holds the finished SFT model" in resumed["sft"].skip
    assert resumed["stare-o1"].flags == ("--resume",) and resumed["stare-o1"].skip is None
    assert resumed["grpo-ds"].skip == f"{runs}/grpo_ds_retool_qwen2.5_7b finished at step 2000"
    assert resumed["stare-c2"].flags == () and resumed["stare-c2"].skip is None  # nothing there yet

    overwritten = plan(arms, runs=runs, overwrite=True)
    assert [s.flags for s in overwritten] == [("--overwrite",)] * 3 + [()]
    with pytest.raises(ConfigError, match="--resume continues the runs and --overwrite deletes them"):
        plan(arms, runs=runs, resume=True, overwrite=True)


def test_an_sft_that_did_not_finish_is_not_resumed(tmp_path):
    (tmp_path / "sft_retool_qwen2.5_7b").mkdir()
    (tmp_path / "sft_retool_qwen2.5_7b" / "sft_log.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(
        ConfigError, match="holds an SFT that did not finish .* it cannot resume: --overwrite"
    ):
        plan(runs=tmp_path, resume=True)
    assert plan(runs=tmp_path, overwrite=True)[0].flags == ("--overwrite",)


def test_bad_arms_and_overrides_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="--arms stare-o3: name one or more of stare-o1, grpo-ds, stare-c2"):
        plan(["stare-o3"], runs=tmp_path)
    with pytest.raises(ConfigError, match="unknown config key 'algorithm.Wx'"):
        plan(runs=tmp_path, rl_overrides=["algorithm.Wx=1"])
    with pytest.raises(ConfigError, match="--gpus 3 must be even"):
        plan(runs=tmp_path, gpus=3, placement="separate")
    with pytest.raises(ConfigError, match="grpo-ds and stare-o1 would both write trainer.run_dir=x: leave"):
        plan(["stare-o1", "grpo-ds"], runs=tmp_path, rl_overrides=["trainer.run_dir=x"])


def test_no_gpu_is_one_line_of_error_naming_the_way_on():
    done = _script(CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: no CUDA GPU visible (CUDA_VISIBLE_DEVICES=''): the paper run needs 8 GPUs on one node: run it "
        "on a node with NVIDIA GPUs and a CUDA build of torch, or print its commands with --dry-run"
    ]
    assert done.stdout == ""


def test_too_few_gpus_is_one_line_of_error_and_enough_pass(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(LaunchError) as few:
        check_gpus(8, visible=2)
    assert str(few.value) == (
        "2 CUDA GPU(s) visible and the paper run asks for 8: run it on an 8-GPU node, pass --gpus 2 to launch "
        "on fewer (the same 64 x 8 batch, more memory and time per GPU), or print its commands with --dry-run"
    )
    assert check_gpus(8, visible=8) == 8


def test_the_subcommand_refuses_earlier_results_and_bad_input_in_the_clis_one_line(capsys, tmp_path):
    """`stare-agent paper-run` errors are the CLI's: exit code 2, one line of cause and fix on stderr,
    nothing on stdout (the launcher's own argparse entry once printed them its own way)."""
    _run(tmp_path, "stare_o1", 50)
    cases = [
        (["--dry-run", "--runs", str(tmp_path)], f"error: earlier results: {tmp_path}/stare_o1_retool"),
        (["--dry-run", "--arms", "stare-o3"], "error: --arms stare-o3: name one or more of stare-o1, "),
        (["--dry-run", "--resume", "--overwrite"], "error: --resume continues the runs and --overwrite"),
        (["--placement", "sideways"], "error: stare-agent paper-run: argument --placement: invalid choice"),
        (["--gpus", "0"], "error: stare-agent paper-run: argument --gpus: 0 must be >= 1"),
    ]
    for argv, expected in cases:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors, through the CLI's parser
            code = exit_.code
        out, err = capsys.readouterr()
        assert code == 2 and out == "", argv
        assert len(err.splitlines()) == 1 and err.startswith(expected), err
    assert main(["--dry-run", "--runs", str(tmp_path), "--resume"]) == 0
    _, rl_line = capsys.readouterr().out.splitlines()  # the run of step 50 is continued
    argv = shlex.split(rl_line)
    assert argv[argv.index("--config") + 2] == "--resume"


def test_the_clis_arms_and_placements_are_the_recipes():
    """The parser is built without the config loader (the slim install), so it names them itself."""
    assert cli.PAPER_ARMS == tuple(paper_run.ARMS)
    assert cli.PAPER_PLACEMENTS == paper_run.PLACEMENTS
    assert cli.build_parser().parse_args(["paper-run"]).gpus == paper_run.GPUS
    assert "paper-run" in cli.build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001


def test_the_old_module_entry_points_to_the_subcommand():
    done = subprocess.run(
        [sys.executable, "-m", "stare_agent.recipes.paper_run", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: python -m stare_agent.recipes.paper_run is now a subcommand: run `stare-agent paper-run` "
        "(or `python -m stare_agent.cli paper-run`) with the same options"
    ]


def test_a_failed_launch_names_the_subcommand_that_continues_it(monkeypatch, tmp_path):
    assert continue_command() == "stare-agent paper-run"
    assert continue_command(
        ["grpo-ds"], gpus=4, placement="separate", runs=tmp_path / "r x", sft_overrides=["sft.epochs=2"]
    ) == shlex.join(
        ["stare-agent", "paper-run", "--arms", "grpo-ds", "--gpus", "4", "--placement", "separate"]
        + ["--runs", str(tmp_path / "r x"), "--sft-set", "sft.epochs=2"]
    )
    hints: list[str] = []
    monkeypatch.setattr(paper_run, "check_gpus", lambda needed: needed)
    monkeypatch.setattr(paper_run, "launch", lambda steps, *, resume_hint: hints.append(resume_hint) or 0)
    assert main(["--runs", str(tmp_path), "--set", "trainer.seed=3"]) == 0
    assert hints == [f"stare-agent paper-run --runs {tmp_path} --set trainer.seed=3"]


def test_the_steps_run_in_order_and_the_first_failure_stops_the_launch(tmp_path, capsys, monkeypatch):
    """A stand-in for torchrun records each command line and fails the one named in FAIL."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(
        "import os, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "sys.exit(3 if os.environ.get('FAIL', '') in sys.argv else 0)\n"
    )
    steps = [
        Step("sft", "sft", Path("configs/a.yaml"), ("x=1",), skip="finished"),
        Step("stare-o1", "train", Path("configs/b.yaml"), ("y=2",), flags=("--resume",), nproc=4),
        Step("grpo-ds", "train", Path("configs/c.yaml"), ()),
    ]
    monkeypatch.setenv("FAIL", "configs/c.yaml")
    with pytest.raises(LaunchError) as failed:
        launch(steps, [sys.executable, str(fake)], resume_hint="stare-agent paper-run")
    assert log.read_text().splitlines() == [
        "--standalone --nproc_per_node 4 -m stare_agent.cli train --config configs/b.yaml --resume y=2",
        "--standalone --nproc_per_node 8 -m stare_agent.cli train --config configs/c.yaml",
    ]
    assert str(failed.value) == (
        "grpo-ds (train) exited with status 3: fix the cause printed above, then continue with "
        "stare-agent paper-run --resume"
    )
    out = capsys.readouterr().out
    assert "[sft] skipped: finished" in out and "[stare-o1] done" in out
