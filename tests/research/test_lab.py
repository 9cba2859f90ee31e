"""The dynamics lab: seeded, runs the project's algorithm functions, summaries with intervals."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from stare_agent.algorithms import logprobs_and_entropy_from_logits
from stare_research.lab import (
    VARIANTS,
    LabConfig,
    format_table,
    format_target_sweep,
    lab,
    main,
    make_policy,
    run,
    run_summary,
)

SMALL = LabConfig(contexts=8, positions=4, vocab=5, prompts=4, samples=4, steps=6)
SMALL_TF = replace(SMALL, policy="transformer", d_model=8, heads=2)


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
    "name",
    ["clip-higher-0.4", "entropy-bonus-0.01", "kl-cov", "clip-cov-r2%", "forking"]
    + ["steer", "stapo", "entroadv", "adaptive-entropy", "first-order"],
)
def test_the_other_entropy_controls_run_with_minibatches(name):
    records = run(replace(SMALL, minibatches=2, **VARIANTS[name]))
    assert len(records) == SMALL.steps and 0 <= records[-1]["reward"] <= 1
    if name in ("kl-cov", "clip-cov-r2%", "forking", "stapo"):
        assert any("frac_selected" in r for r in records)
        assert all(0 <= r["frac_selected"] <= 1 for r in records if "frac_selected" in r)


def test_the_token_weightings_that_change_nothing_are_grpo_ds_bit_for_bit():
    # the first-order weighting with its gate off (all weights 1), the adaptive entropy coefficient
    # that never leaves its start c = 0 (no bonus)
    grpo = run(replace(SMALL, algorithm="grpo_ds", H_tgt=1e-6))
    gate_off = run(replace(SMALL, algorithm="first_order", H_tgt=1e-6))
    frozen = run(replace(SMALL, algorithm="adaptive_entropy", H_tgt=1e-6, adaptive_entropy_delta=0.0))
    assert grpo == [{k: v for k, v in r.items() if k != "mean_weight"} for r in gate_off]
    assert grpo == [{k: v for k, v in r.items() if k != "entropy_coef"} for r in frozen]


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


def test_a_transformer_run_is_reproducible_from_its_seed():
    assert run(SMALL_TF) == run(SMALL_TF)
    assert run(SMALL_TF) != run(replace(SMALL_TF, seed=1))
    records = run(replace(SMALL_TF, **VARIANTS["o1-W3-drawgate"]))
    assert all("kept_entropy" in r and "mass_weight" in r for r in records if r["kept_groups"])


def test_the_transformer_samples_from_the_logits_the_loss_scores():
    # the cached token-by-token sampler and the teacher-forced pass the loss uses see the same
    # distributions: a token that saw a later one (no causal mask) or a shifted position would differ
    policy = make_policy(SMALL_TF, torch.Generator().manual_seed(0))
    contexts = torch.arange(8)
    tokens, H = policy.sample(contexts, 4, torch.Generator().manual_seed(1))  # [8, 4, 4] each
    with torch.no_grad():
        logits = policy.logits(contexts.repeat_interleave(4), tokens.view(32, 4))
    _, entropy = logprobs_and_entropy_from_logits(logits, tokens.view(32, 4))
    torch.testing.assert_close(entropy.view(8, 4, 4), H, rtol=0, atol=1e-5)
    # and the first position depends on the context alone: equal for the 4 samples of a context
    assert torch.equal(H[:, :, 0], H[:, :1, 0].expand(8, 4))


@pytest.mark.parametrize(("policy", "shared"), [("table", False), ("transformer", True)])
def test_only_the_transformer_moves_other_contexts_distributions(policy, shared):
    # one gradient step on one token of context 0: the table changes context 0's row alone
    pol = make_policy(replace(SMALL_TF, policy=policy), torch.Generator().manual_seed(0))
    tokens = torch.zeros(2, 4, dtype=torch.long)
    before = pol.logits(torch.tensor([0, 1]), tokens).detach()
    pol.logits(torch.tensor([0]), tokens[:1])[0, 0, 2].backward()
    with torch.no_grad():
        for p in pol.parameters():
            p -= 0.1 * p.grad
    after = pol.logits(torch.tensor([0, 1]), tokens).detach()
    assert not torch.equal(after[0], before[0])
    assert torch.equal(after[1], before[1]) is not shared


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="LabConfig.policy is 'mlp': choose 'table' or 'transformer'"):
        run(replace(SMALL, policy="mlp"))


def test_the_lab_runs_the_transformer_policy_and_saves_each_variant(tmp_path, capsys):
    main(
        ["--policy", "transformer", "--variants", "grpo-ds,o1", "--tasks", "drift", "--seeds", "1"]
        + ["--steps", "2", "--log-every", "1", "--out", str(tmp_path)]
    )
    saved = json.loads((tmp_path / "lab_drift.json").read_text())
    assert saved["policy"] == "transformer" and list(saved["summary"]) == ["grpo-ds", "o1"]
    assert saved["config"]["policy"] == "transformer" and len(saved["curves"]["o1"][0]) == 2
    # a study split over two processes: the second's variants are merged into the first's table
    common = [
        "--policy",
        "transformer",
        "--tasks",
        "drift",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--log-every",
        "1",
    ]
    main(common + ["--variants", "random", "--out", str(tmp_path / "b")])
    capsys.readouterr()
    main(["--tasks", "drift", "--table-only", "--out", str(tmp_path), "--merge", str(tmp_path / "b")])
    table = capsys.readouterr().out
    assert "| random | " in table and "| grpo-ds | " in table and "transformer policy, task drift" in table
    (tmp_path / "other-task").mkdir()  # a process that ran another task: nothing of drift to add
    main(
        ["--tasks", "drift", "--table-only", "--out", str(tmp_path), "--merge", str(tmp_path / "other-task")]
    )
    assert "| random | " not in capsys.readouterr().out
    main(
        ["--policy", "transformer", "--tasks", "drift", "--seeds", "1", "--steps", "3"]
        + ["--variants", "c2", "--out", str(tmp_path / "c")]
    )
    with pytest.raises(SystemExit, match="its steps differs"):
        main(["--tasks", "drift", "--table-only", "--out", str(tmp_path), "--merge", str(tmp_path / "c")])


def test_the_target_sweep_table_pairs_seeds_by_hand():
    """Two seeds, 10 records each (the last-10 % tail is the last record): the whole-draw gate's level
    at H_tgt 0.15 / 0.3 / 0.45 is (0.20, 0.22) / (0.30, 0.31) / (0.32, 0.36); the paired differences
    0.12 and 0.14 have mean 0.13, SD 0.01414, half-width 12.706 * 0.01414 / sqrt 2 = 0.127, share
    0.13 / 0.30 = 0.43. A sweep with a target missing is left out; no sweep: no table."""

    def runs(last: list[float]) -> list[list[dict[str, float]]]:
        return [
            [{"step": i, "policy_entropy": 1.0, "drawn_entropy": 9.0 if i < 9 else h} for i in range(10)]
            for h in last
        ]

    curves = {
        "o1-W3-drawgate-H0.15": runs([0.20, 0.22]),
        "o1-W3-drawgate": runs([0.30, 0.31]),
        "o1-W3-drawgate-H0.45": runs([0.32, 0.36]),
        "o1-W5-drawgate": runs([0.4, 0.4]),  # its other targets did not run
    }
    table = format_target_sweep({"curves": curves}).splitlines()
    assert len(table) == 3 and table[2].startswith(
        "| o1-W3-drawgate (whole-draw H) | 0.210 ± 0.127 | 0.305 ± "
    )
    assert table[2].endswith("| 0.130 ± 0.127 | 0.43 | 0.000 ± 0.000 |")  # the policy H: 1.0 throughout
    assert format_target_sweep({"curves": {"grpo-ds": runs([0.1])}}) == ""
