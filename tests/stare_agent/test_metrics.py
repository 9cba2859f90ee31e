"""Step metrics, the JSONL/TensorBoard logger, policy entropy and the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stare_agent.metrics import (
    StepLogger,
    ToolHealth,
    ToolHealthAlarm,
    ToolHealthError,
    binomial_tail,
    gate_fraction,
    policy_entropy,
    read_metrics,
    reflection_counts,
    rollout_metrics,
)
from stare_agent.models import tiny_model
from stare_agent.recipes.plots import plot_dashboard
from stare_envs.trajectory import TrajectoryBuilder


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
    with pytest.raises(FileNotFoundError, match="stare-agent train"):
        read_metrics(tmp_path / "nope")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard" / "rl"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("gate_on")] == [(1, 1.0)]


def wandb_records(run_dir, kind):
    """The records of one kind (``history``, ``run``, ...) of the offline wandb run in ``run_dir``,
    read from its ``.wandb`` file: LevelDB-style log blocks of protobuf ``Record`` messages. wandb's
    service process finishes writing the file after ``finish()`` returns: wait for its exit record."""
    import time

    deadline = time.monotonic() + 60
    while not (records := _wandb_file_records(run_dir)) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, "the offline wandb run was not complete within 60 s"
        time.sleep(0.2)
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def _wandb_file_records(run_dir):
    from wandb.proto import wandb_internal_pb2 as pb

    paths = list(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert len(paths) <= 1, paths
    if not paths:
        return []
    path = paths[0]
    data, block, pos, parts, out = path.read_bytes(), 32768, 7, b"", []
    if len(data) < 7:  # the header is not written yet
        return []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, part = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if part in (1, 4):  # a full record, or the last part of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            out.append(record)
    return out


def _key(item):
    return item.key or "/".join(item.nested_key)


def test_logger_writes_an_offline_wandb_run_with_the_config(tmp_path, monkeypatch):
    from stare_agent.config import load_config

    monkeypatch.setenv("WANDB_SILENT", "true")
    config = load_config(None, ["logger.backends=[wandb]", "logger.name=probe", "algorithm.W=1.2"])
    with StepLogger(tmp_path, backends=config.logger.backends, config=config) as log:
        log.log(1, {"entropy": 0.5, "gate_on": True, "skip_reason": "text is not a scalar"})
        log.log(2, {"entropy": float("nan"), "reward_mean": 0.75})
    history = [
        {_key(item): json.loads(item.value_json) for item in h.item if not _key(item).startswith("_")}
        for h in wandb_records(tmp_path, "history")
    ]
    assert history == [{"entropy": 0.5, "gate_on": 1}, {"reward_mean": 0.75}]
    (run,) = wandb_records(tmp_path, "run")
    values = {_key(item): json.loads(item.value_json) for item in run.config.update}
    assert values["algorithm"]["W"] == 1.2 and run.display_name == "probe" and run.job_type == "rl"
    assert not (tmp_path / "tensorboard").exists()


def test_wandb_backend_missing_says_how_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'stare-agent\[wandb\]', or drop wandb"):
        StepLogger(tmp_path, backends=["wandb"])


def test_logger_backends_are_validated():
    from stare_agent.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match="logger.backends='mlflow' is not valid: use one of tensorboard, wandb"
    ):
        load_config(None, ["logger.backends=[mlflow]"])


@pytest.mark.parametrize("shared", [False, True])
def test_policy_entropy_is_the_masked_mean_of_the_naive_entropy(shared, monkeypatch):
    """Also when the batch's rows share a system prompt, which then runs once."""
    import stare_agent.algorithms.logprobs as logprobs

    model, tokenizer = tiny_model()
    system = list(range(30, 50)) if shared else []
    trajs = [
        _trajectory(system + [1, 2, 3], [([10, 11], 1), ([12], 0), ([13], 1)]),
        _trajectory(system + [4], [([20], 1)]),
    ]
    prefixes: list[int] = []
    run_once = logprobs.shared_prompt_logprobs_and_entropy

    def spy(model, ids, attention, prompt_length, *args, **kwargs):
        prefixes.append(prompt_length)
        return run_once(model, ids, attention, prompt_length, *args, **kwargs)

    monkeypatch.setattr(logprobs, "shared_prompt_logprobs_and_entropy", spy)
    got = policy_entropy(model, trajs, pad_id=0, batch_size=8)
    assert prefixes == ([20] if shared else [])
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


