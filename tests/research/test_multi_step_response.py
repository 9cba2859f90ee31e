"""benchmarks/multi_step_response.py: an arm's overrides, the paired statistics and their pre-stated
reading against hand-worked numbers, and a run on the tiny model's saved batches through the trainer's
own ``learn``: with one optimizer step a batch KL-Cov is GRPO-ds bit for bit, with two it is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.multi_step_response import (
    arm_overrides,
    main,
    reading,
    summarize,
    tables,
    tables_of_csv,
)
from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.trainer import Trainer
from stare_research.entropy_bank import write_bank
from stare_research.replay import load_step, step_files
from stare_research.study import VARIANTS
from tests.stare_agent.train.scripted_training import overrides, scripted_policy, write_problems

SLOW_FIXTURES = ("draws",)


def test_an_arm_is_its_study_variant_then_its_own_settings_and_stare_measures_its_lever():
    assert arm_overrides("kl-cov", VARIANTS) == ["algorithm.name=kl_cov"]
    assert arm_overrides("kl-cov:algorithm.kl_cov_k=0.02", VARIANTS) == [
        "algorithm.name=kl_cov",
        "algorithm.kl_cov_k=0.02",
    ]
    assert arm_overrides("stare-o1:algorithm.W=3.0", VARIANTS) == [
        "algorithm.gate=always_on",
        "algorithm.name=stare",
        "algorithm.variant=O1",
        "algorithm.W=3.0",
    ]
    with pytest.raises(SystemExit, match="unknown variant 'klcov'"):
        arm_overrides("klcov", VARIANTS)
    with pytest.raises(SystemExit, match="is not key=value"):
        arm_overrides("kl-cov:algorithm.kl_cov_k", VARIANTS)


def _records(arm: str, dHs: list[float]) -> list[dict]:
    return [{"arm": arm, "batch": b, "dH": x} for b, x in enumerate(dHs)]


def test_the_paired_effects_and_their_reading_by_hand():
    records = [
        *_records("grpo-ds", [1.0, 2.0, 3.0]),
        *_records("kl-cov", [1.0, 2.0, 3.0]),  # GRPO-ds bit for bit
        *_records("wide", [2.0, 4.0, 6.0]),  # paired 1, 2, 3
        *_records("up", [2.0, 3.1, 3.9]),  # paired 1, 1.1, 0.9
        *_records("down", [0.0, 0.9, 2.1]),  # paired -1, -1.1, -0.9
        *_records("partial", [1.0, 2.0]),  # batch 2 missing: every arm is read on batches 0 and 1
    ]
    s = summarize(records)
    assert s["batches"] == 2
    s = summarize([r for r in records if r["arm"] != "partial"])
    a = s["arms"]
    assert s["batches"] == 3
    assert a["kl-cov"]["identical"] == 3 and a["kl-cov"]["reading"] == "identical"
    # paired 1, 2, 3: mean 2, sample SD 1, t(0.975, 2 df) 4.303: half-width 2.484, interval holds 0
    assert a["wide"]["paired"]["mean"] == pytest.approx(2.0)
    assert a["wide"]["paired"]["ci95"] == pytest.approx(2.484, abs=1e-3)
    assert a["wide"]["reading"] == "not shown" and a["wide"]["paired"]["above_0"] == 3
    # paired 1, 1.1, 0.9: mean 1, SD 0.1, half-width 0.248: [0.752, 1.248] above 0
    assert a["up"]["paired"]["ci95"] == pytest.approx(0.2484, abs=1e-3)
    assert a["up"]["reading"] == "raises"
    assert a["down"]["reading"] == "lowers" and a["down"]["paired"]["above_0"] == 0
    assert a["grpo-ds"]["reading"] == "baseline"
    with pytest.raises(ValueError, match="no grpo-ds arm"):
        summarize(_records("kl-cov", [1.0]))


def test_one_batch_is_read_as_not_shown_unless_identical():
    one = {"mean": 1.0, "ci95": float("nan"), "low": float("nan"), "high": float("nan"), "n": 1, "above_0": 1}
    assert reading(one, identical=0) == "not shown"
    assert reading(one, identical=1) == "identical"


@pytest.fixture(scope="module")
def draws(tmp_path_factory) -> tuple[Path, Path]:
    """A four-step run at lr 1e-30 with saved batches (the draws run's shape), and a bank of its
    last step's episodes."""
    root = tmp_path_factory.mktemp("multi_step")
    problems = write_problems(root / "problems.jsonl")
    config = load_config(
        None,
        [
            *overrides(str(root / "run"), str(problems), 4),
            "trainer.save_rollouts=true",
            "trainer.checkpoint_every=0",
            "optim.lr=1e-30",
            "algorithm.name=grpo_ds",
        ],
    )
    model, tokenizer = tiny_model()
    Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    ).fit()
    last = step_files(root / "run")[-1][1]
    drawn, _ = load_step(last)
    bank = root / "bank.jsonl"
    write_bank(bank, [t for g in drawn for t in g.trajectories])
    return root / "run", bank


