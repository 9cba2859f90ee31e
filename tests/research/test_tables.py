"""stare_research.tables' paired differences over seeds, against numbers worked by hand."""

from __future__ import annotations

import csv

import pytest

from stare_research.tables import main, paired_over_seeds, paired_table

FIELDS = ("variant", "seed", "step", "entropy", "eval/bank_entropy", "skipped", "H_tgt")


def _write(path, runs):
    """``runs``: (variant, seed) -> (bank at steps 3, 6, 9, 12; H-bar at steps 1..12; extra rows)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for (variant, seed), (bank, sampled, extra) in runs.items():
            w.writerow({"variant": variant, "seed": seed, "step": 0, "eval/bank_entropy": 0.5, "H_tgt": 0.2})
            for step in range(1, 13):
                row = {
                    "variant": variant,
                    "seed": seed,
                    "step": step,
                    "entropy": sampled[step - 1],
                    "skipped": 0,
                }
                if step % 3 == 0:
                    row["eval/bank_entropy"] = bank[step // 3 - 1]
                w.writerow({**row, "H_tgt": 0.2})
            for row in extra:
                w.writerow({"variant": variant, "seed": seed, "H_tgt": 0.2, **row})


def test_paired_differences_use_the_late_windows_and_an_interval_between_seeds(tmp_path):
    # GRPO-ds: late bank (last 3 of 4 evals) 0.30, late H-bar (last 10 of 12 steps) 0.20 on every seed;
    # the first eval (0.9) and the first two steps (9.0) fall outside the windows.
    grpo = ([0.9, 0.30, 0.30, 0.30], [9.0, 9.0] + [0.2] * 10, [])
    # C2: late bank 0.32, 0.31, 0.33 (differences +0.02, +0.01, +0.03: mean 0.02, SD 0.01, 95 % t
    # half-width 4.303 x 0.01 / sqrt(3) = 0.02484, so the interval holds 0); H-bar 0.25 on every seed
    # (differences +0.05, SD 0: above 0). A skipped step at the end (H-bar 5.0) is not a trained step.
    skipped = [{"step": 13, "entropy": 5.0, "skipped": 1}]
    c2 = {
        0: ([0.0, 0.31, 0.32, 0.33], [0.25] * 12, skipped),
        1: ([0.0, 0.31, 0.31, 0.31], [0.25] * 12, skipped),
        2: ([0.0, 0.33, 0.33, 0.33], [0.25] * 12, skipped),
    }
    runs = {("grpo-ds", s): grpo for s in range(3)} | {("stare-c2", s): v for s, v in c2.items()}
    runs[("grpo-ds", 3)] = grpo  # a seed the other variant lacks does not count
    path = tmp_path / "study.csv"
    _write(path, runs)

    paired = paired_over_seeds(path, "stare-c2", "grpo-ds")
    assert paired["seeds"] == [0, 1, 2]
    assert paired["bank"]["diffs"] == pytest.approx([0.02, 0.01, 0.03])
    bank = paired["bank"]["stats"]
    assert (bank["mean"], bank["sd"], bank["n"]) == (pytest.approx(0.02), pytest.approx(0.01), 3)
    assert bank["ci95"] == pytest.approx(4.303 * 0.01 / 3**0.5, rel=1e-6)  # t(0.975, 2) as tabled: 4.303
    assert paired["sampled"]["diffs"] == pytest.approx([0.05] * 3)

    table = paired_table(path, [("stare-c2", "grpo-ds")])
    assert "| stare-c2 - grpo-ds | bank entropy, last 3 evals | s0 +0.0200, s1 +0.0100, s2 +0.0300 |" in table
    assert "0.0200 ± 0.0248 (n 3) | no |" in table and "0.0500 ± 0.0000 (n 3) | yes |" in table


def test_a_pair_without_a_common_seed_stops_with_its_cause(tmp_path, capsys):
    path = tmp_path / "study.csv"
    _write(path, {("grpo-ds", 0): ([0.3] * 4, [0.2] * 12, [])})
    with pytest.raises(ValueError, match=r"no seed with both 'stare-c2' and 'grpo-ds' \(variants: grpo-ds\)"):
        paired_over_seeds(path, "stare-c2", "grpo-ds")
    with pytest.raises(SystemExit) as stop:
        main([str(path), "--paired", "stare-c2", "grpo-ds"])
    assert stop.value.code == 2 and "error:" in capsys.readouterr().err
