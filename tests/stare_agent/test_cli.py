"""Each CLI command runs as a user would run it: a subprocess, a model directory on disk (the tiny
random model saved in Hugging Face format), real sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli(*args: str, timeout: float = 600, **environ: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run(
        [sys.executable, "-m", "stare_agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, **environ},
    )


@pytest.mark.slow  # `stare-agent` processes, each importing torch: 20 s on 2 loaded cores
def test_bad_input_is_one_line_of_cause_and_fix(tmp_path):
    done = cli("train", "--config", str(tmp_path / "missing.yaml"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: config file {tmp_path / 'missing.yaml'} not found: pass an existing YAML file, "
        "e.g. configs/quickstart.yaml"
    ]
    done = cli("train", "algorithm.Wx=1")
    assert done.returncode == 2 and "unknown config key 'algorithm.Wx'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # three `stare-agent` runs with a model: 40 s on 2 loaded cores
def test_sft_then_train_then_plot(tmp_path, model_dir):
    run = tmp_path / "run"
    common = [
        f"trainer.run_dir={run}",
        "sandbox.backend=local",
        "sandbox.pool_size=4",
        "env.max_response_tokens=32",
        "deepspeed.precision=fp32",
        "env.engine=transformers",  # the quickstart's auto picks vLLM where found (tests/stare_agent/engines/test_vllm_engine.py)
    ]
    done = cli(
        "sft",
        "--config",
        "configs/quickstart.yaml",
        f"model.name_or_path={model_dir}",
        "sft.procedural_rows=4",
        "sft.batch_size=2",
        "sft.epochs=1",
        f"sft.output_dir={run / 'sft'}",
        *common,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "sft_log.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["steps"] == 2 and summary["output_dir"] == str(run / "sft")
    done = cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.name_or_path={run / 'sft'}",
        "trainer.steps=2",
        "data.prompts_per_step=2",
        "data.samples_per_prompt=2",
        "data.max_sampling_batches=1",
        "data.prompts_per_draw=2",  # the quickstart draws 8 prompts at once
        *common,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # a random model earns reward 0 on every episode: no group to learn from, and the line says so
    assert (
        f"ran 2 steps, 0 trained and 2 skipped (nothing to train: see skip_reason in metrics.jsonl); "
        f"run directory: {run}"
    ) in done.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (run / "checkpoints" / "step-000002" / "hf" / "model.safetensors").is_file()
    done = cli("plot", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "plots" / "dashboard.png").is_file()


@pytest.mark.slow  # the whole quickstart on the tiny model: ~40 s on 2 cores
def test_quickstart_runs_whole_on_one_pool_and_tables_sft_and_rl_apart(tmp_path, model_dir):
    """`stare-agent quickstart` end to end at toy sizes: the pool opened beside the model serves the
    three evaluations and RL, and the table gives before / SFT / SFT+RL with RL's paired change."""
    run = tmp_path / "run"
    done = cli(
        "quickstart",
        "--config",
        "configs/quickstart.yaml",
        f"model.name_or_path={model_dir}",
        f"trainer.run_dir={run}",
        "sandbox.backend=local",
        "sandbox.pool_size=4",
        "env.engine=transformers",
        "env.max_response_tokens=16",
        "deepspeed.precision=fp32",
        "data.eval_limit=4",
        "sft.procedural_rows=4",
        "sft.batch_size=2",
        "sft.epochs=1",
        "trainer.steps=1",
        "data.prompts_per_step=2",
        "data.samples_per_prompt=2",
        "data.prompts_per_draw=2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((run / "quickstart.json").read_text())
    for column in ("before", "after_sft", "after"):
        assert len(result[column]["solved"]) == 4, column
    assert list(result["times_s"]) == [
        "sandbox",
        "model",
        "sandboxes",
        "eval before",
        "sft",
        "eval sft",
        "rl",
        "eval after",
    ]
    assert "before       SFT    SFT+RL" in done.stdout
    assert "RL's change in accuracy (SFT -> SFT+RL): +0.000, 95 % interval [" in done.stdout
    assert (run / "eval_sft" / "summary.json").is_file()


@pytest.mark.slow  # a `stare-agent sft` of two rows: 15 s on 2 loaded cores
def test_sft_on_a_cpu_without_native_bf16_runs_fp32_and_says_so(tmp_path, model_dir):
    """The quickstart config asks for bf16-autocast; where oneDNN may not use AVX-512 BF16 or AMX (capped
    here, as on a CPU without them) bf16 runs emulated, 15x slower: sft runs fp32 and says so."""
    run = tmp_path / "run"
    done = cli(
        "sft",
        "--config",
        "configs/quickstart.yaml",
        f"model.name_or_path={model_dir}",
        "sft.procedural_rows=2",
        "sft.batch_size=2",
        "sft.epochs=1",
        f"sft.output_dir={run / 'sft'}",
        f"trainer.run_dir={run}",
        "sandbox.backend=local",
        ONEDNN_MAX_CPU_ISA="AVX2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "precision: fp32 (deepspeed.precision=bf16-autocast; this CPU has no native bf16 (AVX-512 BF16 or AMX), "
        "where bf16 runs emulated, about 15x slower)"
    ) in done.stdout.splitlines()


@pytest.mark.slow  # `stare-agent eval` of a model on AIME 2024: 30 s on 2 loaded cores
def test_eval_on_aime_2024(tmp_path, model_dir, shared_data):
    args = [
        "eval",
        "--model",
        str(model_dir),
        "--data",
        str(shared_data / "aime2024.jsonl"),
        "--limit",
        "2",
        "--samples",
        "2",
        "--max-response-tokens",
        "24",
        "--backend",
        "local",
        "--out",
        str(tmp_path),
        "--save-episodes",
    ]
    done = cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "avg@2" in done.stdout and "maj@2" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["aime2024-I-01", "aime2024-I-02"]
    assert len((tmp_path / "episodes.jsonl").read_text().splitlines()) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    model = summary["settings"]["model"]
    assert model["path"] == str(model_dir) and len(model["sha256"]) == 64
    assert f"model: {model_dir} ({model['sha256'][:12]})" in done.stdout
    assert summary["settings"]["data"]["source"].endswith("aime2024.jsonl")
    # a finished evaluation resumed: nothing is played again, the same summary
    done = cli(*args, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


@pytest.mark.slow  # 90 s: an interrupted and a resumed `stare-agent eval`, on 2 loaded cores
def test_eval_stopped_by_ctrl_c_resumes_to_the_uninterrupted_summary(tmp_path, model_dir, shared_data):
    import signal
    import time

    args = ["eval", "--model", str(model_dir), "--data", str(shared_data / "aime2024.jsonl"), "--limit", "12",
            "--samples", "2", "--max-response-tokens", "32", "--backend", "local", "--batch-size", "2"]  # fmt: skip
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert cli(*args, "--out", str(straight)).returncode == 0
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    command = [sys.executable, "-m", "stare_agent.cli", *args, "--out", str(cut)]

    # A user's Ctrl-C reaches a process whose SIGINT is the default; pytest started as a background
    # job (`make test &`, no job control) hands SIGINT down ignored, and Python then installs no
    # KeyboardInterrupt handler: restore the default for the child.
    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=default_sigint
    ) as process:
        deadline = time.monotonic() + 300
        while not (cut / "results.jsonl").is_file() or not (cut / "results.jsonl").read_text():
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)  # Ctrl-C once the first problem is written
        _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    finished = len((cut / "results.jsonl").read_text().splitlines())
    assert 1 <= finished < 12 and f"{finished} of 12 problems finished" in err
    partial = json.loads((cut / "summary.json").read_text())
    assert partial["complete"] is False and partial["problems_evaluated"] == finished
    done = cli(*args, "--out", str(cut), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{finished} of 12 problems finished, {12 - finished} to play" in done.stdout
    for name in ("results.jsonl", "summary.json"):
        assert (cut / name).read_text() == (straight / name).read_text()


def test_sandbox_doctor_reports_every_check():
    done = cli("sandbox", "doctor", timeout=120)
    names = [
        line.split("]")[1].split(":")[0].strip() for line in done.stdout.splitlines() if line.startswith("[")
    ]
    assert {"docker daemon", "sandbox image", "local sandbox"} <= set(names)
    assert done.returncode in (0, 1)


@pytest.mark.slow  # two `stare-agent train` runs of a tiny model: 60 s on 2 loaded cores
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_stops_training_at_a_step_boundary_with_a_checkpoint(tmp_path, model_dir, sig):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM during training:
    the step in flight finishes, a checkpoint of it is saved, the process says so in one line and exits
    with 128 + the signal, with no traceback from it or its workers; the resume logs each step once."""
    import signal
    import time

    run = tmp_path / "run"
    args = [
        sys.executable, "-m", "stare_agent.cli", "train", "--config", "configs/quickstart.yaml",
        f"model.name_or_path={model_dir}", f"trainer.run_dir={run}", "trainer.steps=40",
        "trainer.checkpoint_every=0", "data.prompts_per_step=2", "data.samples_per_prompt=2",
        "data.max_sampling_batches=1", "data.prompts_per_draw=2", "sandbox.backend=local",
        "sandbox.pool_size=2", "env.max_response_tokens=32", "deepspeed.precision=fp32",
        "env.engine=transformers", "data.eval_limit=1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    train = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text():
            assert train.poll() is None and time.monotonic() < deadline, train.communicate()[1][-3000:]
            time.sleep(0.5)
        os.killpg(train.pid, getattr(signal, sig))  # the whole group, workers included
        out, err = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
    assert train.returncode == 128 + getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith(f"stopped by {sig} after step ")]
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert (run / "checkpoints" / f"step-{step:06d}" / "hf").is_dir()
    done = cli("train", *args[4:], f"trainer.steps={step + 1}", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 2))


@pytest.mark.slow  # a `stare-agent sft` of two rows onto a full file system: 15 s on 2 loaded cores
def test_a_full_disk_is_one_line_and_leaves_no_half_written_model(tmp_path, model_dir):
    """The run directory on a 600 KiB tmpfs (in a mount namespace of the command's own): training fits,
    the model export does not. One line naming the full device, exit 2, and no cut model where
    `train` would later load it (the export is written beside and renamed into place)."""
    from tests.conftest import host_problem, require

    require("host", host_problem(tools=("unshare", "mount")))
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    command = " ".join(
        [
            sys.executable, "-m", "stare_agent.cli", "sft", "--config", "configs/quickstart.yaml",
            f"model.name_or_path={model_dir}", "sft.procedural_rows=2", "sft.batch_size=2", "sft.epochs=1",
            f"trainer.run_dir={run}", "sandbox.backend=local",
        ]
    )  # fmt: skip
    script = f"mount -t tmpfs -o size=600k tmpfs {disk} && {command}; code=$?; ls -A {run} {run}/sft_model; exit $code"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "error: no space left on the device (" in error[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    listed = done.stdout  # `ls -A` of the run directory and of sft_model, after the failure
    assert (
        "sft_log.jsonl" in listed and ".sft_model.partial" not in listed and "model.safetensors" not in listed
    )
