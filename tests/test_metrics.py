"""Step metrics, the JSONL/TensorBoard logger, policy entropy and the plots."""

from __future__ import annotations

import json

import pytest
import torch

from envs.trajectory import TrajectoryBuilder
from stare_agent.metrics import StepLogger, policy_entropy, read_metrics, reflection_counts, rollout_metrics
from stare_agent.models import tiny_model
from stare_agent.plots import plot_run


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


def test_plot_run_draws_each_panel_with_the_target_line(tmp_path):
    with StepLogger(tmp_path, tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(
                step,
                {
                    "entropy": 0.5 - 0.1 * step,
                    "H_tgt": 0.3,
                    "reward_mean": 0.1 * step,
                    "accuracy": 0.1,
                    "response_length_mean": 100,
                    "gate_on": step > 2,
                    "frac_reweighted": 0.01,
                    "W": 1.1,
                    "M": 0.9,
                    "tool_calls_per_episode": 1.5,
                    "tool_errors_per_episode": 0.1,
                },
            )
    files = plot_run(tmp_path)
    assert sorted(p.name for p in files) == [
        "entropy.png",
        "gate.png",
        "response_length.png",
        "reward.png",
        "tool_calls.png",
    ]
    assert all(p.stat().st_size > 5000 for p in files)
