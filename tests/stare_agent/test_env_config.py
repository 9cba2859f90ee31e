"""One environment configuration (``env.id`` + the ``env`` section) for training, in-training
evaluation, ``evaluate()`` and ``stare-agent eval``: any registered Gymnasium id, the same settings."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

from stare_agent.config import ConfigError, load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.evaluation import evaluate
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from stare_envs.problems import generate_problems
from stare_envs.registry import EnvRegistrationError
from stare_envs.tool_env import ToolEnv
from stare_envs.tools import unregister_tool

REPO = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLE = REPO / "examples" / "register_tool_env.py"
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def calculator_env():
    """``demo/Calculator-v0`` of examples/register_tool_env.py, registered in this process."""
    runpy.run_path(str(EXAMPLE), run_name="example")
    yield "demo/Calculator-v0"
    unregister_tool("calculator")
    gymnasium.registry.pop("demo/Calculator-v0", None)


def calculator_policy(*, wrong_on_odd: bool):
    """Turn 0 calls the calculator on the problem's product; turn 1 boxes the product (off by one on
    odd episodes when ``wrong_on_odd``, so that every group of 2 has rewards {0, 1})."""
    episodes = iter(range(10**6))

    def turn(prompt_text: str, turn_index: int) -> str:
        a, b = map(int, re.findall(r"\$(\d+) \\times (\d+)\$", prompt_text)[-1])
        if turn_index == 0:
            args = json.dumps({"expression": f"{a} * {b}"})
            return f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'
        extra = 1 if wrong_on_odd and next(episodes) % 2 else 0
        return f"The product is <answer>\\boxed{{{a * b + extra}}}</answer>"

    return turn


def config_for(tmp_path, *extra: str):
    return load_config(
        None,
        [
            "data.train=multiplication",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=2",
            "data.max_sampling_batches=1",
            "env.max_turns=3",
            "env.max_response_tokens=256",
            "sandbox.backend=local",
            "sandbox.pool_size=4",
            "optim.lr=1e-3",
            "trainer.steps=1",
            f"trainer.run_dir={tmp_path / 'run'}",
            "deepspeed.micro_batch_tokens=1024",
            "algorithm.H_tgt=100.0",
            *extra,
        ],
    )


def test_registered_example_env_trains_one_rl_step_and_evaluates(tmp_path, calculator_env):
    config = config_for(tmp_path, f"env.id={calculator_env}")
    model, tokenizer = tiny_model()
    engine = ScriptedEngine(tokenizer, calculator_policy(wrong_on_odd=True))
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine)
    summary = trainer.fit()
    last = summary["last"]
    # 2 groups of 2 episodes, each one calculator call; odd episodes box a wrong product
    assert (last["kept_groups"], last["skipped"], last["reward_mean"]) == (2, 0, 0.5)
    assert last["tool_calls_per_episode"] == 1.0 and last["grad_norm"] > 0

    problems = generate_problems("multiplication", 3, seed=7)
    report = evaluate(
        problems,
        engine=ScriptedEngine(tokenizer, calculator_policy(wrong_on_odd=False)),
        tokenizer=tokenizer,
        samples=2,
        env_id=config.env.id,
        env_kwargs={**config.env.env_kwargs(evaluation=True), "sandbox_backend": "local"},
        progress=False,
    )
    assert report.metrics["avg@2"] == 1.0 and report.metrics["tool_calls_per_episode"] == 1.0


def test_training_and_evaluation_envs_get_identical_settings_by_default(tmp_path, monkeypatch):
    """The trainer's rollout envs and its in-training evaluation envs, as they are reset."""
    seen: list[dict] = []
    reset = ToolEnv.reset

    def spy(self, *, seed=None, options=None):
        seen.append(
            {
                "class": type(self).__name__,
                "format": self.format.name,
                "tools": list(self.tools),
                "max_turns": self.max_turns,
                "max_tool_calls": self.max_tool_calls,
                "max_output_chars": self.max_output_chars,
                "max_output_tokens": self.max_output_tokens,
                "system_prompt": self.system_prompt,
                "prompt_template": self.prompt_template,
                "tokenizer": self.tokenizer is not None,
            }
        )
        return reset(self, seed=seed, options=options)

    monkeypatch.setattr(ToolEnv, "reset", spy)
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "sandbox.backend=local",
            "sandbox.pool_size=2",
            "data.eval=multiplication",
            "data.eval_limit=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    model, tokenizer = tiny_model()
    engine = ScriptedEngine(tokenizer, lambda prompt, turn: "<answer>\\boxed{1}</answer>")
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine)
    try:
        trainer.rollouts.groups(trainer.rollouts.stream.take(1), draw=1, step=1)
        n_train = len(seen)
        trainer.evaluate()
    finally:
        trainer.close()
    train, evaluation = seen[:n_train], seen[n_train:]
    assert train and evaluation
    assert all(s == train[0] for s in seen), (train[0], evaluation[0])
    assert (train[0]["max_turns"], train[0]["max_tool_calls"], train[0]["max_output_chars"]) == (3, 3, 1024)


