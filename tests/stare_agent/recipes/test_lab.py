"""The dynamics lab: seeded, runs the project's algorithm functions, summaries with intervals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stare_agent.recipes.lab import VARIANTS, LabConfig, format_table, lab, main, run, run_summary

SMALL = LabConfig(contexts=8, positions=4, vocab=5, prompts=4, samples=4, steps=6)


def test_a_run_is_reproducible_from_its_seed():
    assert run(SMALL) == run(SMALL)
    assert run(SMALL) != run(replace(SMALL, seed=1))


def test_with_the_gate_off_stare_is_grpo_ds_bit_for_bit():
    # H_tgt far below the entropy: the gate stays off, every weight is 1
    grpo = run(replace(SMALL, algorithm="grpo_ds", H_tgt=1e-6))
    stare = run(replace(SMALL, H_tgt=1e-6, W=10.0))
    assert [r["policy_entropy"] for r in grpo] == [r["policy_entropy"] for r in stare]
    assert all(r["gate_on"] == 0.0 and r["mass_weight"] == 1.0 for r in stare)


def test_the_open_loop_and_the_drawn_gate():
    open_loop = run(replace(SMALL, gate="always_on", W=2.0))
    assert all(r["gate_on"] == 1.0 and r["mass_weight"] > 1.0 for r in open_loop)
    # a target between the kept and the drawn entropy would tell them apart; here: both are logged
    drawn = run(replace(SMALL, gate_batch="drawn", H_tgt=100.0))
    assert all(r["gate_on"] == 1.0 and "drawn_entropy" in r and "kept_entropy" in r for r in drawn)


@pytest.mark.parametrize("name", ["random", "c2", "o1-raising"])
def test_every_kind_of_variant_runs(name):
    records = run(replace(SMALL, **VARIANTS[name]))
    assert len(records) == SMALL.steps and 0 <= records[-1]["reward"] <= 1


@pytest.mark.parametrize(
    "name", ["clip-higher-0.4", "entropy-bonus-0.01", "kl-cov", "clip-cov-r2%", "forking"]
)
def test_the_other_entropy_controls_run_with_minibatches(name):
    records = run(replace(SMALL, minibatches=2, **VARIANTS[name]))
    assert len(records) == SMALL.steps and 0 <= records[-1]["reward"] <= 1
    if name in ("kl-cov", "clip-cov-r2%", "forking"):
        assert any("frac_selected" in r for r in records)
        assert all(0 <= r["frac_selected"] <= 1 for r in records if "frac_selected" in r)


def test_one_minibatch_of_kl_cov_is_grpo_ds():
    # on-policy, one optimizer step: |logp - logp_old| is 0 with gradient 0
    grpo = run(replace(SMALL, algorithm="grpo_ds"))
    kl_cov = run(replace(SMALL, algorithm="kl_cov", kl_cov_k=0.5))
    assert grpo == [{k: v for k, v in r.items() if k != "frac_selected"} for r in kl_cov]


def test_the_drift_task_moves_solved_targets_and_summaries_average_the_tail():
    records = run(replace(SMALL, task="drift", steps=20))
    numbers = run_summary(records)
    tail = records[-2:]  # the last 10 % of 20 steps
    assert numbers["policy_entropy"] == pytest.approx(sum(r["policy_entropy"] for r in tail) / 2)
    assert numbers["gate_on"] == pytest.approx(sum(r["gate_on"] for r in records) / 20)


def test_lab_writes_a_table_with_intervals_and_a_figure(tmp_path, capsys):
    main(
        [
            "--variants",
            "grpo-ds,o1",
            "--tasks",
            "mod7",
            "--seeds",
            "2",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    table = (tmp_path / "lab_mod7.md").read_text()
    assert table.startswith("| variant | policy H (last 10 %)") and "| grpo-ds | " in table and " ± " in table
    assert (tmp_path / "lab.png").stat().st_size > 0 and (tmp_path / "lab_mod7.json").is_file()
    (tmp_path / "lab.png").unlink()
    main(["--tasks", "mod7", "--figure-only", "--out", str(tmp_path)])  # from the saved runs alone
    assert (tmp_path / "lab.png").stat().st_size > 0
    capsys.readouterr()
    main(["--tasks", "mod7", "--table-only", "--out", str(tmp_path)])  # one table over the tasks
    paired = capsys.readouterr().out
    assert paired.startswith("| variant | mod7 H | mod7 reward | mod7 ms/step |") and "| o1 | " in paired
    with pytest.raises(SystemExit):
        main(["--variants", "bogus"])
    assert "unknown variants ['bogus']" in capsys.readouterr().err


def test_format_table_of_one_seed_gives_the_mean_alone(tmp_path):
    result = lab(["grpo-ds"], 1, steps=2, out_dir=tmp_path)
    assert " ± " not in format_table(result)