def test_policy_entropy_batches_trajectories_of_similar_length(monkeypatch):
    """Long and short trajectories alternate; batches of 2 take the two long ones together, then the
    two short ones (4 x 9 padded tokens, not 4 x 14), and the mean is the same as in batch order."""
    import stare_agent.train.batch as batch_module

    model, _ = tiny_model()
    trajs = [_trajectory([1, 2, 3], [(list(range(10, 10 + n)), 1)]) for n in (11, 2, 11, 2)]
    widths: list[tuple[int, int]] = []
    collate = batch_module.collate

    def spy(rows, *args, **kwargs):
        out = collate(rows, *args, **kwargs)
        widths.append(tuple(out["input_ids"].shape))
        return out

    monkeypatch.setattr(batch_module, "collate", spy)
    got = policy_entropy(model, trajs, pad_id=0, batch_size=2)
    assert widths == [(2, 14), (2, 5)]
    in_order = (
        policy_entropy(model, trajs[:1] + trajs[2:3], pad_id=0) * 22
        + policy_entropy(model, trajs[1:2] + trajs[3:], pad_id=0) * 4
    )
    assert got == pytest.approx(in_order / 26, rel=1e-6)


def _log_steps(run_dir, steps, **extra):
    with StepLogger(run_dir, backends=()) as log:
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
        **{"tools/infra_error_fraction": 0.0, "tools/void_turn_fraction": 0.1},
    )
    _log_steps(tmp_path / "full", (1, 2, 3), **full)
    _log_steps(tmp_path / "bare", (1, 2))  # entropy and reward only: two panels
    out = plot_dashboard(tmp_path / "full")
    assert out == tmp_path / "full" / "plots" / "dashboard.png"
    # 7 panels (tool health among them): 3 rows of 3 of 5.2 x 3.4 inch panels at 110 dpi; 2 panels: one row of two.
    assert matplotlib.image.imread(out).shape[:2] == (round(3 * 3.4 * 110), round(3 * 5.2 * 110))
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
    with pytest.raises(ValueError, match="holds no step yet"):
        plot_dashboard([tmp_path / "grpo", tmp_path / "empty"])


def test_logged_nan_is_written_as_null_and_read_back_as_nan(tmp_path):
    with StepLogger(tmp_path, backends=()) as log:
        log.log(1, {"entropy": float("nan"), "gate_on": 0, "skipped": 1, "extra": {"x": float("inf")}})
    line = (tmp_path / "metrics.jsonl").read_text()

    def refuse(constant):
        raise ValueError(f"bare {constant} in metrics.jsonl")

    assert json.loads(line, parse_constant=refuse) == {
        "step": 1,
        "entropy": None,
        "gate_on": 0,
        "skipped": 1,
        "extra": {"x": None},
    }
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["entropy"])
    # files written before nulls, with a bare NaN, still read
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "entropy": NaN}\n')
    assert math.isnan(read_metrics(tmp_path)[0]["entropy"])


def _line(ax, label):
    (line,) = [line for line in ax.get_lines() if line.get_label() == label]
    return list(line.get_ydata())


def test_dashboard_marks_skipped_steps_and_draws_no_gate_for_them(tmp_path):
    from stare_agent.recipes.plots import SKIPPED_LABEL, dashboard_figure

    with StepLogger(tmp_path, backends=()) as log:
        for step, skipped in ((1, 0), (2, 1), (3, 0)):
            log.log(step, {"entropy": math.nan if skipped else 0.01 * step, "H_tgt": 0.3, "gate_on": 1 - skipped,
                           "skipped": skipped, "reward_mean": 0.5, "accuracy": 0.5,
                           "response_length_mean": 100.0})  # fmt: skip
    fig = dashboard_figure([tmp_path])
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    gate = axes["STARE gate and weights"]
    y = _line(gate, "gate_on")
    assert y[0] == y[2] == 1.0 and math.isnan(y[1])  # a gap, not gate off
    for ax in axes.values():  # every panel shades the skipped step
        (band,) = [p for p in ax.patches if p.get_label() == SKIPPED_LABEL]
        assert band.get_x() == 1.5 and band.get_width() == 1.0
    assert _line(axes["Response length"], "response_length_mean") == [100.0] * 3  # rollouts were measured
    entropy = axes["Entropy on sampled rollouts (gate's H-bar)"]
    assert entropy.get_yscale() == "log" and "H_tgt = 0.3" in [
        line.get_label() for line in entropy.get_lines()
    ]
    # reward equal to accuracy at every step: one line, and the title says why
    reward = axes["Accuracy (= reward: 1 for a correct answer, else 0)"]
    assert [line.get_label() for line in reward.get_lines()] == ["accuracy"]


