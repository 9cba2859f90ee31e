"""benchmarks/adam_lever.py: the first-order prediction of a real displacement, the paired statistics and
the pre-stated criterion against hand-worked numbers, and a smoke run of its --quick mode (the project's
learner and optimizer on the tiny random model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.adam_lever import (
    compare,
    criterion_met,
    displacement_response,
    interval,
    main,
    summarize,
    tables,
)


def test_displacement_response_is_the_inner_product_with_the_real_displacement():
    h = [torch.tensor([1.0, 2.0]), torch.tensor([[0.5]])]
    start = [torch.tensor([0.0, 1.0]), torch.tensor([[2.0]])]
    params = [torch.tensor([0.1, 0.7]), torch.tensor([[2.4]])]
    # displacement (0.1, -0.3), (0.4): 1 * 0.1 + 2 * (-0.3) + 0.5 * 0.4 = -0.3
    assert displacement_response(h, params, start) == pytest.approx(-0.3, abs=1e-6)
    assert displacement_response(h, start, start) == 0.0


def test_compare_by_hand():
    c = compare([1.0, 2.0, 3.0], [2.0, 2.0, -1.0])
    m = c["measured"]
    # mean 2, sample SD 1, t(0.975, 2 df) = 4.303: half-width 4.303 / sqrt(3) = 2.484
    assert m["mean"] == 2.0 and m["ci95"] == pytest.approx(2.484, abs=1e-3)
    assert m["low"] == pytest.approx(-0.484, abs=1e-3) and m["above_0"] == 3
    assert c["ratio"]["mean"] == pytest.approx((0.5 + 1.0 - 3.0) / 3)  # per batch: 1/2, 2/2, 3/(-1)
    assert c["ratio_of_means"] == pytest.approx(2.0)  # 2 / 1
    assert c["sign_agree"] == 2  # the third batch's signs differ
    with pytest.raises(ValueError, match="paired"):
        compare([1.0], [1.0, 2.0])


def test_the_criterion_needs_the_whole_interval_above_zero():
    # mean 0.3, SD 0.1: half-width 4.303 * 0.1 / sqrt(3) = 0.248, low end +0.052
    assert criterion_met(interval([0.2, 0.3, 0.4]))
    # mean 0.3, SD 0.2: half-width 0.497, low end -0.197
    assert not criterion_met(interval([0.1, 0.3, 0.5]))
    assert not criterion_met(interval([1.0]))  # one batch has no interval
    assert not criterion_met(interval([-0.4, -0.3, -0.2]))


def test_summarize_pairs_each_lever_with_grpo_ds_on_the_same_batch():
    rows = []
    for b, (g, c, p, gp, cp, pp) in enumerate(
        [(-0.010, -0.005, -0.011, -0.020, -0.010, -0.021), (-0.020, -0.012, -0.019, -0.010, -0.004, -0.009)]
    ):
        for arm, dH, pred in (("grpo_ds", g, gp), ("c2_lever", c, cp), ("lplus_lever", p, pp)):
            rows.append({"batch": b, "lr": 1e-6, "arm": arm, "dH": dH, "predicted": pred})
    rows.append({"batch": 2, "lr": 1e-6, "arm": "grpo_ds", "dH": 5.0, "predicted": 5.0})  # no pair: left out
    s = summarize(rows)["1e-06"]
    assert s["batches"] == 2
    lever = s["c2_lever - grpo_ds"]
    # measured 0.005, 0.008: mean 0.0065, SD 0.003 / sqrt(2), half-width 12.706 * 0.0015 = 0.01906
    assert lever["measured"]["mean"] == pytest.approx(0.0065)
    assert lever["measured"]["ci95"] == pytest.approx(12.706 * 0.0015, rel=1e-3)
    assert not lever["criterion_met"]  # low end -0.0126
    # predicted 0.010, 0.006: per-batch ratios 0.5 and 4/3
    assert lever["predicted"]["mean"] == pytest.approx(0.008)
    assert lever["ratio"]["mean"] == pytest.approx((0.5 + 0.008 / 0.006) / 2)
    assert lever["sign_agree"] == 2
    plus = s["lplus_lever - grpo_ds"]  # -0.001, +0.001: one above 0
    assert plus["measured"]["mean"] == pytest.approx(0.0, abs=1e-12) and plus["measured"]["above_0"] == 1
    assert s["grpo_ds"]["measured"]["mean"] == pytest.approx(-0.015)


def test_placebo_pair_and_its_criterion_in_summary_and_table():
    rows = []
    data = [  # per batch: grpo_ds, c2_lever, lplus_lever, c2_placebo dH
        (0.0, 0.30, 0.1, 0.10),
        (0.0, 0.40, 0.1, 0.10),
        (0.0, 0.50, 0.1, 0.10),
    ]
    for b, dhs in enumerate(data):
        for arm, dH in zip(("grpo_ds", "c2_lever", "lplus_lever", "c2_placebo"), dhs, strict=True):
            rows.append({"batch": b, "lr": 1e-6, "arm": arm, "dH": dH, "predicted": dH / 2})
    s = summarize(rows)["1e-06"]
    pair = s["c2_lever - c2_placebo"]
    # 0.2, 0.3, 0.4: mean 0.3, SD 0.1, half-width 0.248: low end +0.052
    assert pair["measured"]["mean"] == pytest.approx(0.3) and pair["measured"]["above_0"] == 3
    assert pair["criterion_met"]
    assert s["c2_placebo - grpo_ds"]["measured"]["mean"] == pytest.approx(0.1)
    meta = {"H_start": 0.5, "warm": 4, "M": 0.9, "W": 3.0}
    text = tables(summarize(rows), meta)
    assert "| 1e-06 | c2_lever - c2_placebo | +3.00e-01 ± 2.5e-01 | 3/3 |" in text
    assert "placebo criterion at lr 1e-06" in text and "MET (the surprisal selection matters)" in text
    assert "one draw, not an expectation" in text
    # the interval holds 0: not met
    rows = [r if not (r["arm"] == "c2_placebo" and r["batch"] == 0) else {**r, "dH": 0.6} for r in rows]
    assert not summarize(rows)["1e-06"]["c2_lever - c2_placebo"]["criterion_met"]
    # without the placebo arm the tables have no placebo part (the earlier CSV's tables are unchanged)
    three = [r for r in rows if r["arm"] != "c2_placebo"]
    assert "c2_lever - c2_placebo" not in summarize(three)["1e-06"]
    assert "placebo" not in tables(summarize(three), meta)


def test_bad_input_stops_with_its_cause(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--from-run", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "exactly one of --from-run" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no config.yaml"):
        main(["--from-run", str(tmp_path), "--out", str(tmp_path / "o")])
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not a records.csv"):
        main(["--from-csv", str(tmp_path / "bad.csv")])


@pytest.mark.slow  # 22 s: DeepSpeed's start and the learner's steps on the tiny model, 2 loaded cores
def test_quick_run_takes_real_adam_steps_from_one_restored_start(tmp_path, capsys):
    out = tmp_path / "q"
    summary = main(["--quick", "--lrs", "1e-3", "1e-2", "--out", str(out)])
    assert summary is not None
    saved = json.loads((out / "records.json").read_text())
    meta, records = saved["meta"], saved["records"]
    assert (
        meta["H_start_after_restore"] == meta["H_start_measure"]
    )  # every step started from the same weights
    assert len(records) == 2 * 2 * 4  # batches x lrs x arms: the placebo arm is in --quick
    by = {(r["batch"], r["lr"], r["arm"]): r for r in records}
    for b in range(2):
        seed = by[(b, 1e-3, "c2_placebo")]["placebo_seed"]
        assert seed == by[(b, 1e-3, "grpo_ds")]["placebo_seed"] == records[0]["placebo_seed"] + b  # per batch
        assert by[(b, 1e-3, "c2_placebo")]["lever_disp_norm"] > 0.0  # its step is not GRPO-ds's
        # the same M on as many tokens, other ones: a step that is neither GRPO-ds's nor C2's
        assert by[(b, 1e-3, "c2_placebo")]["dH"] != by[(b, 1e-3, "c2_lever")]["dH"]
        for arm in ("grpo_ds", "c2_lever", "lplus_lever", "c2_placebo"):
            small, large = by[(b, 1e-3, arm)], by[(b, 1e-2, arm)]
            # one Adam step from the same state is linear in lr: the restore and the lr both took
            assert large["disp_norm"] / small["disp_norm"] == pytest.approx(10.0, rel=1e-3)
            assert small["grad_norm"] == large["grad_norm"]  # the same gradient at the same start
            assert math.isfinite(small["sgd_per_lr"]) and small["sgd_per_lr"] == large["sgd_per_lr"]
        assert by[(b, 1e-3, "grpo_ds")]["lever_disp_norm"] == 0.0
        assert by[(b, 1e-3, "c2_lever")]["lever_disp_norm"] > 0.0
        assert by[(b, 1e-3, "lplus_lever")]["lever_disp_norm"] > 0.0
        # first order holds for a small real step (on the tiny model, lr 1e-3; at 1e-2 it does not)
        for arm in ("grpo_ds", "lplus_lever"):
            r = by[(b, 1e-3, arm)]
            assert r["dH"] / r["predicted"] == pytest.approx(1.0, abs=0.3)
    assert meta["measurement_floor"] < 1e-5
    assert set(summary) == {"0.001", "0.01"}
    assert "c2_lever - c2_placebo" in summary["0.001"]
    text = capsys.readouterr().out
    assert "criterion at lr 0.001" in text and "machine:" in text
    assert "placebo criterion at lr 0.001" in text
    # the table reprints from the CSV alone
    again = main(["--from-csv", str(out / "records.csv")])
    assert again is not None
    got = again["0.001"]["c2_lever - grpo_ds"]["measured"]["mean"]
    assert math.isclose(got, summary["0.001"]["c2_lever - grpo_ds"]["measured"]["mean"], rel_tol=1e-9)


@pytest.mark.slow  # 2 quick runs: DeepSpeed's start twice on the tiny model
def test_merge_measures_only_the_new_arm_and_checks_grpo_ds(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    main(["--quick", "--lrs", "1e-3", "--arms", "grpo_ds", "c2_lever", "lplus_lever", "--out", str(a)])
    full = json.loads((a / "records.json").read_text())["records"]
    assert {r["arm"] for r in full} == {"grpo_ds", "c2_lever", "lplus_lever"}
    summary = main(["--quick", "--lrs", "1e-3", "--arms", "c2_placebo", "--merge", str(a / "records.json"),
                    "--out", str(b)])  # fmt: skip
    saved = json.loads((b / "records.json").read_text())
    check = saved["meta"]["placebo_run"]["merge"]["check"]
    assert [c["batch"] for c in check] == [0] and check[0]["bit_identical"]  # grpo_ds re-measured once
    merged = saved["records"]
    assert len(merged) == 2 * 4 and merged[: len(full)] == full  # the earlier records kept as they were
    assert "c2_lever - c2_placebo" in summary["0.001"]
    assert "CHECK grpo_ds batch 0 lr 0.001" in capsys.readouterr().out
    # a run that is not the earlier one's is refused before it measures
    with pytest.raises(SystemExit):
        main(["--quick", "--lrs", "1e-2", "--arms", "c2_placebo", "--merge", str(a / "records.json"),
              "--out", str(tmp_path / "c")])  # fmt: skip
    assert "differs from the earlier one in --lrs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quick", "--lrs", "1e-3", "--arms", "c2_lever", "--merge", str(a / "records.json"),
              "--out", str(tmp_path / "c")])  # fmt: skip
    assert "already holds arms" in capsys.readouterr().err
