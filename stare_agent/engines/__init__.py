"""Rollout engines implementing :class:`envs.engine.Engine`.

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

if TYPE_CHECKING:
    from stare_agent.engines.openai_engine import OpenAIEngine
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_agent.engines.sglang_engine import SGLangEngine
    from stare_agent.engines.transformers_engine import TransformersEngine
    from stare_agent.engines.vllm_engine import VLLMEngine

__all__ = ["OpenAIEngine", "SGLangEngine", "ScriptedEngine", "TransformersEngine", "VLLMEngine"]

_LAZY = {
    "OpenAIEngine": "stare_agent.engines.openai_engine",
    "ScriptedEngine": "stare_agent.engines.scripted",
    "SGLangEngine": "stare_agent.engines.sglang_engine",
    "TransformersEngine": "stare_agent.engines.transformers_engine",
    "VLLMEngine": "stare_agent.engines.vllm_engine",
}


def start_engine(
    config: Any, model: Any, tokenizer: Any, *, autocast: bool = False, device: str = "cpu"
) -> tuple[str, Any]:
    """The rollout engine ``env.engine`` names, as ``(description, engine)``: the one way the trainer,
    the quickstart and ``stare-agent eval`` start theirs.

    ``auto``: vLLM when a Python with vLLM is found, else the transformers engine; a vLLM engine that
    fails to start under ``auto`` falls back to the transformers engine, saying why in one line. vLLM
    runs in bf16 only where it is fast (a GPU, or a CPU with AVX-512 BF16), else in fp32. The
    transformers engine samples from ``model`` itself (under bf16 autocast with ``autocast``); with
    ``model=None`` it loads ``model.name_or_path`` on ``device`` (only then: vLLM and SGLang load their own).
    """
    from dataclasses import replace

    import torch

    from stare_agent.config import cpu_has_bf16
    from stare_agent.engines.vllm_engine import VLLMEngineError, pick_engine, vllm_engine_from_config

    env = config.env
    name = pick_engine(env.engine, env.vllm.python)
    if name == "sglang":
        from stare_agent.engines.sglang_engine import SGLangEngine

        return "sglang (GPU server)", SGLangEngine(config.model.name_or_path)
    if name == "vllm":
        section = env.vllm
        if section.dtype == "bfloat16" and not torch.cuda.is_available() and not cpu_has_bf16():
            section = replace(section, dtype="float32")  # bf16 without AVX-512 BF16 is slower than fp32
        try:
            engine = vllm_engine_from_config(section, config.model.name_or_path, seed=config.trainer.seed)
            return f"vllm {engine.info['vllm_version']} ({engine.info['dtype']}, worker process)", engine
        except VLLMEngineError as exc:
            if env.engine != "auto":
                raise
            print(f"[engine] vLLM did not start, using the transformers engine: {exc}")
    from stare_agent.engines.transformers_engine import TransformersEngine

    if model is None:
        from stare_agent.models import load_policy

        model, _ = load_policy(config.model.name_or_path, device=device)
    dtype = torch.bfloat16 if autocast else None
    return f"transformers ({'bf16 autocast' if autocast else 'fp32'}, in process)", TransformersEngine(
        model, tokenizer, autocast_dtype=dtype
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
