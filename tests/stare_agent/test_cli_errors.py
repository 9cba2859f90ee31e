"""Every error of every package reaches the user as one line of cause and fix (exit code 2), through
the one error root of its package; and the commands that messages point to exist."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stare_agent
import stare_envs
import stare_research
import stare_sandbox
from stare_agent import cli
from stare_agent.errors import StareError
from stare_envs.errors import EnvError
from stare_sandbox.errors import SandboxError

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = {"stare_agent.engines.sglang_engine"}  # imports sglang only when an engine is built
# Control flow inside the sandbox's kernel driver, never raised to a caller: not an error of the
# package's API (NotSent is the zmq.Again the driver's reconnect logic catches).
INTERNAL = {
    "stare_sandbox.kernel.MalformedMessage",
    "stare_sandbox.zmtp.DroppedMessage",
    "stare_sandbox.zmtp.NotSent",
}


def _import_all() -> None:
    """Import every module of the three packages, so that every error class is defined."""
    for package in (stare_sandbox, stare_envs, stare_agent, stare_research):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if module.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(module.name)
            except ImportError:
                if module.name not in OPTIONAL:
                    raise


def _subclasses(root: type) -> list[type]:
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


_import_all()
ERRORS = [
    cls
    for root in (SandboxError, EnvError, StareError)
    for cls in _subclasses(root)
    if cls.__module__.split(".")[0] in {"stare_sandbox", "stare_envs", "stare_agent", "stare_research"}
]


def test_each_package_has_one_error_root():
    """Every exception class defined by the packages derives from its package's root."""
    roots = {
        "stare_sandbox": SandboxError,
        "stare_envs": EnvError,
        "stare_agent": StareError,
        "stare_research": StareError,
    }
    for package in (stare_sandbox, stare_envs, stare_agent, stare_research):
        for module in list(importlib.sys.modules.values()):
            name = getattr(module, "__name__", "")
            if name.split(".")[0] != package.__name__:
                continue
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == name
                    and f"{name}.{value.__qualname__}" not in INTERNAL
                ):
                    assert issubclass(value, roots[package.__name__]), f"{name}.{value.__qualname__}"
    assert len(ERRORS) >= 20


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_is_one_line_of_cause_and_fix(monkeypatch, capsys, error):
    def fail(args):
        raise error("the cause: the fix")

    monkeypatch.setattr(cli, "_plot", fail)
    assert cli.main(["plot", "some-run"]) == 2
    assert capsys.readouterr().err == "error: the cause: the fix\n"


def test_messages_name_only_commands_that_exist():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    sandbox_commands = commands["sandbox"]._subparsers._group_actions[0].choices  # noqa: SLF001
    named = set()
    for path in [*ROOT.glob("sandbox/*.py"), *ROOT.glob("envs/*.py"), *ROOT.glob("stare_agent/**/*.py")]:
        named |= {(m[0], m[1]) for m in re.findall(r"stare-agent (\w[\w-]*)(?: (\w+))?", path.read_text())}
    assert ("sandbox", "doctor") in named
    for command, sub in named:
        assert command in commands, f"stare-agent {command}"
        if command == "sandbox" and sub:
            assert sub in sandbox_commands, f"stare-agent sandbox {sub} does not exist"


# ---------------------------------------------------------------- the command line, flag by flag

CONSOLE_SCRIPT = Path(sys.executable).with_name("stare-agent")  # the installed entry point
EXAMPLES = ROOT / "examples"


