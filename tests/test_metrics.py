"""Step metrics, the JSONL/TensorBoard logger, policy entropy and the plots."""

from __future__ import annotations

import json

import pytest
import torch

from envs.trajectory import TrajectoryBuilder
from stare_agent.metrics import StepLogger, policy_entropy, read_metrics, reflection_counts, rollout_metrics
from stare_agent.models import tiny_model
from stare_agent.plots import plot_dashboard


def _trajectory(prompt, segments, reward=0.0, **info):
    b = TrajectoryBuilder(prompt)
    for ids, mask in segments:
        b.append(ids, mask, [-1.0] * len(ids) if mask else None)
    return b.build(reward=reward, info=info)


def test_reflection_counts_whole_words_case_insensitive():
    counts = reflection_counts(["Wait, check it. WAIT", "checking is not check", "butter"])
    assert counts["wait"] == pytest.approx(2 / 3)
    assert counts["check"] == pytest.approx(2 / 3)  # "checking" is not "check"
    assert counts["but"] == 0.0  # "butter" is not "but"


def test_rollout_metrics_by_hand():
    calls = [{"timed_out": True, "error_type": "TimeoutError"}, {"timed_out": False, "error_type": None}]
    t1 = _trajectory(
        [1],
        [([5, 6], 1), ([7, 8, 9], 0), ([4], 1)],
        reward=1.0,
        correct=True,
        num_tool_calls=2,
        tool_calls=calls,
    )
    t2 = _trajectory([1], [([5], 1)], reward=0.0, correct=False, num_tool_calls=0, truncated=True)
    m = rollout_metrics([t1, t2])
    assert m["reward_mean"] == 0.5 and m["accuracy"] == 0.5
    assert m["response_length_mean"] == (6 + 1) / 2
    assert m["sampled_tokens_mean"] == (3 + 1) / 2
    assert m["tool_calls_per_episode"] == 1.0
    assert m["tool_timeouts_per_episode"] == 0.5 and m["tool_errors_per_episode"] == 0.5
    assert m["truncated_fraction"] == 0.5


def test_logger_writes_jsonl_and_tensorboard_and_read_keeps_last_record_per_step(tmp_path):
    with StepLogger(tmp_path) as log:
        log.log(1, {"reward_mean": 0.25, "gate_on": True, "entropy": torch.tensor(0.5)})
        log.log(2, {"reward_mean": 0.5})
        log.log(2, {"reward_mean": 0.75})  # a resumed run re-logging a step
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward_mean": 0.25, "gate_on": 1, "entropy": 0.5}
    assert [r["reward_mean"] for r in read_metrics(tmp_path)] == [0.25, 0.75]
    assert any((tmp_path / "tensorboard").iterdir())
    with pytest.raises(FileNotFoundError, match="stare-agent train"):
        read_metrics(tmp_path / "nope")


def test_policy_entropy_is_the_masked_mean_of_the_naive_entropy():
    model, tokenizer = tiny_model()
    trajs = [_trajectory([1, 2, 3], [([10, 11], 1), ([12], 0), ([13], 1)]), _trajectory([4], [([20], 1)])]
    got = policy_entropy(model, trajs, pad_id=0, batch_size=1)
    values = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.input_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            H = -(logp.exp() * logp).sum(-1)  # position i predicts token i + 1
            mask = [0] * (len(t.prompt_ids) - 1) + list(t.loss_mask)
            values += [float(h) for h, m in zip(H, mask, strict=True) if m]
    assert len(values) == 4
    assert got == pytest.approx(sum(values) / len(values), rel=1e-5)


def _log_steps(run_dir, steps, **extra):
    with StepLogger(run_dir, tensorboard=False) as log:
        for step in steps:
            log.log(step, {"entropy": 0.5 - 0.1 * step, "H_tgt": 0.3, "reward_mean": 0.1 * step, **extra})


def test_plot_dashboard_draws_one_image_with_a_panel_per_logged_group(tmp_path):
    import matplotlib.image

    full = dict(
        accuracy=0.1,
        response_length_mean=100,
        gate_on=1,
        frac_reweighted=0.01,
        **{"stare/L_plus": 3, "stare/L_minus": 1, "eval/avg@4": 0.25},
        tool_calls_per_episode=1.5,
        tool_errors_per_episode=0.1,
    )
    _log_steps(tmp_path / "full", (1, 2, 3), **full)
    _log_steps(tmp_path / "bare", (1, 2))  # entropy and reward only: two panels
    out = plot_dashboard(tmp_path / "full")
    assert out == tmp_path / "full" / "plots" / "dashboard.png"
    # 6 panels: a 3 x 2 grid of 5.2 x 3.4 inch panels at 110 dpi; 2 panels: one row of two.
    assert matplotlib.image.imread(out).shape[:2] == (round(2 * 3.4 * 110), round(3 * 5.2 * 110))
    bare = plot_dashboard(tmp_path / "bare")
    assert matplotlib.image.imread(bare).shape[:2] == (round(3.4 * 110), round(2 * 5.2 * 110))


def test_plot_dashboard_overlays_runs_in_their_common_parent(tmp_path):
    _log_steps(tmp_path / "grpo", (1, 2))
    _log_steps(tmp_path / "stare", (1, 2, 3))
    out = plot_dashboard([tmp_path / "grpo", tmp_path / "stare"])
    assert out == tmp_path / "dashboard.png" and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot_dashboard([tmp_path / "grpo", tmp_path / "stare"], labels=["only-one"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="has no steps yet"):
        plot_dashboard([tmp_path / "grpo", tmp_path / "empty"])