def test_eval_kwargs_change_evaluation_only_and_bad_ids_fail_before_the_model_loads(tmp_path):
    config = config_for(tmp_path, "env.eval_kwargs={max_turns: 8}")
    assert config.env.env_kwargs()["max_turns"] == 3
    assert config.env.env_kwargs(evaluation=True) == {**config.env.env_kwargs(), "max_turns": 8}
    with pytest.raises(EnvRegistrationError, match=r"env.id='demo/Nope-v0' is not a registered Gymnasium id"):
        Trainer(config_for(tmp_path, "env.id=demo/Nope-v0"), model=object(), tokenizer=object())
    with pytest.raises(ConfigError, match=r"cannot set \['pool'\]"):
        config_for(tmp_path, "env.kwargs={pool: 1}")


def test_an_env_registered_with_max_episode_steps_is_refused_not_silently_unlimited():
    from stare_envs.registry import EnvRegistrationError, make_tool_env

    gymnasium.register("demo/Capped-v0", entry_point="stare_envs.tool_env:ToolEnv", max_episode_steps=4)
    try:
        with pytest.raises(
            EnvRegistrationError, match=r"max_episode_steps=4, a TimeLimit .* max_turns=4 among its kwargs"
        ):
            make_tool_env("demo/Capped-v0")
    finally:
        gymnasium.registry.pop("demo/Capped-v0")


PLUGIN = f"""
import runpy


def register():  # the stare_agent.envs entry point: registers demo/Calculator-v0
    runpy.run_path({str(EXAMPLE)!r}, run_name="plugin")
"""


@pytest.mark.slow  # 16-22 s each: a stare-agent eval process, on 2 loaded cores
@pytest.mark.parametrize("registered_by", ["module:id", "entry point"])
def test_cli_eval_plays_the_example_env(tmp_path, registered_by):
    """`stare-agent eval --env ...` with the example's id, registered by the module Gymnasium imports
    for ``module:id``, or by a package's ``stare_agent.envs`` entry point."""
    path = tmp_path / "tiny"
    model, tokenizer = tiny_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    if registered_by == "module:id":
        env_id, paths = "register_tool_env:demo/Calculator-v0", [str(EXAMPLE.parent), str(REPO)]
    else:  # an installed distribution declaring the entry point
        env_id, paths = "demo/Calculator-v0", [str(tmp_path / "site"), str(REPO)]
        dist = tmp_path / "site" / "calculator_plugin-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: calculator-plugin\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(
            "[stare_agent.envs]\ncalculator = calculator_plugin:register\n"
        )
        (tmp_path / "site" / "calculator_plugin.py").write_text(PLUGIN)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    done = subprocess.run(
        [sys.executable, "-m", "stare_agent.cli", "eval", "--model", str(path), "--data", "multiplication"]
        + ["--env", env_id, "--limit", "2", "--samples", "2"]
        + ["--max-response-tokens", "16", "--backend", "local", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"env: {env_id} (format hermes, tools: calculator)" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["correct"]) == 2 for r in rows)