class _NoModelLoads:
    """Stands in for transformers' loaders: every case below must stop before a model loads."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError(f"a model loaded before the error: from_pretrained{args}")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.yaml").write_text("trainer:\n  steps: 3\n   bad: [1\n")
    (tmp_path / "list.yaml").write_text("- trainer\n")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "run_without_rollouts").mkdir()
    (tmp_path / "run_without_rollouts" / "config.yaml").write_text("trainer:\n  save_rollouts: false\n")
    # a finished run of 3 steps, an SFT, an evaluation and a quickstart: none may be written over unasked
    (tmp_path / "finished" / "checkpoints" / "step-000003").mkdir(parents=True)
    (tmp_path / "finished" / "checkpoints" / "step-000003" / "state.json").write_text("{}")
    (tmp_path / "finished" / "metrics.jsonl").write_text("".join(f'{{"step": {n}}}\n' for n in (1, 2, 3)))
    (tmp_path / "plottable").mkdir()
    (tmp_path / "plottable" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "entropy": 0.3}\n')
    (tmp_path / "sfted").mkdir()
    (tmp_path / "sfted" / "sft_log.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "evaluated").mkdir()
    (tmp_path / "evaluated" / "results.jsonl").write_text('{"problem_id": "p1"}\n')
    (tmp_path / "quickstarted").mkdir()
    (tmp_path / "quickstarted" / "quickstart.json").write_text("{}")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "notes.txt").write_text("x")
    (tmp_path / "run_empty_metrics").mkdir()
    (tmp_path / "run_empty_metrics" / "metrics.jsonl").write_text("")
    (tmp_path / "run_cut_metrics").mkdir()
    (tmp_path / "run_cut_metrics" / "metrics.jsonl").write_text(
        '{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew'
    )
    return tmp_path


# (argv, a piece of the one line of cause and fix); {tmp} is the test's directory of files.
CASES = [
    # eval: problems
    (["eval"], "data.eval is not set: pass --data"),
    (["eval", "--data", "{tmp}/empty.jsonl"], "data.eval='{tmp}/empty.jsonl' holds no problems"),
    (["eval", "--data", "{tmp}/none.jsonl"], "no such file"),
    (["eval", "--data", "no-such-set"], "neither an existing file nor a hub name"),
    (["eval", "--data", ""], "--data is empty"),
    # eval: the model
    (
        ["eval", "--data", "aime2024", "--model", "./no_such_dir"],
        "model.name_or_path='./no_such_dir': no such directory",
    ),
    (["eval", "--data", "aime2024", "--model", "{tmp}/no_such_dir"], "no such directory ({tmp}/no_such_dir)"),
    (["eval", "--data", "aime2024", "--model", ""], "--model is empty"),
    (
        ["eval", "--data", "aime2024", "--model", "{tmp}/a_file"],
        "model.name_or_path='{tmp}/a_file' is a file ({tmp}/a_file): pass the model's directory",
    ),
    (["eval", "--data", "aime2024", "--model", "{tmp}/empty_dir"], "is an empty directory ({tmp}/empty_dir)"),
    (
        ["train", "trainer.run_dir={tmp}/r", "model.name_or_path={tmp}/not_a_model"],
        "model.name_or_path='{tmp}/not_a_model' holds no config.json",
    ),
    # eval: flags of the wrong type or out of range
    (["eval", "--samples", "x"], "argument --samples: invalid int value: 'x'"),
    (["eval", "--data", "aime2024", "--samples", "0"], "data.eval_samples=0 must be > 0"),
    (["eval", "--data", "aime2024", "--limit", "0"], "data.eval_limit=0 must be >= 1"),
    (["eval", "--data", "aime2024", "--limit", "-2"], "data.eval_limit=-2 must be >= 1"),
    (["eval", "--data", "aime2024", "--temperature", "-1"], "data.eval_temperature=-1.0 must be >= 0"),
    (["eval", "--data", "aime2024", "--temperature", "hot"], "argument --temperature: invalid float value"),
    (["eval", "--data", "aime2024", "--top-p", "2"], "data.eval_top_p=2.0 in (0, 1]"),
    (["eval", "--data", "aime2024", "--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["eval", "--data", "aime2024", "--max-turns", "0"], "env.max_turns=0 must be >= 1"),
    (["eval", "--data", "aime2024", "--max-response-tokens", "0"], "env.max_response_tokens=0 must be > 0"),
    (["eval", "--data", "aime2024", "--batch-size", "0"], "argument --batch-size: 0 must be >= 1"),
    (["eval", "--data", "aime2024", "--format", "xml"], "argument --format: invalid choice: 'xml'"),
    (["eval", "--data", "aime2024", "--backend", "k8s"], "argument --backend: invalid choice: 'k8s'"),
    (["eval", "--data", "aime2024", "--engine", "tgi"], "argument --engine: invalid choice: 'tgi'"),
    (["eval", "--data", "aime2024", "--engine", "openai"], "--engine openai needs --base-url"),
    (
        ["eval", "--data", "aime2024", "--engine", "openai", "--base-url", "localhost:8000"],
        "is not an http(s) URL",
    ),
    (
        [
            "eval",
            "--data",
            "aime2024",
            "--engine",
            "openai",
            "--base-url",
            "http://127.0.0.1:9/v1",
            "--tokenizer",
            "./nope",
        ],
        "model.name_or_path='./nope': no such directory",
    ),
    (["eval", "--data", "aime2024", "--device", "tpu"], "--device 'tpu' is not a torch device"),
    (["eval", "--data", "aime2024", "--device", "cuda:64"], "CUDA device(s) visible: use --device cpu"),
    (["eval", "--data", "aime2024", "--out", "{tmp}/a_file"], "is a file: pass a directory"),
    (
        ["eval", "--data", "aime2024", "--resume", "--out", "{tmp}/no_eval"],
        "--resume: {tmp}/no_eval/results.jsonl not found",
    ),
    (["eval", "--data", "aime2024", "--env", "nope/Nope-v0"], "is not a registered Gymnasium id"),
    (["eval", "--data", "aime2024", "--env", "no_such_module:demo/X-v0"], "no module named 'no_such_module'"),
    (["eval", "--data", "aime2024", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # config files and overrides (every command reads them alike)
    (["eval", "--data", "aime2024", "--config", "{tmp}/none.yaml"], "config file {tmp}/none.yaml not found"),
    (["eval", "--data", "aime2024", "--config", "{tmp}/bad.yaml"], "{tmp}/bad.yaml:3:7 is not valid YAML"),
    (["train", "--config", "{tmp}/list.yaml"], "holds a YAML list, not a mapping of sections"),
    (["eval", "--data", "aime2024", "env.nope=1"], "unknown config key 'env.nope'"),
    (["eval", "--data", "aime2024", "foo"], "override 'foo' is not key=value"),
    (["train", "trainer.steps=x"], "could not be converted to Integer; expected int"),
    # train
    (["train", "trainer.steps=0"], "trainer.steps=0 must be > 0"),
    (
        ["train", "--resume", "trainer.run_dir={tmp}/no_run"],
        "--resume: the run directory {tmp}/no_run does not exist",
    ),
    (["train", "data.train={tmp}/empty.jsonl"], "data.train='{tmp}/empty.jsonl' holds no problems"),
    (["train", "model.name_or_path=./no_such_dir"], "no such directory"),
    (["train", "env.engine=fast"], "env.engine='fast' is not valid"),
    (["train", "trainer.run_dir={tmp}/a_file"], "trainer.run_dir={tmp}/a_file is a file: pass a directory"),
    (
        ["train", "env.engine=vllm", "env.vllm.python={tmp}/no_python"],
        "the vLLM interpreter {tmp}/no_python does not exist",
    ),
    (["sft", "trainer.run_dir={tmp}/a_file"], "trainer.run_dir={tmp}/a_file is a file"),
    (["train", "trainer.run_dir={tmp}/a_file/run"], "trainer.run_dir={tmp}/a_file/run lies under a file"),
    # a run directory holding a result: refused, naming the ways on (nothing is deleted)
    (
        ["train", "trainer.run_dir={tmp}/finished"],
        "trainer.run_dir={tmp}/finished holds a run (steps logged up to 3, a checkpoint of step 3): continue it "
        "with --resume, pick another trainer.run_dir, or pass --overwrite to delete its metrics.jsonl, "
        "checkpoints/ first (in Python: Trainer(..., resume=True) or overwrite=True)",
    ),
    (
        ["train", "--resume", "trainer.run_dir={tmp}/finished", "trainer.steps=3"],
        "holds a run that finished at step 3 (trainer.steps=3): raise trainer.steps to train it further",
    ),
    (
        ["train", "--resume", "--overwrite", "trainer.run_dir={tmp}/finished"],
        "--resume (Trainer(resume=True)) continues the run in trainer.run_dir and --overwrite (overwrite=True) "
        "deletes it: pass one of them",
    ),
    (
        ["sft", "trainer.run_dir={tmp}/sfted"],
        "trainer.run_dir={tmp}/sfted holds an SFT ({tmp}/sfted/sft_log.jsonl)",
    ),
    (
        ["eval", "--data", "aime2024", "--backend", "local", "--out", "{tmp}/evaluated"],
        "--out {tmp}/evaluated holds an evaluation (results.jsonl): continue it with --resume, pick another --out",
    ),
    (
        ["quickstart", "trainer.run_dir={tmp}/quickstarted"],
        "holds an earlier quickstart's results (quickstart.json): pass --overwrite to delete them and run it again",
    ),
    # sft
    (["sft", "sft.data={tmp}/none.jsonl", "trainer.run_dir={tmp}/run"], "no such file"),
    (["sft", "sft.epochs=0"], "sft.epochs=0 must be > 0"),
    # plot
    (["plot"], "the following arguments are required: RUN_DIR"),
    (["plot", "{tmp}/no_run"], "metrics.jsonl not found"),
    (["plot", "{tmp}/run_empty_metrics"], "{tmp}/run_empty_metrics/metrics.jsonl holds no step"),
    (
        ["plot", "{tmp}/plottable", "--out", "{tmp}/a_file/plots/dash.png"],
        "cannot write {tmp}/a_file/plots (",
    ),
    (["plot", "{tmp}/finished"], "{tmp}/finished/metrics.jsonl logs none of the dashboard's metrics"),
    (["plot", "{tmp}/a", "{tmp}/b", "--labels", "one"], "--labels gives 1 names for 2 run directories"),
    # quickstart and study
    (["quickstart", "trainer.steps=0"], "trainer.steps=0 must be > 0"),
    (["replay", "--out", "{tmp}/r"], "the following arguments are required: --from"),
    (["replay", "--from", "{tmp}/no_run", "--out", "{tmp}/r"], "{tmp}/no_run/config.yaml not found"),
    (
        ["replay", "--from", "{tmp}/run_without_rollouts", "--out", "{tmp}/r"],
        "rerun it with trainer.save_rollouts=true",
    ),
    (
        ["replay", "--from", "{tmp}", "--out", "{tmp}/r", "env.max_turns=2"],
        "only learner settings can change",
    ),
    (["replay", "--from", "{tmp}", "--out", "{tmp}/r", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["quickstart", "--config", "{tmp}/none.yaml"], "not found"),
    (["study", "--seeds", "0"], "argument --seeds: 0 must be >= 1"),
    (["study", "--ablation-seeds", "x"], "argument --ablation-seeds: 'x' is not an integer"),
    (["study", "--variants", "nope", "trainer.run_dir={tmp}/study"], "unknown study variant 'nope'"),
    # sandbox and the top level
    (["sandbox"], "the following arguments are required: sandbox_command"),
    (["sandbox", "demo", "--backend", "x"], "argument --backend: invalid choice: 'x'"),
    (["sandbox", "build", "--tag", ""], "--tag '' is not a Docker image reference"),
    (["sandbox", "build", "--tag", "My Image"], "--tag 'My Image' is not a Docker image reference"),
    ([], "the following arguments are required: command"),
    (["nope"], "argument command: invalid choice: 'nope'"),
]


@pytest.mark.parametrize(
    ("argv", "expected"), CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_each_bad_input_is_one_line_before_any_model_loads(monkeypatch, capsys, files, argv, expected):
    """Every subcommand and flag, given a missing, empty, wrong-typed or out-of-range value: exit code 2
    and one line of cause and fix on stderr, no traceback, before anything loads a model."""
    from stare_agent import models

    for loader in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"):
        monkeypatch.setattr(models, loader, _NoModelLoads)
    # The user's inputs are checked before this machine's: no case may depend on a Docker daemon.
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.chdir(files)
    argv = [a.replace("{tmp}", str(files)) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("Loading weights")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected.replace("{tmp}", str(files)) in lines[0]


def _console(*args: str, cwd: Path = ROOT, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environ, **env},
    )


def test_version():
    done = _console("--version")
    assert done.returncode == 0 and re.fullmatch(r"stare-agent \d+\.\d+\.\d+\S*\n", done.stdout)


def test_train_help_lists_the_main_fields():
    done = _console("train", "--help")
    assert done.returncode == 0
    for key in (
        "model.name_or_path=",
        "data.train=",
        "algorithm.W=1.1",
        "trainer.steps=2000",
        "trainer.run_dir=",
    ):
        assert key in done.stdout, key
    assert "--resume" in done.stdout and "docs/configuration.md" in done.stdout


@pytest.mark.slow  # 25 s: a stare-agent process waiting out the hub, on 2 loaded cores
def test_a_hub_id_while_the_hub_is_unreachable_fails_fast(tmp_path):
    """No 54 s of retries then a traceback: one line that names the hub, HF_HUB_OFFLINE and a local path."""
    unreachable = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    done = _console("eval", "--data", "aime2024", "--model", "some-org/some-model", timeout=60, **unreachable)
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert line.startswith("error: model.name_or_path='some-org/some-model' is not a directory here")
    assert "hub (http://127.0.0.1:9) is not reachable" in line
    assert "local model directory" in line and "HF_HUB_OFFLINE=1" in line
    done = _console(
        "eval",
        "--data",
        "aime2024",
        "--model",
        "some-org/some-model",
        timeout=60,
        HF_HUB_OFFLINE="1",
        **unreachable,
    )
    assert done.returncode == 2 and "not in the Hugging Face cache" in done.stderr
    assert "HF_HUB_OFFLINE is set" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # 20 s: a stare-agent eval process, on 2 loaded cores
def test_readme_module_id_command_runs_from_examples(tmp_path, model_dir):
    """The README's `stare-agent eval --env register_tool_env:demo/Calculator-v0`, run from examples/ with
    the installed console script (which puts its own directory on sys.path, not the working one); the
    env's registered problems (multiplication) are evaluated, as no --data is given."""
    done = _console(
        "eval",
        "--env",
        "register_tool_env:demo/Calculator-v0",
        "--model",
        str(model_dir),
        "--limit",
        "2",
        "--samples",
        "1",
        "--max-response-tokens",
        "16",
        "--out",
        str(tmp_path / "eval"),
        cwd=EXAMPLES,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "env: register_tool_env:demo/Calculator-v0 (format hermes, tools: calculator)" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["problem_id"].startswith("multiplication-") for r in rows)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["settings"]["data"]["source"] == "multiplication"
    missing = _console("eval", "--env", "register_tool_env:demo/Calculator-v0", cwd=ROOT)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: env.id='register_tool_env:demo/Calculator-v0': no module named 'register_tool_env' here "
        f"({ROOT}) or on sys.path: run from the directory that holds register_tool_env.py, add that "
        "directory to PYTHONPATH, or pip install the package that provides it"
    ]


