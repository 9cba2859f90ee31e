"""`stare-agent study --smoke` as a user runs it: SFT, calibration, two variants through the real
Trainer, then the figure, the CSV and the table; a second call reuses everything it finished. It
asserts nothing about which variant wins."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from stare_agent.config import ConfigError
from stare_research.study import plan, relative_h_tgt, run_numbers, summarize, tables_from_csv
from tests.stare_agent.test_cli import cli


@pytest.mark.slow  # 75 s: the study's smoke runs and their resume, on 2 loaded cores
def test_study_smoke_makes_figure_table_and_data_then_resumes(tmp_path, model_dir):
    root = tmp_path / "study"
    args = [
        "study",
        "--smoke",
        f"trainer.run_dir={root}",
        f"model.name_or_path={model_dir}",
        "sandbox.backend=local",
        "sandbox.pool_size=4",
        "env.max_response_tokens=32",
        "deepspeed.precision=fp32",
        "env.engine=transformers",  # the study's vLLM engine in the trainer: tests/stare_agent/engines/test_vllm_engine.py
        "data.eval_limit=2",
        # a random model never answers right: without dynamic sampling its zero-variance groups still
        # go through the whole step (advantages, gate, weights, update)
        "data.dynamic_sampling=false",
    ]
    done = cli(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[calibration] SFT policy on the first RL draws at temperature 1: mean reward" in done.stdout
    # the start's entropy on its own sampled tokens (the gate's H-bar) is printed and kept
    assert "entropy on its sampled tokens (the gate's H-bar)" in done.stdout
    assert json.loads((root / "calibration.json").read_text())["entropy"] > 0
    # the start is evaluated once per seed, as the runs evaluate, and leads every run as step 0
    assert "[start seed 0] held-out accuracy of the SFT policy: eval/avg@2" in done.stdout
    start = json.loads((root / "start_eval.json").read_text())
    assert set(start) == {"0"} and {"eval/avg@2", "eval_greedy/avg@1", "eval/bank_entropy"} <= set(start["0"])
    # the held-out entropy bank, sampled from the start once, read by every run at its evaluations
    assert (root / "entropy_bank.jsonl").is_file()
    for name in ("study.png", "study.csv", "study.md", "study.json", "calibration.json"):
        assert (root / name).is_file(), name
    assert (root / "study.png").stat().st_size > 20_000
    rows = list(csv.DictReader((root / "study.csv").open()))
    assert sorted((r["variant"], r["seed"], r["step"]) for r in rows) == [
        ("grpo-ds", "0", "0"),
        ("grpo-ds", "0", "1"),
        ("grpo-ds", "0", "2"),
        ("stare-o1", "0", "0"),
        ("stare-o1", "0", "1"),
        ("stare-o1", "0", "2"),
    ]
    assert all(float(r["eval/avg@2"]) == start["0"]["eval/avg@2"] for r in rows if r["step"] == "0")
    # both variants ran through the whole step: entropy measured, STARE's weights only for STARE
    assert all(float(r["entropy"]) > 0 for r in rows if r["step"] != "0")
    assert all(float(r["eval/bank_entropy"]) > 0 for r in rows if r["step"] in ("0", "2"))
    assert {r["variant"] for r in rows if r.get("stare/mean_weight")} == {"stare-o1"}
    table = (root / "study.md").read_text().splitlines()
    assert "held-out accuracy (sampled) " in table[0] and "held-out accuracy (greedy) " in table[0]
    # two tables (the main one, then the entropy's dynamics and STARE's reach), one row per variant
    assert [line.split("|")[1].strip() for line in table if line.startswith("| ") and "---" not in line] == [
        "variant",
        "grpo-ds",
        "stare-o1",
        "variant",
        "grpo-ds",
        "stare-o1",
    ]
    assert "entropy, first 5 steps" in table[-4] and "L+ raising entropy (1st order)" in table[-4]
    summary = json.loads((root / "study.json").read_text())["variants"]
    assert summary["stare-o1"]["entropy_final"]["n"] == 1
    assert "heldout_greedy_final" in summary["grpo-ds"]  # step 2 evaluates, sampled and greedy

    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[sft] reusing" in again.stdout
    assert again.stdout.count("finished earlier") == 2
    assert "[start seed" not in again.stdout  # the start's evaluation is reused too


def test_plan_gives_main_variants_all_seeds_seed_by_seed_and_rejects_unknown_names():
    assert plan(["open-loop-w2", "stare-c2", "grpo-ds"], seeds=3, ablation_seeds=1) == [
        ("stare-c2", 0),
        ("grpo-ds", 0),
        ("stare-c2", 1),
        ("grpo-ds", 1),
        ("stare-c2", 2),
        ("grpo-ds", 2),
        ("open-loop-w2", 0),
    ]
    with pytest.raises(ConfigError, match="unknown study variant 'stare-o2': use one of grpo-ds, stare-o1"):
        plan(["stare-o2"], seeds=1, ablation_seeds=1)


def test_run_numbers_skip_nan_steps_and_take_the_median_step_time():
    records = [
        {"step": 0, "eval/avg@2": 0.75, "eval_greedy/avg@1": 0.75},  # the start: not a trained step
        {"step": 1, "entropy": 0.4, "time/step_s": 30.0},
        {"step": 2, "entropy": float("nan"), "time/step_s": 10.0},  # a skipped step
        {"step": 3, "entropy": 0.2, "time/step_s": 20.0, "eval/avg@2": 0.25, "eval_greedy/avg@1": 0.5},
        {"step": 5, "entropy": 0.2, "time/step_s": 40.0, "eval/avg@2": 0.5, "eval_greedy/avg@1": 0.25},
    ]
    n = run_numbers(records)
    # trapezoid over steps 1-3-5: (2 * 0.3 + 2 * 0.2) / 4 = 0.25
    assert n["entropy_auc"] == pytest.approx(0.25) and n["entropy_final"] == 0.2
    assert (n["heldout_sampled_best"], n["heldout_sampled_final"]) == (0.5, 0.5)
    assert (n["heldout_greedy_best"], n["heldout_greedy_final"]) == (0.5, 0.25)
    assert n["seconds_per_step"] == 30.0  # median of 10, 20, 30, 40 (upper middle)


def test_run_numbers_give_the_entropy_at_both_ends_its_step_noise_and_stares_reach():
    H = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
    records = [{"step": i + 1, "entropy": h} for i, h in enumerate(H)]
    records[0].update({"stare/L_plus": 10.0, "stare/L_plus_raising": 0.5, "stare/mass_weight": 1.05})
    records[1].update({"stare/L_plus": 20.0, "stare/L_plus_raising": 0.25, "stare/mass_weight": 1.0})
    n = run_numbers(records)
    assert n["entropy_early"] == pytest.approx(0.3)  # steps 1-5: (0.1 + ... + 0.5) / 5
    assert n["entropy_late"] == pytest.approx(0.5)  # steps 3-7
    # population std of 0.1..0.7 around 0.4: sqrt((0.09 + 0.04 + 0.01 + 0 + 0.01 + 0.04 + 0.09) / 7)
    assert n["entropy_step_std"] == pytest.approx(0.2)
    assert n["L_plus"] == 15.0 and n["L_plus_raising"] == pytest.approx(0.375)
    assert n["mass_weight"] == pytest.approx(1.025)


def test_run_numbers_give_the_late_bank_entropy_the_reward_and_the_gates_share_of_steps():
    records = [
        {"step": 0, "eval/bank_entropy": 0.09},  # the start
        {"step": 1, "reward_mean": 0.5, "gate_on": 0},
        {"step": 2, "reward_mean": 0.25, "gate_on": 1, "eval/bank_entropy": 0.08},
        {"step": 3, "reward_mean": 0.75, "gate_on": 1},
        {"step": 4, "reward_mean": 1.0, "gate_on": 0, "eval/bank_entropy": 0.06},
        {"step": 5, "reward_mean": float("nan"), "gate_on": 0, "eval/bank_entropy": 0.05},
        # every group solved: nothing trained, and runs before 0.3 logged gate_on 0 there (now NaN): not an off gate
        {"step": 6, "reward_mean": 1.0, "gate_on": 0, "skipped": 1, "skip_reason": "no variance"},
    ]
    n = run_numbers(records)
    assert n["bank_entropy_start"] == 0.09
    assert n["bank_entropy_late"] == pytest.approx(0.055)  # the last 2 evaluations: (0.06 + 0.05) / 2
    assert n["reward"] == pytest.approx(0.7)  # (0.5 + 0.25 + 0.75 + 1.0 + 1.0) / 5, the NaN step left out
    assert n["gate_on"] == pytest.approx(0.4)  # on at 2 of 5 trained steps; the skipped step is not "off"


def test_a_relative_h_tgt_is_a_multiple_of_the_calibrated_entropy():
    assert relative_h_tgt([], 0.7, {"entropy": 0.1}) == ["algorithm.H_tgt=0.07"]
    with pytest.raises(ConfigError, match="needs a factor > 0 and a calibration with a positive entropy"):
        relative_h_tgt([], 0.7, {"entropy": float("nan")})


def test_summaries_over_seeds_give_the_sample_sd_and_a_t_interval():
    run = lambda h: [{"step": 1, "entropy": h}]  # noqa: E731
    out = summarize({0: run(0.1), 1: run(0.2), 2: run(0.3)})["entropy_late"]
    # mean 0.2, sample SD sqrt((0.01 + 0 + 0.01) / 2) = 0.1, half-width t_{0.975, 2} 0.1 / sqrt 3 = 0.2484
    assert (out["mean"], out["n"]) == (pytest.approx(0.2), 3)
    assert out["sd"] == pytest.approx(0.1) and out["ci95"] == pytest.approx(4.303 * 0.1 / 3**0.5)


def test_engine_auto_is_resolved_once_for_every_run(tmp_path, monkeypatch):
    """A vLLM worker that fails to start in one run must not put that run on another engine."""
    from stare_agent.engines import vllm_engine
    from stare_research import study as study_module

    runs: list[list[str]] = []
    monkeypatch.setattr(vllm_engine, "pick_engine", lambda requested, python=None: "vllm")
    monkeypatch.setattr(study_module, "cold_start", lambda config, root: root / "sft_model")
    monkeypatch.setattr(
        study_module,
        "calibrate",
        lambda *a: {"mean_reward": 0.5, "groups_with_variance": 1.0, "entropy": 0.1},
    )
    monkeypatch.setattr(
        study_module,
        "start_eval",
        lambda path, overrides, seeds, sft, root: runs.append(list(overrides)),
    )
    monkeypatch.setattr(
        study_module,
        "train_one",
        lambda path, overrides, variant, seed, sft, root: runs.append(list(overrides)),
    )
    monkeypatch.setattr(
        study_module, "write_report", lambda root, *a, **k: (root / "study.md").write_text("") or {}
    )
    study_module.study(
        overrides=[f"trainer.run_dir={tmp_path}", "env.engine=auto"],
        variants=["grpo-ds", "stare-o1"],
        seeds=1,
    )
    assert len(runs) == 3 and all(r[-1] == "env.engine=vllm" for r in runs)  # the start's evaluation too


def test_report_only_tabulates_the_runs_logged_so_far(tmp_path):
    from stare_research.study import study

    (tmp_path / "calibration.json").write_text(
        json.dumps(
            {"problems": 4, "samples_per_problem": 4, "temperature": 1.0, "mean_reward": 0.4, "entropy": 0.1}
        )
    )
    for run, steps in (("grpo-ds-s0", 3), ("stare-o1-s0", 1)):  # one finished, one just started
        (tmp_path / "runs" / run).mkdir(parents=True)
        rows = [
            {"step": i, "entropy": 0.1 * i, "reward_mean": 0.5, "time/step_s": 10.0}
            for i in range(1, steps + 1)
        ]
        (tmp_path / "runs" / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = study(overrides=[f"trainer.run_dir={tmp_path}"], report_only=True)
    assert set(report["variants"]) == {"grpo-ds", "stare-o1"}  # the other runs have not started
    table = (tmp_path / "study.md").read_text()
    assert "| grpo-ds | 1 | 3 | 0.200 |" in table and "| stare-o1 | 1 | 1 | 0.100 |" in table
    assert (tmp_path / "study.png").stat().st_size > 0
    with pytest.raises(ConfigError, match="no study in .* run `stare-agent study` first"):
        study(overrides=[f"trainer.run_dir={tmp_path / 'none'}"], report_only=True)


def test_the_other_entropy_controls_are_arms_named_on_demand():
    from stare_research.config import load_research_config as load_config
    from stare_research.study import PAPER_VARIANTS, VARIANTS

    others = {"entropy-bonus", "kl-cov", "clip-cov", "forking-tokens"}
    others |= {"steer", "stapo", "entroadv", "adaptive-entropy", "first-order"}  # token weightings (issue 44)
    assert others <= set(VARIANTS) and not others & set(PAPER_VARIANTS)
    for name in others:
        assert load_config(None, list(VARIANTS[name])).algorithm.name == name.replace("-", "_")


def test_the_raising_l_plus_arms_differ_from_their_base_in_the_rule_alone():
    from stare_research.config import load_research_config as load_config
    from stare_research.study import PAPER_VARIANTS, VARIANTS

    for arm, base in (("stare-o1-raising", "stare-o1"), ("stare-o1-w3-drawn-raising", "stare-o1-w3-drawn")):
        assert arm not in PAPER_VARIANTS
        a, b = (load_config(None, list(VARIANTS[v])) for v in (arm, base))
        assert (a.research.L_plus_rule, b.research.L_plus_rule) == ("top_k_raising", "top_k")
        assert a.algorithm == b.algorithm and a.research.gate_batch == b.research.gate_batch
        assert a.algorithm.variant == "O1"


def test_l_pluss_placebo_arms_differ_from_their_stare_arms_in_the_l_plus_rule_alone():
    from stare_research.config import load_research_config as load_config
    from stare_research.study import PAPER_VARIANTS, VARIANTS

    for arm, base in (("stare-o1-placebo", "stare-o1"), ("stare-o1-w3-drawn-placebo", "stare-o1-w3-drawn")):
        a, b = (load_config(None, list(VARIANTS[v])) for v in (arm, base))
        assert (a.research.L_plus_rule, b.research.L_plus_rule) == ("random", "top_k")
        assert a.algorithm == b.algorithm and a.research.gate_batch == b.research.gate_batch
        assert arm not in PAPER_VARIANTS


def test_c2s_placebo_arm_differs_from_c2_in_the_l_minus_rule_alone():
    from stare_research.config import load_research_config as load_config
    from stare_research.study import PAPER_VARIANTS, VARIANTS, plan

    a, b = (load_config(None, list(VARIANTS[v])) for v in ("stare-c2-placebo", "stare-c2"))
    assert (a.research.L_minus_rule, b.research.L_minus_rule) == ("random", "top_k")
    assert (
        a.algorithm == b.algorithm
        and a.algorithm.variant == "C2"
        and "stare-c2-placebo" not in PAPER_VARIANTS
    )
    # the closed loop's three arms on one seed (a study run again with --seeds 2 --ablation-seeds 2 adds seed 1)
    arms = ["grpo-ds", "stare-c2", "stare-c2-placebo"]
    assert plan(arms, seeds=1, ablation_seeds=1) == [(arm, 0) for arm in arms]


def test_the_tables_of_a_study_csv_are_redone_with_todays_intervals(tmp_path):
    # Two seeds of two variants, each led by its seed's start (step 0). Entropy AUC/step of two steps is
    # their mean: GRPO-ds 0.3 and 0.4, STARE-O1 0.4 and 0.5, so the paired difference is 0.1 on both seeds.
    rows = [
        ("grpo-ds", 0, 0, "", "0.5"), ("grpo-ds", 0, 1, "0.2", ""), ("grpo-ds", 0, 2, "0.4", ""),
        ("grpo-ds", 1, 0, "", "0.75"), ("grpo-ds", 1, 1, "0.4", ""), ("grpo-ds", 1, 2, "0.4", ""),
        ("stare-o1", 0, 0, "", "0.5"), ("stare-o1", 0, 1, "0.3", ""), ("stare-o1", 0, 2, "0.5", ""),
        ("stare-o1", 1, 0, "", "0.75"), ("stare-o1", 1, 1, "0.5", ""), ("stare-o1", 1, 2, "0.5", ""),
    ]  # fmt: skip
    path = tmp_path / "study.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "seed", "step", "entropy", "eval/avg@2"])
        writer.writerows(rows)
    table = tables_from_csv(path)
    # start: mean 0.625, SD sqrt(2 x 0.125^2) = 0.177, half-width t(1) 12.706 x 0.177 / sqrt(2) = 1.588
    assert table.startswith(
        "Start (the study's step 0), held-out accuracy (sampled) 0.625 ± 1.588 (95 % t interval, SD 0.177)"
        " over 2 seeds."
    )
    # Late entropy (both steps) and AUC: GRPO-ds 0.3, 0.4 -> mean 0.35, SD 0.071, half-width
    # 12.706 x 0.0707 / sqrt(2) = 0.635; STARE-O1 0.45 with the same spread; paired: 0.1 on both seeds
    ci = "± 0.635 (SD 0.071)"
    assert f"| grpo-ds | 2 | 2 | 0.350 {ci} | 0.350 {ci} | - |" in table
    assert f"| stare-o1 | 2 | 2 | 0.450 {ci} | 0.450 {ci} | 0.100 ± 0.000 (SD 0.000) |" in table
    with pytest.raises(ConfigError, match="no study CSV at .*: pass the study.csv a study wrote"):
        tables_from_csv(tmp_path / "none.csv")
    (tmp_path / "bad.csv").write_text("name,value\nx,1\n")
    with pytest.raises(ConfigError, match="is not a study CSV \\(needs variant, seed, step columns\\)"):
        tables_from_csv(tmp_path / "bad.csv")


def _drawn_gate_csv(path):
    """GRPO-ds and a drawn-gate variant, one seed, H_tgt 0.35. The drawn gate reads the whole draw
    (`entropy` 0.5, 0.3: off, then on), and logs the kept batch's H-bar (`stare/entropy_kept` 0.1, 0.3),
    on which the gate would have been on at both steps."""
    header = ["variant", "seed", "step", "entropy", "stare/entropy_kept", "gate_on", "H_tgt"]
    rows = [
        ("grpo-ds", 0, 1, 0.2, "", 1, 0.35), ("grpo-ds", 0, 2, 0.4, "", 0, 0.35),
        ("stare-o1-w3-drawn", 0, 1, 0.5, 0.1, 0, 0.35), ("stare-o1-w3-drawn", 0, 2, 0.3, 0.3, 1, 0.35),
    ]  # fmt: skip
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_the_study_tables_give_a_drawn_gates_own_reading_in_its_entropy_columns(tmp_path):
    """`--tables-of` reads `entropy` for every run, and under research.gate_batch=drawn that IS the
    drawn gate's estimator (the whole draw's sampled entropy): the shipped closed-loop CSVs' drawn runs
    turned the gate on exactly when it was below H_tgt, which their kept-batch H-bar does not give."""
    from stare_research.tables import read_runs

    table = tables_from_csv(_drawn_gate_csv(tmp_path / "study.csv"))
    # whole draw 0.5, 0.3: late mean 0.4, AUC 0.4, minus GRPO-ds's AUC 0.3 (its kept batch's: 0.2, 0.4)
    assert "| stare-o1-w3-drawn | 1 | 2 | 0.400 | 0.400 | 0.100 |" in table
    # entropy over the first 5 and the last 5 steps, its SD over steps, no bank, the gate on at 1 of 2
    assert "| stare-o1-w3-drawn | 1 | 0.400 | 0.400 | 0.100 | - | 0.500 |" in table

    docs = Path(__file__).resolve().parents[2] / "docs" / "research"
    checked = 0
    for name in ("closed_loop.csv", "closed_loop_sft48.csv"):
        for (variant, _), records in read_runs(docs / name).items():
            trained = [r for r in records if r["step"] > 0 and not r.get("skipped") and "gate_on" in r]
            if variant != "stare-o1-w3-drawn":
                continue
            assert all(int(r["gate_on"]) == int(r["entropy"] < r["H_tgt"]) for r in trained)
            assert any(int(r["gate_on"]) != int(r["stare/entropy_kept"] < r["H_tgt"]) for r in trained)
            checked += 1
    assert checked == 2


def test_the_study_tables_set_both_estimators_side_by_side_where_a_gate_reads_the_whole_draw(tmp_path):
    table = tables_from_csv(_drawn_gate_csv(tmp_path / "study.csv"))
    assert "but the whole draw's for stare-o1-w3-drawn (research.gate_batch=drawn)" in table
    assert (
        "| variant | seeds | the gate reads | gate's reading, last 5 steps | gate's reading AUC/step "
        "| kept batch (the paper's H-bar), last 5 steps | kept-batch AUC/step "
        "| kept-batch AUC - GRPO-ds's, same seed |"
    ) in table
    assert "| grpo-ds | 1 | kept batch | 0.300 | 0.300 | 0.300 | 0.300 | - |" in table
    # kept batch 0.1, 0.3: late 0.2, AUC 0.2, minus GRPO-ds's 0.3 on the same estimator: -0.1 (the
    # gate's reading says +0.1: two estimators)
    assert "| stare-o1-w3-drawn | 1 | whole draw | 0.400 | 0.400 | 0.200 | 0.200 | -0.100 |" in table


def test_the_study_tables_of_kept_gates_alone_have_no_estimator_table(tmp_path):
    path = tmp_path / "study.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["variant", "seed", "step", "entropy"], ["grpo-ds", 0, 1, 0.2]])
    assert "the gate reads" not in tables_from_csv(path)