def test_dashboard_draws_reward_beside_accuracy_when_they_differ_and_the_sft_loss(tmp_path):
    from stare_agent.recipes.plots import dashboard_figure

    with StepLogger(tmp_path, backends=()) as log:
        log.log(1, {"entropy": 0.2, "reward_mean": 0.4, "accuracy": 0.5})
    with StepLogger(tmp_path, filename="sft_log.jsonl", backends=()) as log:
        log.log(1, {"loss": 2.0, "skipped": 0})
        log.log(2, {"loss": 1.5, "skipped": 0})
        log.log(2, {"summary": {"steps": 2, "first_loss": 2.0}})
    axes = {ax.get_title(): ax for ax in dashboard_figure([tmp_path]).axes if ax.get_visible()}
    reward = axes["Reward and accuracy (they differ by the reward's shaping)"]
    assert [line.get_label() for line in reward.get_lines()] == ["reward_mean", "accuracy"]
    sft = axes["Cold-start SFT loss (sft_log.jsonl)"]
    assert _line(sft, "loss") == [2.0, 1.5] and sft.get_xlabel() == "SFT step"


def test_dashboard_draws_the_engine_learner_mismatch(tmp_path):
    import matplotlib.image

    _log_steps(tmp_path / "run", (1, 2), **{"mismatch/kl": 0.002, "mismatch/abs_logp_mean": 0.036})
    out = plot_dashboard(tmp_path / "run")
    # entropy, reward and the mismatch panel: one row of three
    assert matplotlib.image.imread(out).shape[:2] == (round(3.4 * 110), round(3 * 5.2 * 110))


def test_tool_health_counts_each_kind_of_fault_by_hand():
    calls = [
        {"error_type": None, "timed_out": False},
        {"error_type": "ZeroDivisionError", "timed_out": False},  # the model's code raised
        {"error_type": "Timeout", "timed_out": True},
    ]
    episodes = [
        _trajectory([1], [([5], 1)], tool_calls=calls, finish_reason="terminated"),
        # played again once after its sandbox was lost, then finished with one clean call
        _trajectory([1], [([5], 1)], tool_calls=calls[:1], retries=1, finish_reason="terminated"),
        # neither a call nor an answer
        _trajectory([1], [([5], 1)], tool_calls=[], void_turn=True, finish_reason="terminated"),
        # lost on every attempt: 1 try + 2 retries
        _trajectory([1], [], finish_reason="failed", retries=2, failed="host lost [SandboxLost]"),
    ]
    health = ToolHealth.of(episodes)
    assert (health.episodes, health.calls, health.code_errors, health.timeouts) == (4, 4, 1, 1)
    # 4 failed attempts: 1 recovered (the second episode's), 3 of the episode lost for good
    assert (health.infra_failures, health.recovered, health.failed_episodes) == (4, 1, 1)
    assert health.void_turns == 1 and health.last_failure == "host lost [SandboxLost]"
    m = health.metrics()
    assert m["tools/calls_per_episode"] == 1.0
    assert m["tools/code_error_fraction"] == 0.25 and m["tools/timeout_fraction"] == 0.25
    assert m["tools/infra_error_fraction"] == 4 / 8 and m["tools/infra_failures"] == 4
    assert m["tools/infra_recovered"] == 1 and m["tools/infra_lost"] == 1
    assert m["tools/infra_lost_fraction"] == 1 / 4 and m["tools/void_turn_fraction"] == 0.25