def test_building_the_parser_imports_no_torch():
    """`stare-agent sandbox doctor` must run where torch is missing or broken (the slim install): the
    parser, `train --help`'s field list included, reads the config dataclasses only when asked."""
    code = "import sys; from stare_agent import cli; cli.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


@pytest.mark.slow  # a `stare-agent eval` process in a mount namespace: 10 s on 2 loaded cores
def test_a_read_only_out_is_refused_before_an_engine_starts(tmp_path):
    """--out on a read-only file system (a bind mount, remounted read-only, in a mount namespace of the
    command's own): one line, exit 2, before any engine or model loads (it failed 79 s in, after vLLM)."""
    from tests.conftest import host_problem, require

    require("host", host_problem(tools=("unshare", "mount")))
    out = tmp_path / "ro"
    out.mkdir()
    script = (
        f"mount --bind {out} {out} && mount -o remount,bind,ro {out} && exec {CONSOLE_SCRIPT} eval "
        f"--data aime2024 --backend local --limit 1 --samples 1 --out {out}"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120, env=environ
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-2000:]
    assert lines == [
        f"error: --out {out} is not writable (Read-only file system): pass a directory you can write"
    ]
    assert "engine:" not in done.stdout


def test_a_ctrl_c_a_library_reports_as_its_own_error_is_an_interruption(monkeypatch, capsys):
    """Ctrl-C during DeepSpeed's first-start op build: ninja stops and torch raises RuntimeError
    ("ninja: build stopped: interrupted by user") from CalledProcessError. The CLI says "interrupted"
    (exit 130), not a traceback; a wrapped full disk is one line (exit 2)."""

    def interrupted_build(args):
        try:
            raise subprocess.CalledProcessError(2, ["ninja", "-v"])
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                "Error building extension 'deepspeed_shm_comm': ninja: build stopped: interrupted by user."
            ) from exc

    def full_disk(args):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    def read_only(args):
        raise OSError(errno.EROFS, "Read-only file system", "/mnt/ro/plots")

    for func, code, said in (
        (interrupted_build, 130, "interrupted"),
        (full_disk, 2, "error: no space left on the device (RuntimeError: Error while serializing"),
        (
            read_only,
            2,
            "error: cannot write /mnt/ro/plots (Read-only file system): pick a place you can write",
        ),
    ):
        monkeypatch.setattr(cli, "_plot", func)
        assert cli.main(["plot", "somewhere"]) == code
        assert capsys.readouterr().err.startswith(said)