def _measure(run: Path, bank: Path, out: Path, epochs: int, *extra: str) -> dict:
    argv = [
        "--from-run", str(run), "--bank", str(bank), "--warm", "1", "--batches", "2",
        "--epochs", str(epochs), "--lr", "1e-2", "--out", str(out), *extra,
    ]  # fmt: skip
    return main(argv, policy=tiny_model)


def test_kl_cov_is_grpo_ds_with_one_step_a_batch_and_not_with_two(draws, tmp_path, capsys):
    run, bank = draws
    arms = ["--arms", "grpo-ds", "kl-cov:algorithm.kl_cov_k=0.2"]
    one = _measure(run, bank, tmp_path / "one", 1, *arms)
    assert one["arms"]["kl-cov:algorithm.kl_cov_k=0.2"]["reading"] == "identical"
    two = _measure(run, bank, tmp_path / "two", 2, *arms)
    kl = two["arms"]["kl-cov:algorithm.kl_cov_k=0.2"]
    assert kl["identical"] < 2 and kl["selected_frac"] > 0
    assert two["arms"]["grpo-ds"]["dH"]["n"] == 2
    # every update took `epochs` optimizer steps, and the table reprints from the shipped CSV
    rows = (tmp_path / "two" / "records.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and all(r.split(",")[10] == "2" for r in rows[1:])
    printed = capsys.readouterr().out
    assert tables_of_csv(tmp_path / "two" / "records.csv") in printed
    # a rerun with the same --out measures nothing again; other settings are refused
    again = _measure(run, bank, tmp_path / "two", 2, *arms)
    assert again["arms"]["grpo-ds"]["dH"] == two["arms"]["grpo-ds"]["dH"]
    assert "resuming: 4 records" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="other settings"):
        _measure(run, bank, tmp_path / "two", 3, *arms)
    meta = json.loads((tmp_path / "two" / "records.json").read_text())["meta"]
    assert meta["epochs"] == 2 and meta["warm"] == 1


def test_a_run_that_moved_its_weights_cannot_warm_adam(tmp_path, draws):
    run, bank = draws
    moving = tmp_path / "moving"
    moving.mkdir()
    for item in run.iterdir():
        (moving / item.name).symlink_to(item)
    (moving / "config.yaml").unlink()
    (moving / "config.yaml").write_text(
        (run / "config.yaml").read_text().replace("lr: 1.0e-30", "lr: 0.001", 1)
    )
    with pytest.raises(SystemExit, match="use a run at optim.lr=1e-30"):
        _measure(moving, bank, tmp_path / "out", 1, "--arms", "grpo-ds")


def test_the_table_says_what_its_intervals_cover():
    records = [*_records("grpo-ds", [1e-4, 2e-4]), *_records("kl-cov", [1e-4, 2e-4])]
    text = tables(summarize(records), {"epochs": 4, "lr": 1e-5, "H_start": 0.377, "warm": 4})
    assert "4 optimizer steps a batch" in text and "2 batches of one start and one bank" in text
    assert "| kl-cov |" in text and "| identical |" in text
