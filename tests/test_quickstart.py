"""The quickstart's before/after table names its two entropies apart."""

from stare_agent.quickstart import format_table


def _result(rl_entropy):
    side = {"avg@1": 0.5, "pass@1": 0.5, "tool_calls_per_episode": 1.0, "entropy": 0.08}
    return {
        "samples": 1,
        "before": {**side, "avg@1": 0.0, "pass@1": 0.0, "entropy": 0.95},
        "after": side,
        "gate_activity": 1.0,
        "rl_entropy": rl_entropy,
        "H_tgt": 0.3,
        "problems": 40,
        "backend": "docker",
        "engine": "vllm 0.32.0 (bfloat16, worker process)",
        "total_s": 60.0,
        "times_s": {"sft": 30.0},
        "run_dir": "runs/quickstart",
        "dashboard": "runs/quickstart/plots/dashboard.png",
        "checkpoint_hf": None,
    }


def test_table_reports_greedy_and_sampled_entropy_under_distinct_names():
    table = format_table(_result([0.28, float("nan"), 0.25]))
    assert "entropy, greedy eval rollouts (nats/token)     0.950     0.080" in table
    # the skipped middle step (NaN) is passed over: first and last trained step
    assert (
        "entropy, sampled RL rollouts (gate's H-bar): 0.280 at the first RL step -> 0.250 at the last (H_tgt = 0.3)"
        in table
    )
    assert "dashboard: runs/quickstart/plots/dashboard.png" in table


def test_table_says_when_no_rl_step_trained():
    assert "sampled RL rollouts (gate's H-bar): no RL step trained" in format_table(_result([float("nan")]))


def test_table_names_the_rollout_engine():
    table = format_table(_result([0.28]))
    assert "sandbox: docker, engine: vllm 0.32.0 (bfloat16, worker process)" in table