@pytest.mark.parametrize(
    ("command", "again"),
    [
        ("train", "run the same command with --resume (what it finished is kept)"),
        ("eval", "run the same command with --resume (what it finished is kept)"),
        (
            "sft",
            "run the same command with --overwrite (it starts over: a rerun into its directory is refused)",
        ),
        (
            "quickstart",
            "run the same command with --overwrite (it starts over: a rerun into its directory is refused)",
        ),
    ],
)
def test_a_full_disk_and_a_ctrl_c_say_how_each_command_goes_on(monkeypatch, capsys, command, again):
    """`sft` has no --resume: after a full disk a rerun is refused unless --overwrite, and after Ctrl-C it
    said only "interrupted"; commands with --resume go on with it."""

    def full_disk(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/model.safetensors")

    def ctrl_c(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    argv = {
        "train": ["train"],
        "eval": ["eval", "--data", "aime2024"],
        "sft": ["sft"],
        "quickstart": ["quickstart"],
    }
    for func in (full_disk, ctrl_c):
        args = parser.parse_args(argv[command])
        monkeypatch.setattr(args, "func", func)
        monkeypatch.setattr(
            cli, "build_parser", lambda args=args: type("P", (), {"parse_args": lambda self, a: args})()
        )
        code = cli.main(argv[command])
        err = capsys.readouterr().err.strip()
        if func is full_disk:
            assert code == 2 and err.endswith(f"then {again}"), err
        else:
            assert code == 130
            assert err == ("interrupted" if "--resume" in again else f"interrupted: {again}")
        monkeypatch.undo()


def test_eval_of_a_config_with_eval_fp32_decodes_in_fp32(monkeypatch):
    """`stare-agent eval --config configs/quickstart.yaml --model <its checkpoint>` decoded in bf16 (vLLM's
    default dtype) while the quickstart's table is fp32: it could not reproduce the table's number."""
    from stare_agent import engines
    from stare_agent.config import load_config

    seen = {}

    def start_engine(config, model, tokenizer, **kwargs):
        seen["dtype"] = config.env.vllm.dtype
        return "stand-in", object()

    monkeypatch.setattr(engines, "start_engine", start_engine)
    args = cli.build_parser().parse_args(["eval", "--config", "configs/quickstart.yaml"])
    for fp32, dtype in ((True, "float32"), (False, "bfloat16")):
        config = load_config(
            Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml", [f"data.eval_fp32={fp32}"]
        )
        cli._eval_engine(args, config)
        assert seen["dtype"] == dtype
