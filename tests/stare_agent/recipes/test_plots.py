"""The dashboard draws the rollout-correction, asynchronous-rollout and idle-time panels of a run
that logged them, and no such panel for a run that did not."""

from __future__ import annotations

import math

from stare_agent.metrics import StepLogger
from stare_agent.recipes.plots import dashboard_figure

CORRECTION = "Rollout correction (importance weights for the engine's mismatch)"
STALENESS = "Asynchronous rollouts: policy staleness"
IDLE = "Idle time (waiting for the other side)"


def _panels(run_dir):
    return {ax.get_title(): ax for ax in dashboard_figure([run_dir]).axes if ax.get_visible()}


def _labels(ax):
    return [line.get_label() for line in ax.get_lines()]


def test_a_run_that_logged_correction_staleness_and_idle_time_gets_their_panels(tmp_path):
    with StepLogger(tmp_path, backends=()) as log:
        for step, skipped in ((1, 0), (2, 1), (3, 0)):
            log.log(step, {
                "entropy": math.nan if skipped else 0.05, "reward_mean": 0.5, "accuracy": 0.5, "skipped": skipped,
                "rollout_correction/weight_mean": 0.98, "rollout_correction/capped_frac": 0.01 * step,
                "async/staleness_mean": 0.5, "async/staleness_max": 1.0,
                "time/learner_idle_frac": 0.2, "time/engine_idle_frac": 0.6,
            })  # fmt: skip
    panels = _panels(tmp_path)
    assert _labels(panels[CORRECTION]) == ["rollout_correction/weight_mean", "rollout_correction/capped_frac"]
    capped = list(panels[CORRECTION].get_lines()[1].get_ydata())
    assert capped[0] == 0.01 and math.isnan(capped[1]) and capped[2] == 0.03  # an update quantity: a gap
    assert _labels(panels[STALENESS]) == ["async/staleness_mean", "async/staleness_max"]
    assert panels[STALENESS].get_ylabel() == "steps behind"
    assert _labels(panels[IDLE]) == ["time/learner_idle_frac", "time/engine_idle_frac"]
    assert list(panels[IDLE].get_lines()[1].get_ydata()) == [0.6] * 3  # measured on every step


def test_a_run_without_them_gets_none_of_those_panels(tmp_path):
    with StepLogger(tmp_path, backends=()) as log:
        log.log(
            1, {"entropy": 0.05, "reward_mean": 0.5, "accuracy": 0.5, "rollout_correction/masked_frac": 0.1}
        )
    panels = _panels(tmp_path)
    assert STALENESS not in panels and IDLE not in panels
    assert _labels(panels[CORRECTION]) == ["rollout_correction/masked_frac"]  # MIS logs only its own key
    with StepLogger(tmp_path / "bare", backends=()) as log:
        log.log(1, {"entropy": 0.05, "reward_mean": 0.5})
    assert not {CORRECTION, STALENESS, IDLE} & set(_panels(tmp_path / "bare"))


def test_a_run_with_ppo_mini_batches_gets_their_panel_and_its_per_step_list_is_no_trouble(tmp_path):
    PPO = "PPO mini-batches: ratio away from 1"
    with StepLogger(tmp_path, backends=()) as log:
        for step in (1, 2):
            log.log(step, {
                "entropy": 0.05, "reward_mean": 0.5, "accuracy": 0.5, "skipped": 0,
                "actor/pg_clipfrac_max": 0.1 * step, "actor/ppo_kl_max": -0.01,
                "ppo/per_mini_batch": [{"epoch": 0, "mini_batch": 0, "actor/pg_clipfrac": 0.0}],
            })  # fmt: skip
    panels = _panels(tmp_path)
    assert _labels(panels[PPO]) == ["actor/pg_clipfrac_max", "actor/ppo_kl_max"]
    assert list(panels[PPO].get_lines()[0].get_ydata()) == [0.1, 0.2]
    with StepLogger(tmp_path / "one_step", backends=()) as log:
        log.log(1, {"entropy": 0.05, "reward_mean": 0.5, "actor/pg_clipfrac": 0.0})
    assert PPO not in _panels(tmp_path / "one_step")
