"""Rollout engines implementing :class:`stare_envs.engine.Engine`.

- :class:`TransformersEngine`: any transformers causal LM, CPU or GPU, in process.
- :class:`VLLMEngine`: ``vllm.LLM`` in a worker process of a Python with vLLM (``.venv-vllm``), CPU or GPU.
- :class:`SGLangEngine`: SGLang's offline engine on a CUDA GPU (optional).
- :class:`OpenAIEngine`: any OpenAI-compatible server (vLLM, SGLang, ...) over plain HTTP; no torch.
- :class:`ScriptedEngine`: replays given turn texts token-exactly (tests, benchmarks); no torch.

Each is imported on first use, so that this package imports without SGLang, and
``stare_agent.engines.scripted`` also in the slim install (no torch or transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stare_agent.options import ENGINE_NAMES

if TYPE_CHECKING:
    from stare_agent.engines.openai_engine import OpenAIEngine
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.engines.sglang_engine import SGLangEngine
    from stare_agent.engines.transformers_engine import TransformersEngine
    from stare_agent.engines.vllm_engine import VLLMEngine

__all__ = [
    "ENGINE_NAMES",
    "OpenAIEngine",
    "SGLangEngine",
    "ScriptedEngine",
    "TransformersEngine",
    "VLLMEngine",
    "start_engine",
]

_LAZY = {
    "OpenAIEngine": "stare_agent.engines.openai_engine",
    "ScriptedEngine": "stare_agent.engines.scripted",
    "SGLangEngine": "stare_agent.engines.sglang_engine",
    "TransformersEngine": "stare_agent.engines.transformers_engine",
    "VLLMEngine": "stare_agent.engines.vllm_engine",
}


def start_engine(
    config: Any,
    model: Any,
    tokenizer: Any,
    *,
    name: str | None = None,
    autocast: bool = False,
    device: str = "cpu",
    base_url: str | None = None,
    api_key: str | None = None,
) -> tuple[str, Any]:
    """The rollout engine ``name`` (default ``env.engine``) names, as ``(description, engine)``: the
    one way the trainer, the quickstart and ``stare-agent eval`` start theirs.

    ``auto``: vLLM when a Python with vLLM is found, else the transformers engine; a vLLM engine that
    fails to start under ``auto`` falls back to the transformers engine, saying why in one line. vLLM
    runs ``env.vllm.dtype``, bf16 only where it is fast (a GPU, or a CPU with AVX-512 BF16), else fp32.
    The transformers engine samples from ``model`` itself (under bf16 autocast with ``autocast``); with
    ``model=None`` it loads ``model.name_or_path`` on ``device`` (only then: vLLM and SGLang load their
    own). ``openai``: the server at ``base_url`` serving ``model.name_or_path`` (``api_key``, default
    ``$OPENAI_API_KEY``), whose token ids ``tokenizer`` gives.

    vLLM and SGLang are placed as ``env.placement`` says (``placement.place_engine``): on this rank's
    GPU with a share of its memory (colocated) or on GPUs of their own (separate), with the weight
    sync it names; the engine's ``placement`` attribute holds the result.

    Raises:
        ValueError: an unknown ``name``, or ``openai`` without ``base_url``.
        PlacementError: ``env.placement`` cannot be met here (separate without GPUs, or with the
            transformers engine, ...).
    """
    from dataclasses import replace

    from stare_agent.engines.placement import PlacementError
    from stare_agent.engines.vllm_engine import VLLMEngineError, pick_engine

    env = config.env
    requested = name or env.engine
    if requested not in ENGINE_NAMES:
        raise ValueError(f"unknown engine {requested!r}: use one of {', '.join(ENGINE_NAMES)}")
    chosen = pick_engine(requested, env.vllm.python)
    if chosen == "openai":
        import os

        from stare_agent.engines.openai_engine import OpenAIEngine

        if not base_url:
            raise ValueError(
                "the openai engine needs base_url: the server's API root, e.g. http://127.0.0.1:8000/v1"
            )
        key = api_key or os.environ.get("OPENAI_API_KEY")
        served = OpenAIEngine(
            base_url, config.model.name_or_path, api_key=key, tokenizer=tokenizer, text_fallback=True
        )
        return f"openai at {base_url}, model {served.model}", served
    if chosen == "sglang":
        from stare_agent.engines.placement import sglang_arguments
        from stare_agent.engines.sglang_engine import SGLangEngine

        placed = engine_placement(config)
        sglang = SGLangEngine(config.model.name_or_path, **sglang_arguments(placed))
        return f"sglang ({placed.describe()})", with_placement(sglang, placed)
    import torch

    if chosen == "vllm":
        from stare_agent.config import cpu_has_bf16
        from stare_agent.engines import vllm_engine

        section = env.vllm
        if section.dtype == "bfloat16" and not torch.cuda.is_available() and not cpu_has_bf16():
            section = replace(section, dtype="float32")  # bf16 without AVX-512 BF16 is slower than fp32
        placed = engine_placement(config)
        try:
            engine = vllm_engine.vllm_engine_from_config(
                section, config.model.name_or_path, seed=config.trainer.seed, placement=placed
            )
            where = f", {placed.describe()}" if placed.gpus is not None else ""
            description = (
                f"vllm {engine.info['vllm_version']} ({engine.info['dtype']}, worker process{where})"
            )
            return description, with_placement(engine, placed)
        except VLLMEngineError as exc:
            if requested != "auto":
                raise
            print(f"[engine] vLLM did not start, using the transformers engine: {exc}")
    from stare_agent.engines.transformers_engine import TransformersEngine

    if env.placement.mode == "separate":
        raise PlacementError(
            "env.placement.mode=separate places a vLLM or SGLang engine on GPUs of its own, but the "
            "transformers engine samples in the learner's process: use env.engine=vllm or sglang, or "
            "env.placement.mode=colocated"
        )
    if model is None:
        from stare_agent.models import load_policy

        model, _ = load_policy(config.model.name_or_path, device=device)
    dtype = torch.bfloat16 if autocast else None
    return f"transformers ({'bf16 autocast' if autocast else 'fp32'}, in process)", TransformersEngine(
        model, tokenizer, autocast_dtype=dtype
    )


def engine_placement(config: Any) -> Any:
    """This rank's ``placement.EnginePlacement`` for ``env.placement`` of ``config`` (a RunConfig)."""
    from stare_agent.engines.placement import place_engine

    return place_engine(
        config.env.placement,
        vllm_memory_fraction=config.env.vllm.gpu_memory_utilization,
        max_staleness=config.trainer.max_staleness,
    )


def with_placement(engine: Any, placed: Any) -> Any:
    """``engine`` with its ``placement`` attribute set (the trainer reads ``placement.sleep``), and its
    weight updates sent over NCCL from this rank's GPU where ``placed.weight_sync`` says so."""
    engine.placement = placed
    if placed.weight_sync == "nccl" and placed.gpus is not None:
        import os

        import torch

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        engine.use_nccl_weight_sync(placed.tensor_parallel_size, device)
    return engine


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
