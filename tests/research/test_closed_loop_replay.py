"""benchmarks/closed_loop_replay.py: the split of STARE minus GRPO-ds into the surprisal selection's share
and its placebo's, and the study's pre-stated criterion, against hand-worked numbers; the per-step CSV
written from a run's and its replays' metrics and read back into the same tables."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.closed_loop_replay import (
    RUN,
    collect,
    main,
    placebo_table,
    read_csv,
    table,
    tables_of_csv,
    write_csv,
)

EVALS = (5, 10, 15, 20, 25, 30)
BANK = {
    "grpo-ds": (0.1000,) * 6,
    # minus GRPO-ds: -0.001 at steps 5-20, -0.002 at 25 and 30 (late -0.002)
    "stare-o1": (0.0990, 0.0990, 0.0990, 0.0990, 0.0980, 0.0980),
    # STARE minus it: -0.0005, -0.0005, +0.0005, -0.0005, -0.0012, -0.0012: below 0 at 5 of 6, late
    # -0.0012 = 0.6 of -0.002: the criterion is met
    "stare-o1-placebo": (0.0995, 0.0995, 0.0985, 0.0995, 0.0992, 0.0992),
    # minus GRPO-ds -0.003 everywhere; minus its placebo -0.0002 everywhere (6 of 6) but late only
    # 0.0002 / 0.003 = 0.07 of it: not met
    "stare-o1-w3-drawn": (0.0970,) * 6,
    "stare-o1-w3-drawn-placebo": (0.0972,) * 6,
}


def _records(method: str) -> list[dict]:
    bank = dict(zip(EVALS, BANK[method], strict=True))
    return [
        {
            "step": step,
            "entropy": 0.05,
            "gate_on": step % 2,
            "reward_mean": 0.5,
            "time/step_s": 10.0,
            **({"eval/bank_entropy": bank[step]} if step in bank else {}),
            **({"stare/L_plus_placebo_overlap": 0.25} if method.endswith("placebo") else {}),
        }
        for step in range(1, 31)
    ]


def _all() -> dict[str, list[dict]]:
    return {RUN: [{"step": 0, "eval/bank_entropy": 0.0989}, *_records("grpo-ds")]} | {
        m: _records(m) for m in BANK
    }


def test_the_split_and_the_criterion_against_hand_worked_numbers():
    text = placebo_table(_all())
    lines = text.splitlines()
    assert lines[0].startswith("| difference of bank entropy | step 5 | step 10 |")
    assert (
        "| stare-o1 - grpo-ds | -0.00100 | -0.00100 | -0.00100 | -0.00100 | -0.00200 | -0.00200 | -0.00200 | 6/6 |"
        in lines
    )
    assert (
        "| stare-o1 - stare-o1-placebo (the selection) | -0.00050 | -0.00050 | +0.00050 | -0.00050 | -0.00120 | -0.00120 "
        "| -0.00120 | 5/6 |" in lines
    )
    assert (
        "| stare-o1-placebo - grpo-ds (any extra weight) | -0.00050 | -0.00050 | -0.00150 | -0.00050 | -0.00080 "
        "| -0.00080 | -0.00080 | 6/6 |" in lines
    )
    verdicts = [line for line in lines if line.startswith("criterion")]
    assert verdicts[0].startswith(
        "criterion, stare-o1: minus GRPO-ds late -0.00200, minus its placebo below 0 at 5/6 evaluations, "
        "late -0.00120 = 0.60 of minus GRPO-ds: MET"
    )
    assert "shares 0.25 of its tokens with L+" in verdicts[0]
    assert verdicts[1].startswith(
        "criterion, stare-o1-w3-drawn: minus GRPO-ds late -0.00300, minus its placebo below 0 at 6/6 "
        "evaluations, late -0.00020 = 0.07 of minus GRPO-ds: NOT MET"
    )


def test_two_selection_signs_against_it_fail_the_criterion_and_a_raise_is_never_met():
    records = _all()
    # STARE minus its placebo above 0 at steps 5 and 10: 4 of 6 below, though late it is all of it
    for r in records["stare-o1-placebo"]:
        if r["step"] in (5, 10):
            r["eval/bank_entropy"] = 0.0980
        elif "eval/bank_entropy" in r:
            r["eval/bank_entropy"] = 0.1000
    # STARE above GRPO-ds late: nothing to put on the selection
    for r in records["stare-o1-w3-drawn"]:
        if "eval/bank_entropy" in r:
            r["eval/bank_entropy"] = 0.1010
    verdicts = [line for line in placebo_table(records).splitlines() if line.startswith("criterion")]
    assert "below 0 at 4/6 evaluations" in verdicts[0] and "NOT MET" in verdicts[0]
    assert "minus GRPO-ds late +0.00100" in verdicts[1] and "NOT MET" in verdicts[1]


def test_a_method_without_a_placebo_gets_its_difference_and_no_criterion():
    records = {k: v for k, v in _all().items() if k in (RUN, "grpo-ds", "stare-o1")}
    text = placebo_table(records)
    assert text.splitlines()[2:] == [
        "| stare-o1 - grpo-ds | -0.00100 | -0.00100 | -0.00100 | -0.00100 | -0.00200 | -0.00200 | -0.00200 | 6/6 |"
    ]
    assert "criterion" not in text
    assert placebo_table({k: v for k, v in records.items() if k != "grpo-ds"}) == ""
    assert placebo_table({k: v for k, v in records.items() if k != "stare-o1"}) == ""


def test_an_unfinished_placebo_is_refused():
    records = _all()
    records["stare-o1-placebo"] = records["stare-o1-placebo"][:12]  # cut after step 12: evaluations 5, 10
    with pytest.raises(SystemExit, match="stare-o1: its replay or its placebo's is unfinished"):
        placebo_table(records)


def test_the_csv_of_a_run_and_its_replays_reprints_the_tables(tmp_path, capsys, monkeypatch):
    run = tmp_path / "study" / "runs" / "grpo-ds-s0"
    out = tmp_path / "study" / "replay"
    for directory, records in [(run, _records("grpo-ds")), *((out / m, _records(m)) for m in BANK)]:
        directory.mkdir(parents=True)
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "study" / "start_eval.json").write_text(json.dumps({"0": {"eval/bank_entropy": 0.0989}}))
    cut = out / "clip-cov"  # a replay cut short (by `timeout`) after 12 of the 30 steps
    cut.mkdir()
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records("grpo-ds")[:12]))
    methods = [*BANK, "kl-cov", "clip-cov"]  # one not replayed, one cut short
    records = collect(run, out, methods, steps=30)
    assert [r["step"] for r in records[RUN]][:2] == [0, 1]
    assert "kl-cov" not in records and "clip-cov" not in records
    printed = table(records, methods)
    assert "the start's bank entropy 0.0989." in printed
    assert "| kl-cov | - | not run |" in printed and "| clip-cov | - | not run |" in printed
    assert "| stare-o1 | 30 | 0.0500 | 0.0500 | 0.0980 | -0.0020 |" in printed
    path = tmp_path / "replay.csv"
    write_csv(records, path)
    back = read_csv(path)
    assert sorted(back) == sorted([RUN, *BANK])
    assert back["stare-o1-placebo"][4]["stare/L_plus_placebo_overlap"] == 0.25
    assert tables_of_csv(path) == table(back, list(BANK)) + "\n" + placebo_table(records)
    monkeypatch.setattr(sys, "argv", ["closed_loop_replay.py", "--from-csv", str(path)])
    main()
    assert "MET (the surprisal selection carries the lowering)" in capsys.readouterr().out


def test_a_csv_without_the_runs_rows_is_refused_with_its_cause(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("variant,seed,step,entropy\ngrpo-ds,0,1,0.1\n")
    with pytest.raises(SystemExit, match="not a replay CSV of this benchmark"):
        read_csv(path)


def test_overrides_reach_every_methods_replay_after_its_own_and_rollout_settings_are_refused(
    tmp_path, monkeypatch, capsys
):
    import benchmarks.closed_loop_replay as bench

    calls = []
    monkeypatch.setattr(
        bench, "replay", lambda run, out, settings, steps: calls.append((out.name, settings, steps))
    )
    bench.run_method(tmp_path / "run", tmp_path / "out", "kl-cov", 30, ["algorithm.ppo_epochs=4"])
    assert calls == [("kl-cov", [*bench.VARIANTS["kl-cov"], "algorithm.ppo_epochs=4"], 30)]
    monkeypatch.setattr(
        sys,
        "argv",
        ["x", "--run", str(tmp_path), "--out", str(tmp_path / "o"), "--overrides", "data.max_turns=2"],
    )
    with pytest.raises(
        SystemExit, match=r"--overrides: data.max_turns=2: a replay trains on the run's saved batches"
    ):
        main()
    assert calls == [("kl-cov", [*bench.VARIANTS["kl-cov"], "algorithm.ppo_epochs=4"], 30)]
