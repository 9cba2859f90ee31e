"""Rollout engines implementing :class:`envs.rollout.Engine`.

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