def test_an_env_registered_with_problems_serves_them_unless_the_config_names_others(
    tmp_path, calculator_env, capsys
):
    """``register_tool_env(..., problems="multiplication")``: training and evaluation use those problems
    when data.train / data.eval are unset; set, the config wins and one line says so."""
    from stare_agent.resources import eval_source, train_source

    unset = load_config(None, [f"env.id={calculator_env}"])
    assert (train_source(unset), eval_source(unset)) == ("multiplication", "multiplication")
    default = load_config(None)  # stare/CodeInterpreter-v0 names no problems of its own
    assert (train_source(default), eval_source(default)) == ("mixed", None)
    assert capsys.readouterr().out == ""

    both = load_config(None, [f"env.id={calculator_env}", "data.train=mixed", "data.eval=aime2024"])
    assert (train_source(both), eval_source(both)) == ("mixed", "aime2024")
    assert capsys.readouterr().out.splitlines() == [
        f"[data] data.train='mixed' is used, not the problems {calculator_env} was registered with "
        "('multiplication'): set data.train=null to use those",
        f"[data] data.eval='aime2024' is used, not the problems {calculator_env} was registered with "
        "('multiplication'): set data.eval=null to use those",
    ]

    # the trainer draws and evaluates the registered problems
    config = load_config(
        None,
        [
            f"env.id={calculator_env}",
            "data.prompts_per_step=2",
            "data.samples_per_prompt=2",
            "env.max_turns=3",
            "env.max_response_tokens=256",
            "sandbox.backend=local",
            "sandbox.pool_size=4",
            "data.eval_samples=1",
            "data.eval_limit=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    model, tokenizer = tiny_model()
    engine = ScriptedEngine(tokenizer, calculator_policy(wrong_on_odd=False))
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine)
    try:
        assert trainer.rollouts.stream.family == "multiplication"
        assert all(p.id.startswith("multiplication-") for p in trainer.rollouts.stream.take(3))
        report = trainer.evaluate()
    finally:
        trainer.close()
    assert [p.problem_id.split("-")[0] for p in report.problems] == ["multiplication"] * 2
    assert report.metrics["avg@1"] == 1.0


def test_limits_given_at_registration_win_unless_the_config_sets_them():
    """``register_tool_env(..., max_turns=5, max_tool_calls=2)`` is what ``env.id`` plays: the config's
    limits are null (the env's own) unless set; the built-in ids keep the paper's 16."""
    from stare_agent.resources import make_env
    from stare_envs.registry import register_tool_env
    from stare_envs.tools import register_tool

    register_tool("echo_limits_demo", lambda text: text, description="Echo the text.")
    register_tool_env("test/Limits-v0", tools=["echo_limits_demo"], max_turns=5, max_tool_calls=2)
    try:
        with make_env(load_config(None, ["env.id=test/Limits-v0"]).env) as env:
            assert (env.max_turns, env.max_tool_calls, env.max_output_chars) == (5, 2, 4096)
        config = load_config(None, ["env.id=test/Limits-v0", "env.max_turns=7"])
        with make_env(config.env, evaluation=True) as env:
            assert (env.max_turns, env.max_tool_calls) == (7, 2)
        with make_env(load_config(None, ["sandbox.backend=local"]).env, sandbox_backend="local") as env:
            assert (env.max_turns, env.max_tool_calls) == (16, 16)  # stare/CodeInterpreter-v0
    finally:
        gymnasium.registry.pop("test/Limits-v0", None)
        unregister_tool("echo_limits_demo")


def test_registering_a_family_leaves_the_mixed_problems_as_they_were():
    from stare_envs.problems import PROBLEM_FAMILIES, register_family

    before = [(p.id, p.problem, p.answer) for p in generate_problems("mixed", 40, seed=3)]
    register_family("aaa_first_demo")(lambda rng, difficulty: ("What is 1 + 1?", 2, "print(1 + 1)"))
    try:
        assert [(p.id, p.problem, p.answer) for p in generate_problems("mixed", 40, seed=3)] == before
        assert generate_problems("aaa_first_demo", 1)[0].answer == "2"  # drawn by its name
    finally:
        dict.pop(PROBLEM_FAMILIES, "aaa_first_demo")


def test_every_env_setting_that_overrides_the_registered_one_is_said_in_one_line(calculator_env, capsys):
    """configs/quickstart.yaml with another env.id sets max_turns and max_tool_calls over the registered
    ones: each override is one line (once), as the data's is; a value equal to the registered one is not."""
    from stare_agent.resources import eval_source, train_source
    from stare_envs.registry import register_tool_env

    env_id = "test/Limits-v0"
    register_tool_env(
        env_id,
        tools=["calculator"],
        format="hermes",
        problems="multiplication",
        max_turns=3,
        max_tool_calls=2,
    )
    try:
        config = load_config(
            CONFIGS / "quickstart.yaml",
            [f"env.id={env_id}", "data.train=null", "data.eval=null", "env.format=hermes"],
        )
        train_source(config), eval_source(config)
        assert capsys.readouterr().out.splitlines() == [
            f"[env] env.max_tool_calls=3 is used, not the 2 {env_id} was registered with: set env.max_tool_calls=null "
            "to use that"
        ]  # max_turns 3 and format hermes are the registered ones: nothing to say
        train_source(config)
        assert capsys.readouterr().out == ""  # said once
    finally:
        gymnasium.registry.pop(env_id, None)


def test_the_custom_env_config_keeps_every_registered_setting(monkeypatch, capsys):
    """configs/custom_env.yaml: the env's registered format, limits and problems hold (nothing is
    overridden, so nothing is said); only the run's sizes are the config's."""
    from stare_agent.resources import eval_source, train_source

    monkeypatch.chdir(REPO / "examples")  # module:id imports register_tool_env.py from here
    config = load_config(CONFIGS / "custom_env.yaml")
    try:
        assert config.env.env_kwargs() == {}
        assert (train_source(config), eval_source(config)) == ("multiplication", "multiplication")
        assert capsys.readouterr().out == ""
    finally:
        unregister_tool("calculator")
        gymnasium.registry.pop("demo/Calculator-v0", None)
