"""The examples run (with the tiny model) so they cannot rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluate_aime_example(tmp_path, shared_data):
    report = _load("evaluate_aime").main(
        [
            "--model",
            "tiny",
            "--limit",
            "2",
            "--samples",
            "2",
            "--max-response-tokens",
            "48",
            "--backend",
            "local",
            "--out",
            str(tmp_path),
        ]
    )
    assert [p.problem_id for p in report.problems] == ["aime2024-I-01", "aime2024-I-02"]
    assert json.loads((tmp_path / "summary.json").read_text())["avg@2"] == report.metrics["avg@2"]


@pytest.mark.slow  # a real training run of the example
def test_train_python_api_example(tmp_path):
    run_dir = tmp_path / "run"
    example = _load("train_python_api")
    summary = example.main(
        [
            "--tiny",
            "--run-dir",
            str(run_dir),
            "sandbox.backend=local",
            "env.max_response_tokens=48",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=2",
            "data.max_sampling_batches=1",
            "data.prompts_per_draw=2",  # the quickstart's draw of 8 prompts would play 16 episodes on 2 sandboxes
            "sandbox.pool_size=2",
            "env.engine=transformers",  # auto would start a vLLM worker (its trainer path: test_vllm_engine.py)
        ]
    )
    assert summary["steps"] == 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (run_dir / "plots" / "dashboard.png").is_file()
    assert (run_dir / "checkpoints" / "step-000002" / "hf" / "config.json").is_file()


def test_custom_problems_and_reward_from_yaml(monkeypatch):
    """configs/custom_problems.yaml, read from examples/ as its comment says: the module:id env id
    imports the example, which registers the family and the env; the reward comes from YAML."""
    from stare_agent.config import ConfigError, load_config
    from stare_agent.resources import eval_source, make_env
    from stare_envs.problems import eval_problems
    from stare_envs.rewards import RewardConfig

    monkeypatch.chdir(EXAMPLES)
    config = load_config(EXAMPLES.parent / "configs" / "custom_problems.yaml", ["sandbox.backend=local"])
    with make_env(config.env, sandbox_backend="local") as env:
        assert env.reward_config == RewardConfig(mode="plus_minus", tool_call_bonus=0.1)
        assert env.max_turns == 4  # the registration's, as the config sets none
    problems = eval_problems(eval_source(config), seed=0, difficulty=1, limit=2)
    assert [p.meta["family"] for p in problems] == ["powers_of_two"] * 2
    assert all(p.problem.startswith("What is the sum of the decimal digits of $2^") for p in problems)
    with pytest.raises(ConfigError, match=r"env.kwargs.reward: reward has no field 'bonus': its fields are"):
        load_config(None, ["env.kwargs.reward={bonus: 1}"])
    with pytest.raises(ConfigError, match=r"env.kwargs.reward: reward mode 'x' is unknown"):
        load_config(None, ["env.kwargs.reward={mode: x}"])


def test_unit_converter_example_plays_its_solution_to_reward_one():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "unit_converter.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith("reward=1.0 answer=")
