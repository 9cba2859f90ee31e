"""A user's DeepSpeed JSON config (``deepspeed.config``), merged over the learner's, with real DeepSpeed
on CPU; keys the learner owns must agree or stop the run with one line."""

from __future__ import annotations

import json

import pytest
import torch

from stare_agent.config import ConfigError, load_config
from stare_agent.models import tiny_model
from stare_agent.train.deepspeed_setup import deepspeed_config
from stare_agent.train.learner import Learner
from stare_envs.trajectory import TrajectoryBuilder


def _write(tmp_path, data, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def _batch():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(2):
        b = TrajectoryBuilder(torch.randint(100, 5000, (5,), generator=g).tolist())
        b.append(torch.randint(100, 5000, (7,), generator=g).tolist(), 1, [-1.0] * 7)
        out.append(b.build(reward=1.0))
    return out


def test_user_config_sets_stage_offload_and_buckets_and_trains(tmp_path):
    path = _write(
        tmp_path,
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "reduce_bucket_size": 1234567,
                "allgather_bucket_size": 2345678,
            },
            "steps_per_print": 100,
        },
    )
    cfg = load_config(None, [f"deepspeed.config={path}", "deepspeed.precision=fp32", "optim.lr=1e-2"])
    assert cfg.deepspeed.zero_stage == 2  # the file's stage, deepspeed.zero_stage left unset
    model, tokenizer = tiny_model(seed=0)
    learner = Learner.from_config(model, tokenizer, cfg)
    ds_model = learner.ds_model
    assert ds_model.zero_optimization_stage() == 2
    assert ds_model.zero_reduce_bucket_size() == 1234567
    assert ds_model.zero_allgather_bucket_size() == 2345678
    assert ds_model.zero_offload_optimizer().device == "cpu"
    assert ds_model.steps_per_print() == 100
    assert ds_model.gradient_clipping() == cfg.optim.grad_clip  # the learner's keys kept
    start = {n: p.detach().clone() for n, p in learner.named_weights()}
    metrics = learner.update(_batch(), [1.0, -1.0])
    assert metrics["skipped"] == 0.0
    assert any(not torch.equal(p, start[n]) for n, p in learner.named_weights())


def test_hugging_face_auto_values_are_accepted(tmp_path):
    path = _write(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": False},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto", "overlap_comm": True},
        },
    )
    cfg = load_config(None, [f"deepspeed.config={path}", "deepspeed.precision=fp32"])
    merged = deepspeed_config(cfg.deepspeed, cfg.optim, "fp32", 1)
    assert merged["train_micro_batch_size_per_gpu"] == 1 and merged["gradient_accumulation_steps"] == 1
    assert merged["gradient_clipping"] == 1.0 and merged["bf16"]["enabled"] is False
    assert merged["zero_optimization"] == {"stage": 1, "overlap_comm": True}  # "auto": DeepSpeed's default


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        (
            {"gradient_accumulation_steps": 4},
            [],
            "sets gradient_accumulation_steps=4 but the learner uses 1 (the learner accumulates over "
            "deepspeed.micro_batch_tokens micro-batches): remove gradient_accumulation_steps from the file "
            "or set it to 'auto'",
        ),
        (
            {"train_micro_batch_size_per_gpu": 8},
            [],
            "sets train_micro_batch_size_per_gpu=8 but the learner uses 1",
        ),
        (
            {"gradient_clipping": 0.5},
            [],
            "sets gradient_clipping=0.5 but the learner uses 1.0 (optim.grad_clip",
        ),
        (
            {"bf16": {"enabled": True}},
            ["deepspeed.precision=fp32"],
            "sets bf16.enabled=true but the learner uses false (deepspeed.precision resolves to fp32): set "
            "deepspeed.precision=bf16 (GPU) or fp32 to match, or remove bf16.enabled from the file",
        ),
        ({"fp16": {"enabled": True}}, [], "has a 'fp16' section (the learner trains in bf16 or fp32"),
        ({"optimizer": {"type": "Adam"}}, [], "has a 'optimizer' section (the learner builds AdamW"),
        ({"scheduler": {"type": "WarmupLR"}}, [], "has a 'scheduler' section"),
    ],
)
def test_conflicts_with_the_learner_give_one_line(tmp_path, data, overrides, message):
    path = _write(tmp_path, data)
    cfg = load_config(None, [f"deepspeed.config={path}", *overrides])
    with pytest.raises(ConfigError) as info:
        deepspeed_config(cfg.deepspeed, cfg.optim, "fp32", 1)
    text = str(info.value)
    assert text.startswith(f"deepspeed.config={path} ") and message in text and "\n" not in text


def test_learner_stops_on_a_conflict(tmp_path):
    path = _write(tmp_path, {"train_batch_size": 64})
    model, tokenizer = tiny_model(seed=0)
    cfg = load_config(None, [f"deepspeed.config={path}", "deepspeed.precision=fp32"])
    with pytest.raises(ConfigError, match="sets train_batch_size=64 but the learner uses 1"):
        Learner.from_config(model, tokenizer, cfg)


def test_bad_files_and_stage_disagreement_fail_at_load(tmp_path):
    with pytest.raises(ConfigError, match="no such file: pass the path of a DeepSpeed JSON config"):
        load_config(None, [f"deepspeed.config={tmp_path / 'missing.json'}"])
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 2")
    with pytest.raises(ConfigError, match="is not readable JSON"):
        load_config(None, [f"deepspeed.config={bad}"])
    path = _write(tmp_path, {"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage=3 but .* sets zero_optimization.stage=2"):
        load_config(None, [f"deepspeed.config={path}", "deepspeed.zero_stage=3"])
    assert load_config(None, [f"deepspeed.config={path}", "deepspeed.zero_stage=2"]).deepspeed.zero_stage == 2
    assert load_config(None).deepspeed.zero_stage is None  # neither: stage 0, as before
    assert deepspeed_config(load_config(None).deepspeed, load_config(None).optim, "fp32", 1)[
        "zero_optimization"
    ] == {"stage": 0}


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    import os
    import time

    from stare_agent.train.deepspeed_setup import STALE_LOCK_S, clear_stale_build_locks

    stale = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"  # torch's default layout
    live = tmp_path / "py311_cpu" / "other_op" / "lock"
    flat = tmp_path / "deepspeed_shm_comm" / "lock"  # the layout under TORCH_EXTENSIONS_DIR
    for lock in (stale, live, flat):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    os.utime(flat, (old, old))
    with pytest.warns(
        UserWarning, match="removed a stale torch-extension build lock .*deepspeed_shm_comm/lock"
    ):
        removed = clear_stale_build_locks(tmp_path)
    assert sorted(removed) == sorted([stale, flat])
    assert not stale.exists() and not flat.exists() and live.exists()


def test_a_bad_model_path_fails_before_deepspeed_starts(monkeypatch, tmp_path):
    """The path is checked first: a typo costs seconds, not a process group (and, on a fresh CPU
    machine, DeepSpeed's build of its shared-memory op)."""
    from stare_agent.config import load_config
    from stare_agent.models import ModelLoadError
    from stare_agent.train import deepspeed_setup

    def started(*args, **kwargs):
        raise AssertionError("init_distributed ran before the model path was checked")

    monkeypatch.setattr(deepspeed_setup, "init_distributed", started)
    config = load_config(None, [f"model.name_or_path={tmp_path / 'no_such_dir'}"])
    with pytest.raises(ModelLoadError, match="no such directory"):
        deepspeed_setup.load_training_policy(config)
