"""Frozen-rollout replay: a short scripted run with saved batches, replayed with its own config (the
same learner metrics, bit for bit), twice (identical), with another W (different), and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stare_agent import cli
from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from stare_research.replay import ReplayError, replay
from tests.stare_agent.train.scripted_training import overrides, scripted_policy

PROBLEMS = [
    {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(2, 3), (10, 7), (40, 2), (6, 6)]
]
STEPS = 3
# The learner's metrics: what a replay must repeat. Times are wall clock; the rest of a run's record
# (dynamic sampling, tool health, evaluations) is the rollout side, which a replay does not play.
SLOW_FIXTURES = ("run",)  # a three-step run with saved rollouts: its tests are `slow` (tests/conftest.py)
LEARNER = ("loss", "grad_norm", "entropy", "gate_on", "W", "M", "lr", "kept_groups", "frac_reweighted")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("replay")
    problems = root / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    config = load_config(
        None,
        overrides(str(root / "run"), str(problems), STEPS)
        + ["trainer.save_rollouts=true", "trainer.checkpoint_every=0"],
    )
    model, tokenizer = tiny_model()
    Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    ).fit()
    return root / "run"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _learner_metrics(run_dir: Path) -> list[dict]:
    """Every logged metric but times, of the keys a replay logs (NaN made comparable as a string)."""
    return [{k: repr(v) for k, v in r.items() if not k.startswith("time/")} for r in _records(run_dir)]


def _replay(run: Path, out: Path, *extra: str) -> Path:
    model, tokenizer = tiny_model()  # the run's starting weights: tiny_model() is seeded
    replay(run, out, list(extra), policy=model, tokenizer=tokenizer)
    return out


def test_a_replay_with_the_runs_config_repeats_its_learner_metrics_bit_for_bit(run, tmp_path):
    out = _replay(run, tmp_path / "same")
    ran, replayed = _records(run), _records(out)
    assert [r["step"] for r in replayed] == [1, 2, 3]
    for a, b in zip(ran, replayed, strict=True):
        assert b["skipped"] == 0 and b["gate_on"] == 1
        # Same weights, same batches, same ops in the same order on the same device: exact, not close.
        assert {k: a[k] for k in LEARNER} == {k: b[k] for k in LEARNER}
        shared = (set(a) & set(b)) - {k for k in a if k.startswith("time/")}
        assert {k: repr(a[k]) for k in shared} == {k: repr(b[k]) for k in shared}
        assert any(k.startswith("stare/") for k in b) and "reward_mean" in b
        assert "ds/groups_kept" in b and "tools/calls_per_episode" in b  # the draw's, copied from the run
    saved = (out / "config.yaml").read_text()
    assert f"run_dir: {out}" in saved and "mode: none" in saved  # auto, resolved as the run did
    assert json.loads((out / "replay.json").read_text())["steps"] == STEPS


def test_two_replays_log_identical_metrics(run, tmp_path):
    a = _replay(run, tmp_path / "a", "algorithm.W=2.0")
    b = _replay(run, tmp_path / "b", "algorithm.W=2.0")
    assert _learner_metrics(a) == _learner_metrics(b)


def test_a_replay_with_another_W_trains_differently(run, tmp_path):
    out = _replay(run, tmp_path / "w3", "algorithm.W=3.0")
    ran, replayed = _records(run), _records(out)
    assert [r["W"] for r in replayed] == [3.0] * STEPS
    assert ran[0]["reward_mean"] == replayed[0]["reward_mean"]  # the same batches
    assert ran[0]["entropy"] == replayed[0]["entropy"]  # the same starting weights
    assert ran[0]["loss"] != replayed[0]["loss"] and ran[0]["grad_norm"] != replayed[0]["grad_norm"]
    assert ran[-1]["entropy"] != replayed[-1]["entropy"]  # the updates differed


def test_grpo_ds_replays_the_same_batches(run, tmp_path):
    out = _replay(run, tmp_path / "grpo", "algorithm.name=grpo_ds")
    replayed = _records(out)
    assert len(replayed) == STEPS and "stare/L_plus" not in replayed[0]
    assert [r["reward_mean"] for r in replayed] == [r["reward_mean"] for r in _records(run)]


@pytest.mark.parametrize(
    "name,key",
    [
        ("entropy_bonus", None),
        ("kl_cov", "kl_cov/frac_selected"),
        ("clip_cov", "clip_cov/frac_candidates"),
        ("forking_tokens", "forking/frac_selected"),
    ],
)
def test_the_other_entropy_controls_replay_the_same_batches(run, tmp_path, name, key):
    out = _replay(run, tmp_path / name, f"algorithm.name={name}")
    replayed = _records(out)
    assert [r["reward_mean"] for r in replayed] == [r["reward_mean"] for r in _records(run)]
    assert key is None or all(0 <= r[key] <= 1 for r in replayed if not r.get("skipped"))


def test_a_replay_refuses_rollout_settings_and_its_own_run_dir(run, tmp_path):
    with pytest.raises(ReplayError, match="only learner settings can change"):
        replay(run, tmp_path / "x", ["data.samples_per_prompt=4"])
    with pytest.raises(ReplayError, match="is the run's own directory"):
        replay(run, run)


def test_files_of_an_older_version_name_what_they_lack(run, tmp_path):
    old = tmp_path / "old"
    (old / "rollouts").mkdir(parents=True)
    (old / "config.yaml").write_text((run / "config.yaml").read_text())
    record = json.loads((run / "rollouts" / "step_00001.jsonl").read_text().splitlines()[0])
    for key in ("prompt_ids", "loss_mask", "logprobs", "turn_spans", "global_id"):
        record.pop(key)
    (old / "rollouts" / "step_00001.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ReplayError, match="has no global_id, prompt_ids, loss_mask, logprobs"):
        replay(old, tmp_path / "out")


def test_the_command_line_replays_and_says_where(run, tmp_path, capsys, monkeypatch):
    # the console path loads the run's model.name_or_path: here the tiny model, as a directory
    model, tokenizer = tiny_model()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    argv = ["replay", "--from", str(run), "--out", str(tmp_path / "cli"), "--model", str(tmp_path / "tiny")]
    assert cli.main([*argv, "--steps", "1", "algorithm.W=2.0"]) == 0
    assert "replayed 1 steps" in capsys.readouterr().out
    assert [r["step"] for r in _records(tmp_path / "cli")] == [1]
    png = tmp_path / "both.png"
    assert cli.main(["plot", str(run), str(tmp_path / "cli"), "--out", str(png)]) == 0  # overlaid
    assert png.stat().st_size > 0
    assert cli.main([*argv, "--steps", "9"]) == 2
    assert "saved 3 steps: pass --steps 3 or fewer" in capsys.readouterr().err


@pytest.mark.slow  # 51 s: a two-rank run and its replays, on 2 loaded cores
def test_a_two_rank_run_replays_bit_for_bit_on_two_ranks_and_to_fp_tolerance_on_one(tmp_path):
    """torchrun, 2 ranks, gloo: the replay deals the kept groups to ranks as the run did, so the same
    world size repeats the run exactly; one rank splits the sums differently (fp tolerance)."""
    from tests.stare_agent.train.test_trainer import LAUNCHER_VARS, SCRIPT, _free_port

    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    model, tokenizer = tiny_model()
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}

    def torchrun(*args: str) -> None:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
        ]
        done = subprocess.run(
            [*launch, f"--master_port={_free_port()}", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]

    run = tmp_path / "two"
    torchrun(
        str(SCRIPT), str(run), str(problems), "2", "trainer.save_rollouts=true", "algorithm.scope=global"
    )
    replay_args = ["--from", str(run), "--model", str(tmp_path / "tiny")]
    torchrun("-m", "stare_agent.cli", "replay", *replay_args, "--out", str(tmp_path / "r2"))
    assert cli.main(["replay", *replay_args, "--out", str(tmp_path / "r1")]) == 0
    ran, on_two, on_one = _records(run), _records(tmp_path / "r2"), _records(tmp_path / "r1")
    assert [{k: a[k] for k in LEARNER} for a in ran] == [{k: b[k] for k in LEARNER} for b in on_two]
    for a, b in zip(ran, on_one, strict=True):
        assert a["gate_on"] == b["gate_on"] and a["kept_groups"] == b["kept_groups"]
        for key in ("loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
