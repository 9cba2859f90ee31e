"""The quickstart's before/after table names its two entropies apart."""

import json

from stare_agent.recipes.quickstart import format_table, save_result


def _result(rl_entropy):
    side = {"avg@1": 0.5, "pass@1": 0.5, "tool_calls_per_episode": 1.0, "entropy": 0.08}
    return {
        "samples": 1,
        "before": {**side, "avg@1": 0.0, "pass@1": 0.0, "entropy": 0.95},
        "after_sft": {**side, "avg@1": 0.25, "pass@1": 0.25, "entropy": 0.1},
        "after": side,
        "gate_activity": 1.0,
        "skipped_steps": 0,
        "rl_steps": 3,
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
    assert "entropy, greedy eval rollouts (nats/token)       0.950     0.100     0.080" in table
    # the skipped middle step (NaN) is passed over: first and last trained step
    assert (
        "entropy, sampled RL rollouts (gate's H-bar): 0.280 at the first RL step -> 0.250 at the last (H_tgt = 0.3)"
        in table
    )
    assert "dashboard: runs/quickstart/plots/dashboard.png" in table


def test_table_counts_the_gate_over_trained_steps_and_says_how_many_were_skipped():
    table = format_table({**_result([0.28, float("nan"), 0.25]), "skipped_steps": 1})
    assert "STARE gate on (fraction of trained RL steps)         -         -      1.00" in table
    assert "RL steps that trained nothing (skipped)              -         -    1 of 3" in table
    none_trained = {**_result([float("nan")] * 3), "skipped_steps": 3, "gate_activity": None}
    assert "STARE gate on (fraction of trained RL steps)         -         -         -" in format_table(
        none_trained
    )


def test_quickstart_json_is_strict_json_and_reads_back(tmp_path):
    result = _result([0.28, float("nan"), 0.25])
    result["after"] = {**result["after"], "pass@1": float("nan")}
    path = save_result(result, tmp_path)

    def refuse(constant):
        raise ValueError(f"bare {constant} in quickstart.json")

    loaded = json.loads(path.read_text(), parse_constant=refuse)
    assert loaded["rl_entropy"] == [0.28, None, 0.25] and loaded["after"]["pass@1"] is None
    table = format_table(loaded)  # the table of a quickstart.json read back: null shown as "-"
    assert "pass@1" in table and "0.280 at the first RL step -> 0.250 at the last" in table


def test_table_gives_rl_its_own_change_and_the_whole_gain_with_paired_intervals():
    """SFT and RL apart: the change RL made on the same problems, with Newcombe's paired interval, and
    a plain "not measurable" where that interval holds 0."""
    from stare_agent.intervals import paired_difference_interval

    before, sft, rl = [0] * 8, [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]
    result = _result([0.28])
    result["before"] = {**result["before"], "solved": before}
    result["after_sft"] = {**result["after_sft"], "avg@1": 0.25, "solved": sft}
    result["after"] = {**result["after"], "avg@1": 0.5, "solved": rl}
    table = format_table(result)
    assert "tool-use accuracy (avg@1)                        0.000     0.250     0.500" in table
    lo, hi = paired_difference_interval(sft, rl)
    assert lo <= 0 <= hi  # 2 gained of 8 problems: not enough to tell
    assert (
        f"RL's change in accuracy (SFT -> SFT+RL): +0.250, 95 % interval [{lo:+.3f}, {hi:+.3f}] paired over "
        "the 8 problems (2 better, 0 worse) - not measurable here: the interval holds 0; RL learns visibly "
        "with room to: stare-agent quickstart --config configs/rl_demo.yaml"
    ) in table
    lo, hi = paired_difference_interval(before, rl)
    assert (
        lo > 0
        and f"whole gain in accuracy (before -> SFT+RL): +0.500, 95 % interval [{lo:+.3f}, {hi:+.3f}]"
        in table
    )
    assert "(4 better, 0 worse)\n" in table + "\n"
    assert "RL's change" not in format_table(_result([0.28]))  # no per-problem scores: no interval


def test_table_says_when_no_rl_step_trained():
    assert "sampled RL rollouts (gate's H-bar): no RL step trained" in format_table(_result([float("nan")]))


def test_table_names_the_rollout_engine():
    table = format_table(_result([0.28]))
    assert "sandbox: docker, engine: vllm 0.32.0 (bfloat16, worker process)" in table


def test_table_names_the_fp32_evaluation_engine_beside_the_rollout_engine():
    result = {**_result([0.28]), "eval_engine": "vllm 0.32.0 (float32, worker process)"}
    assert (
        "engine: vllm 0.32.0 (bfloat16, worker process), evaluated by vllm 0.32.0 (float32, worker process)"
        in format_table(result)
    )


def test_fp32_evaluation_beside_a_bf16_transformers_engine_is_the_same_model_without_autocast():
    import torch

    from stare_agent.config import load_config
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model
    from stare_agent.recipes.quickstart import fp32_eval_engine

    config = load_config(None, ["data.eval_fp32=true"])
    model, tokenizer = tiny_model()
    bf16 = TransformersEngine(model, tokenizer, autocast_dtype=torch.bfloat16)
    name, engine = fp32_eval_engine(config, model, tokenizer, bf16)
    assert name == "transformers (fp32, in process)"
    assert isinstance(engine, TransformersEngine) and engine is not bf16
    assert engine.model is model and engine.autocast_dtype is None  # no copy, nothing to sync
    fp32 = TransformersEngine(model, tokenizer)
    assert fp32_eval_engine(config, model, tokenizer, fp32) == (None, fp32)  # already fp32: itself


def test_a_signal_during_rl_ends_the_quickstart_without_its_after_evaluation(tmp_path, monkeypatch):
    """The trainer stops at a step boundary on Ctrl-C (saving a checkpoint) and returns: the quickstart
    then stops too (KeyboardInterrupt: the CLI's "interrupted", 130), instead of evaluating the policy
    of an interrupted run as its "after"."""
    import types

    import pytest

    import stare_agent.evaluation
    import stare_agent.metrics
    import stare_agent.recipes.quickstart as quickstart
    import stare_agent.train.sft
    import stare_agent.train.trainer
    from stare_agent.config import load_config
    from stare_agent.models import tiny_model

    evaluated = []

    def evaluate_config(config, **kwargs):
        evaluated.append(kwargs["out_dir"].name)
        return types.SimpleNamespace(metrics={"avg@1": 0.0}, trajectories=[], problems=[])

    class StoppedTrainer:
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            return {"steps": 1, "skipped_steps": 0, "stopped_by": "SIGINT"}

    pool = types.SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(stare_agent.evaluation, "evaluate_config", evaluate_config)
    monkeypatch.setattr(stare_agent.metrics, "policy_entropy", lambda *args: 0.0)
    monkeypatch.setattr(stare_agent.train.sft, "sft", lambda *a, **k: {"output_dir": str(tmp_path / "sft")})
    monkeypatch.setattr(stare_agent.train.trainer, "Trainer", StoppedTrainer)
    model, tokenizer = tiny_model()
    config = load_config(quickstart.CONFIG, [f"trainer.run_dir={tmp_path}", "data.eval_limit=1"])
    engine = types.SimpleNamespace(model=model)
    with pytest.raises(KeyboardInterrupt):
        quickstart._run(config, tmp_path, model, tokenizer, engine, engine, lambda name, t0: None, pool)
    assert evaluated == ["eval_before", "eval_sft"]  # none of the interrupted RL policy


def test_the_quickstart_evaluates_a_custom_env_on_its_own_problems(monkeypatch):
    """With data.eval unset, a custom env's table was made on the code interpreter's `mixed` problems
    while RL trained on the env's own family: the table now uses the env's registered problems."""
    import sys
    from pathlib import Path

    import gymnasium

    from stare_agent.config import load_config
    from stare_agent.recipes.quickstart import quickstart_problems
    from stare_envs.tools import unregister_tool

    repo = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo / "examples")
    config = load_config(
        repo / "configs" / "custom_env.yaml", ["env.id=unit_converter:newcomer/UnitConvert-v0"]
    )
    try:
        problems = quickstart_problems(config)
        assert len(problems) == 50 and all(p.meta["family"] == "unit_conversion" for p in problems)
        default = quickstart_problems(load_config(repo / "configs" / "quickstart.yaml"))
        assert {p.meta["family"] for p in default} != {"unit_conversion"}  # mixed, for the code interpreter
    finally:
        unregister_tool("convert")
        gymnasium.registry.pop("newcomer/UnitConvert-v0", None)
        sys.modules.pop("unit_converter", None)
