"""ZeRO-3 loading on CPU with two ranks (torchrun, gloo, real DeepSpeed): ``load_training_policy``
builds the model under ``deepspeed.zero.Init`` so each rank holds only its partition, the loaded
weights are the checkpoint's, and the learner trains a step on it. Only the CPU path is tested here:
the same code on GPUs (NCCL, bf16, partitions on the device) needs a GPU."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stare_agent.config import load_config
from stare_agent.models import tiny_model
from stare_agent.train.deepspeed_setup import load_training_policy
from stare_agent.train.learner import Learner
from stare_envs.trajectory import TrajectoryBuilder

REPO = Path(__file__).resolve().parents[3]


def _gathered(module) -> dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 module, whole (gathered one at a time)."""
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _worker(model_dir: str, out_dir: str, lora: bool) -> None:
    """Run by each torchrun rank."""
    import torch.distributed as dist

    cfg = load_config(
        None,
        [
            f"model.name_or_path={model_dir}",
            "deepspeed.zero_stage=3",
            "deepspeed.precision=fp32",
            "optim.lr=1e-2",
            f"model.lora.r={4 if lora else 0}",
        ],
    )
    model, tokenizer = load_training_policy(cfg)
    params = dict(model.named_parameters())
    loaded = {
        "partitioned": all(hasattr(p, "ds_id") for p in params.values()),
        "local_numel": sum(p.numel() for p in params.values()),  # what this rank holds as .data
        "partition_numel": sum(p.ds_tensor.numel() for p in params.values()),
        "full_numel": sum(p.ds_numel for p in params.values()),
    }
    learner = Learner.from_config(model, tokenizer, cfg)
    start = _gathered(learner.module)
    g = torch.Generator().manual_seed(dist.get_rank())
    b = TrajectoryBuilder(torch.randint(100, 5000, (5,), generator=g).tolist())
    b.append(torch.randint(100, 5000, (7,), generator=g).tolist(), 1, [-1.0] * 7)
    metrics = learner.update([b.build(reward=1.0)], [1.0 if dist.get_rank() == 0 else -1.0])
    changed = [n for n, p in _gathered(learner.module).items() if not torch.equal(p, start[n])]
    learner.export_hf(f"{out_dir}/hf")
    torch.save(
        {**loaded, "start": start, "skipped": metrics["skipped"], "changed": changed},
        f"{out_dir}/rank{dist.get_rank()}.pt",
    )


@pytest.mark.slow  # 40-100 s: two ranks load and train under ZeRO-3, on 2 loaded cores
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_zero3_loads_partitioned_and_trains_with_two_ranks(lora, tmp_path):
    model, tokenizer = tiny_model(seed=4)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={port}", __file__, str(tmp_path / "model"), str(tmp_path), str(int(lora))]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    full = sum(p.numel() for p in model.parameters())
    for r in ranks:
        assert r["partitioned"] and r["full_numel"] == full
        assert r["local_numel"] == 0  # no rank holds a whole parameter outside a gather
        assert r["partition_numel"] <= full // 2 + 64 * len(list(model.parameters()))  # about half
        assert r["skipped"] == 0.0 and r["changed"]
        if lora:  # only the adapters moved
            assert all(".lora_" in name for name in r["changed"])
    # the partitions hold the checkpoint's weights (rank 0 read it and scattered it)
    for name, p in model.named_parameters():
        start = {k.replace(".base_layer.", "."): v for k, v in ranks[0]["start"].items()}
        assert torch.equal(start[name], p.detach()), name
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([list(range(100, 116))])
    with torch.no_grad():
        merged = exported(input_ids=ids).logits
        assert not torch.allclose(merged, model(input_ids=ids).logits, atol=1e-5)  # the trained policy
        if lora:
            import peft

            adapted = peft.PeftModel.from_pretrained(
                tiny_model(seed=4)[0], tmp_path / "hf" / "adapter"
            ).eval()
            torch.testing.assert_close(adapted(input_ids=ids).logits, merged, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":  # torchrun entry point
    _worker(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