def _step(played: int, lost: int = 0, recovered: int = 0) -> ToolHealth:
    """One step's health as ``ToolHealth.of`` counts it: ``played`` episodes of one tool call each, of which
    ``recovered`` were played again once after an infrastructure failure and ``lost`` failed on each of
    their 3 attempts."""
    finished = played - lost
    return ToolHealth.of(
        [
            _trajectory([1], [([5], 1)], tool_calls=[{"error_type": None}], finish_reason="terminated")
            for _ in range(finished - recovered)
        ]
        + [
            _trajectory(
                [1], [([5], 1)], tool_calls=[{"error_type": None}], retries=1, finish_reason="terminated"
            )
            for _ in range(recovered)
        ]
        + [
            _trajectory([1], [], finish_reason="failed", retries=2, failed="host lost [SandboxLost]")
            for _ in range(lost)
        ]
    )


def test_a_lost_host_whose_episodes_all_recovered_does_not_stop_a_small_run():
    """8 episodes a step; at step 1 a host is lost under every one of them and each is played again to
    its end elsewhere: 8 failed attempts, nothing lost. (The alarm used to count those 8 of 16, then 8 of
    24 attempts as failures and stopped the run at step 2.)"""
    alarm = ToolHealthAlarm(0.05, 5)
    alarm.observe(1, _step(8, recovered=8))
    for step in range(2, 11):
        alarm.observe(step, _step(8))


def test_the_tool_health_alarm_stops_on_lost_episodes_beyond_chance():
    """With L of N episodes lost in the window, the run stops when L > 0.05 N and P(Bin(N, 0.05) >= L)
    < 0.001. By hand, P(X >= 3 | 8, 0.05) = 56 * 0.05^3 * 0.95^5 + P(X >= 4) = 0.0054164 + 0.0003717, and
    P(X >= 4 | 8, 0.05) = 70 * 0.05^4 * 0.95^4 + 56 * 0.05^5 * 0.95^3 + ... = 0.0003563 + 0.0000150 + ...
    = 0.0003717: 3 lost of 8 go on, 4 stop."""
    assert binomial_tail(8, 4, 0.05) == pytest.approx(0.00037175, rel=1e-4)
    assert binomial_tail(8, 3, 0.05) == pytest.approx(0.0057881, rel=1e-4)
    ToolHealthAlarm(0.05, 5).observe(1, _step(8, lost=3))  # 3 of 8 (37.5 %): could be chance
    with pytest.raises(ToolHealthError) as stop:
        ToolHealthAlarm(0.05, 5).observe(1, _step(8, lost=4, recovered=2))
    message = str(stop.value)
    assert message.startswith(
        "step 1: 4 of 8 episodes over the last 1 steps (50.0%) were lost to the sandbox infrastructure "
        "(every attempt failed; 2 other failed attempts recovered on a retry): above "
        "trainer.max_infra_error_rate=0.05 beyond chance (last: host lost [SandboxLost])"
    )
    assert "stare-agent train --resume" in message and "\n" not in message

    # The window of 5 steps: 1 lost a step is 1, 2, 3, 4, 5 of 8, 16, 24, 32, 40 (P from 0.34 down to
    # 0.048, by the same sums), then 5 of 40 at every step: never stopped. A step that loses 3 makes it
    # 1+1+1+1+3 = 7 of 40 (P = 0.0034): it goes on; the next, losing 4, 1+1+1+3+4 = 10 of 40
    # (P = 0.00002): stopped.
    rolling = ToolHealthAlarm(0.05, 5)
    for step in range(1, 11):
        rolling.observe(step, _step(8, lost=1))
    rolling.observe(11, _step(8, lost=3))
    with pytest.raises(ToolHealthError, match="^step 12: 10 of 40 episodes"):
        rolling.observe(12, _step(8, lost=4))

    # Everything lost stops at once, whatever the run's size; 1.0 never stops, 0.0 at the first loss.
    with pytest.raises(ToolHealthError, match="^step 1: 3 of 3 episodes"):
        ToolHealthAlarm(0.05, 5).observe(1, _step(3, lost=3))
    ToolHealthAlarm(1.0, 5).observe(1, _step(8, lost=8))
    with pytest.raises(ToolHealthError, match="^step 1: 1 of 512 episodes"):
        ToolHealthAlarm(0.0, 5).observe(1, _step(512, lost=1))


