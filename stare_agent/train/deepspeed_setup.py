"""DeepSpeed plumbing of the learner: the process group, the DeepSpeed config, ZeRO-3 loading.

- :func:`init_distributed`: ``torch.distributed`` through DeepSpeed, once per process (a plain
  process becomes a world of one on a free loopback port).
- :func:`deepspeed_config`: the config ``deepspeed.initialize`` gets, generated from the
  ``deepspeed`` and ``optim`` sections, with a user's ``deepspeed.config`` JSON merged over it and
  checked (keys the learner owns are refused with the fix).
- :func:`load_training_policy`: the policy in the learner's dtype, partitioned at load under ZeRO-3.

:class:`~stare_agent.train.learner.Learner` calls ``deepspeed.initialize`` with them.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stare_agent.config import (
    ConfigError,
    DeepSpeedConfig,
    OptimConfig,
    RunConfig,
    read_deepspeed_json,
    resolve_precision,
)


def init_distributed(backend: str = "auto") -> None:
    """Initialise ``torch.distributed`` through DeepSpeed once per process.

    Under a launcher (``RANK``/``WORLD_SIZE`` set) its rendezvous is used; a plain process becomes a
    world of one on a free loopback port. ``auto`` picks NCCL when CUDA is available, else gloo.
    """
    if dist.is_available() and dist.is_initialized():
        return
    import deepspeed

    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    clear_stale_build_locks()
    deepspeed.init_distributed(dist_backend=backend)


STALE_LOCK_S = 600.0  # building DeepSpeed's CPU shared-memory op takes about a minute on 2 cores


def clear_stale_build_locks(
    root: str | Path | None = None, *, older_than_s: float = STALE_LOCK_S
) -> list[Path]:
    """Remove the torch-extension build locks older than ``older_than_s`` seconds; return the removed.

    On a CPU, DeepSpeed builds its shared-memory all-reduce op (``deepspeed_shm_comm``) at the first
    ``init_distributed`` under a ``lock`` file that torch's builder waits on with no timeout: a process
    killed while building leaves the lock behind, and every later start then hangs. A lock this old
    belongs to no live build. ``root``: the extensions root (default: ``TORCH_EXTENSIONS_DIR``, else
    torch's default root, with its ``py311_cpu``-style subfolders).
    """
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    now, removed = time.time(), []
    for lock in [*Path(root).glob("*/lock"), *Path(root).glob("*/*/lock")]:
        try:
            if now - lock.stat().st_mtime <= older_than_s:
                continue
            lock.unlink()
        except FileNotFoundError:  # another process removed it (its build finished) meanwhile
            continue
        removed.append(lock)
        warnings.warn(
            f"removed a stale torch-extension build lock {lock} (older than {older_than_s:.0f} s, left by a "
            "process killed while building); without this every DeepSpeed start would wait on it forever",
            stacklevel=2,
        )
    return removed


def load_training_policy(config: RunConfig) -> tuple[Any, Any]:
    """The policy and tokenizer of ``config.model`` for training, in the learner's dtype.

    Under ZeRO-3 the model is loaded partitioned (``stare_agent.models.load_policy`` with the
    learner's DeepSpeed config: ``from_pretrained`` inside ``deepspeed.zero.Init``, rank 0 scatters
    the checkpoint), so no rank holds a full copy of the weights. The DeepSpeed config is built (and
    a user's ``deepspeed.config`` checked) before anything loads.

    Raises:
        ConfigError: ``deepspeed.config`` conflicts with the learner.
        stare_agent.models.ModelLoadError: the model cannot be loaded (ModelTooLargeError: it does
            not fit in memory).
    """
    from stare_agent.models import load_policy, resolve_policy_path

    ds = config.deepspeed
    resolve_policy_path(config.model.name_or_path)  # a bad path or id fails here, before DeepSpeed starts
    init_distributed(ds.dist_backend)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    precision = resolve_precision(ds.precision, device_type)
    settings = deepspeed_config(ds, config.optim, precision, dist.get_world_size())
    dtype = torch.bfloat16 if precision == "bf16" else None
    return load_policy(
        config.model.name_or_path, dtype=dtype, zero3_config=settings if ds.zero_stage == 3 else None
    )


# Keys of a user's DeepSpeed config that the learner sets itself, and why (for the error line).
_OWNED_KEYS = {
    "train_micro_batch_size_per_gpu": "the learner splits batches by deepspeed.micro_batch_tokens",
    "gradient_accumulation_steps": "the learner accumulates over deepspeed.micro_batch_tokens micro-batches",
    "train_batch_size": "one optimizer step per learner call, on every rank",
    "gradient_clipping": "optim.grad_clip sets it",
}
_REFUSED_SECTIONS = {
    "optimizer": "the learner builds AdamW from the optim section: set optim.lr, optim.betas, ...",
    "scheduler": "the learner's schedule comes from optim.schedule and optim.warmup_steps",
    "fp16": "the learner trains in bf16 or fp32: use deepspeed.precision=bf16",
}


def deepspeed_config(
    ds: DeepSpeedConfig, optim: OptimConfig, precision: str, world_size: int
) -> dict[str, Any]:
    """The DeepSpeed config of the learner: generated from ``ds`` and ``optim``, then ``ds.config``'s
    file merged over it (see :class:`~stare_agent.config.DeepSpeedConfig` for what it may set).

    Raises:
        ConfigError: the file sets a key the learner owns to another value, or a refused section.
    """
    stage = ds.zero_stage or 0  # null: none set here or in the file
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    generated: dict[str, Any] = {
        # One optimizer step per call: micro-batching and accumulation are ours (token budget).
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16", "check_grad_overflow": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if ds.config is None:
        return generated
    return _merge_user_config(generated, read_deepspeed_json(ds.config), ds.config, precision)


def _merge_user_config(
    generated: dict[str, Any], user: dict[str, Any], path: str, precision: str
) -> dict[str, Any]:
    """``user`` merged over ``generated`` after checking the keys the learner owns (one-line errors)."""

    def conflict(key: str, value: Any, ours: Any, why: str, fix: str) -> ConfigError:
        return ConfigError(
            f"deepspeed.config={path} sets {key}={json.dumps(value)} but the learner uses "
            f"{json.dumps(ours)} ({why}): {fix}"
        )

    def without_auto(d: dict[str, Any]) -> dict[str, Any]:
        return {k: without_auto(v) if isinstance(v, dict) else v for k, v in d.items() if v != "auto"}

    user = without_auto(user)
    for key, why in _REFUSED_SECTIONS.items():
        section = user.get(key)
        if section is not None and not (key == "fp16" and not section.get("enabled", True)):
            raise ConfigError(
                f"deepspeed.config={path} has a {key!r} section ({why}): remove it from the file"
            )
    for key, why in _OWNED_KEYS.items():
        if key in user and user[key] != generated[key]:
            raise conflict(
                key, user[key], generated[key], why, f"remove {key} from the file or set it to 'auto'"
            )
    bf16 = user.get("bf16", {}).get("enabled")
    if bf16 is not None and bf16 != generated["bf16"]["enabled"]:
        raise conflict(
            "bf16.enabled",
            bf16,
            generated["bf16"]["enabled"],
            f"deepspeed.precision resolves to {precision}",
            "set deepspeed.precision=bf16 (GPU) or fp32 to match, or remove bf16.enabled from the file",
        )
    merged = _deep_merge(generated, user)
    offload = merged["zero_optimization"].get("offload_optimizer", {}).get("device", "none")
    if offload != "none":
        merged.setdefault("zero_force_ds_cpu_optimizer", False)  # torch AdamW steps on the CPU
    return merged


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
