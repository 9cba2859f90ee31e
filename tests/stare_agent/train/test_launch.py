"""The README's multi-process launch lines run as written (CPU changes only: 2 ranks, gloo, a tiny
model, the local sandbox, one step), and the two ranks report what one process reports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BIN = Path(sys.executable).parent


def train_args(model_dir: Path, run_dir: Path) -> list[str]:
    """`train --config configs/quickstart.yaml` with the CPU-test changes: tiny model, one step, a
    parity-reward env (rewards differ without a trained model), micro_batch scope, fp32."""
    return [
        "train",
        "--config",
        "configs/quickstart.yaml",
        f"model.name_or_path={model_dir}",
        "env.id=tests.stare_agent.parity_env:test/Parity-v0",
        "env.max_response_tokens=16",
        "data.prompts_per_step=2",
        "data.prompts_per_draw=2",  # the quickstart draws 8 prompts at once
        "data.samples_per_prompt=4",
        "data.dynamic_sampling=false",
        "sandbox.backend=local",
        "sandbox.pool_size=4",
        "algorithm.scope=micro_batch",
        "algorithm.H_tgt=100.0",
        "deepspeed.precision=fp32",
        "env.engine=transformers",  # the quickstart's auto would start a vLLM worker per rank
        "trainer.steps=1",
        f"trainer.run_dir={run_dir}",
    ]


def launch(cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the venv's deepspeed / torchrun
    env["PYTHONPATH"] = str(REPO)  # tests.stare_agent.parity_env, for the env id
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_record(run_dir: Path) -> dict:
    (line,) = (run_dir / "metrics.jsonl").read_text().splitlines()
    return json.loads(line)


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    launch([sys.executable, "-m", "stare_agent.cli", *train_args(model_dir, run_dir)])
    return step_record(run_dir)


def agrees_with_one_process(two: dict, one: dict) -> None:
    assert two["skipped"] == 0 and two["kept_groups"] == one["kept_groups"] == 2
    assert two["reward_mean"] == one["reward_mean"]
    # STARE's micro_batch-scope metrics are over all ranks, like one process's (and the global scope's)
    for key in ("stare/frac_T_plus", "stare/frac_T_minus"):
        assert two[key] == one[key], key
    assert 0 < one["stare/frac_T_plus"] < 1
    for key in ("entropy", "stare/surprisal_p50", "stare/surprisal_p90", "stare/surprisal_p99"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key


@pytest.mark.slow  # three launches of torch + deepspeed processes (about 20 s each on 2 cores)
def test_deepspeed_launcher_as_the_readme_writes_it(model_dir, one_process, tmp_path):
    run_dir = tmp_path / "run"
    # README: deepspeed --num_gpus 8 --module stare_agent.cli train --config ...
    # (the launcher appends --local_rank=N to each rank's arguments)
    launch(
        [
            str(BIN / "deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "stare_agent.cli",
            *train_args(model_dir, run_dir),
        ]
    )
    agrees_with_one_process(step_record(run_dir), one_process)
    assert (run_dir / "checkpoints" / "step-000001" / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_torchrun_as_the_readme_writes_it(model_dir, one_process, tmp_path):
    run_dir = tmp_path / "run"
    # README: torchrun --nproc_per_node 8 -m stare_agent.cli train --config ...
    # (an explicit free port: --master_port=0 hangs the rendezvous)
    torchrun = shutil.which("torchrun", path=str(BIN)) or "torchrun"
    launch(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "-m",
            "stare_agent.cli",
            *train_args(model_dir, run_dir),
        ]
    )
    agrees_with_one_process(step_record(run_dir), one_process)