def test_gate_fraction_counts_trained_steps_only():
    trained, skipped = {"gate_on": 1, "entropy": 0.01}, {"gate_on": 0, "entropy": math.nan, "skipped": 1}
    # a step that trained nothing has no gate: neither on nor off
    assert gate_fraction([trained, skipped, trained]) == (1.0, 1)
    assert gate_fraction([trained, {"gate_on": 0, "entropy": 0.4, "skipped": 0}]) == (0.5, 0)
    assert gate_fraction([skipped, skipped]) == (None, 2)


def test_a_cut_last_line_is_left_out_and_a_damaged_one_named(tmp_path):
    from stare_agent.metrics import MetricsError

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # a killed writer's half line
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2 is not a metrics record: the file is damaged"):
        read_metrics(tmp_path)


@pytest.mark.docker
def test_tool_health_counts_a_container_killed_from_outside_as_infrastructure_never_as_code(docker_ready):
    """Three episodes on real Docker sandboxes, one tool call each. p0's container is killed with `docker
    kill` while its call runs: the attempt ends as an infrastructure failure (SandboxKilled) and p0 is played
    again to its end: 1 failed attempt, recovered. p1's code fills its 256 MB memory limit and p2's raises an
    exception it named SandboxKilled: both the model's doing, code errors. By hand: 3 episodes, 3 calls (p0's
    second attempt, p1's, p2's), 2 code errors, 1 infrastructure failure, recovered, 0 lost. (Before, the
    outside kill came back as a KernelDied result of p0's code: 4 calls, 3 code errors, no infrastructure
    failure at all.)"""
    import subprocess
    import threading
    import time

    from stare_agent.engines.scripted import ScriptedEngine
    from stare_envs.code_interpreter import CodeInterpreterEnv
    from stare_envs.problems import Problem
    from stare_envs.rollout import RolloutRunner
    from stare_sandbox.config import SandboxConfig
    from stare_sandbox.pool import SandboxPool
    from tests.helpers_tokenizers import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    problems = [Problem(f"p{i}", f"Problem p{i}: what is {i} * 7?", str(i * 7)) for i in range(3)]
    code = [
        "import time\ntime.sleep(5)\nprint(0 * 7)",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))",
        "class SandboxKilled(Exception):\n    pass\nraise SandboxKilled('the sandbox was ended from outside')",
    ]
    killer: list[threading.Thread] = []

    def kill_p0_mid_call() -> None:
        deadline = time.monotonic() + 60
        while envs[0]._sandbox is None and time.monotonic() < deadline:  # leased at p0's first call
            time.sleep(0.01)
        time.sleep(1.5)  # p0's code sleeps
        subprocess.run(
            ["docker", "kill", envs[0]._sandbox.inner.container.id], check=True, capture_output=True
        )

    def policy(prompt_text: str, turn: int) -> str:
        i = int(prompt_text.rsplit("Problem p", 1)[1][0])
        if turn == 0:
            if i == 0 and not killer:  # p0's first attempt only
                killer.append(threading.Thread(target=kill_p0_mid_call, daemon=True))
                killer[0].start()
            return f"<code>\n```python\n{code[i]}\n```\n</code>"
        return f"<answer>\\boxed{{{i * 7}}}</answer>"

    config = SandboxConfig(memory_mb=256, timeout_s=20)
    with SandboxPool(3, backend="docker", config=config) as pool:
        envs = [
            CodeInterpreterEnv(problems, format="retool", pool=pool, tokenizer=tokenizer) for _ in problems
        ]
        runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, policy), max_response_tokens=2048)
        try:
            trajectories = runner.run(envs, options=[{"problem_index": i} for i in range(3)])
        finally:
            for env in envs:
                env.close()
    killer[0].join()
    p0, p1, p2 = trajectories
    assert p0.info["retries"] == 1 and p0.info["finish_reason"] == "terminated" and p0.reward == 1.0
    assert [c["error_type"] for c in p0.info["tool_calls"]] == [None]
    assert p1.info["tool_calls"][0]["error_type"] in ("KernelDied", "MemoryError")
    assert [c["error_type"] for c in p2.info["tool_calls"]] == ["SandboxKilled"]
    health = ToolHealth.of(trajectories)
    assert (health.episodes, health.calls, health.code_errors, health.timeouts) == (3, 3, 2, 0)
    assert (health.infra_failures, health.recovered, health.failed_episodes) == (1, 1, 0)
