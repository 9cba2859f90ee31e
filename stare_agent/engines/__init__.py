"""Rollout engines implementing :class:`envs.rollout.Engine`.

- :class:`TransformersEngine`: any transformers causal LM, CPU or GPU, in process.
- :class:`SGLangEngine`: SGLang's offline engine on a CUDA GPU (optional; imported on first use so
  that this package imports without SGLang).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stare_agent.engines.transformers_engine import TransformersEngine

if TYPE_CHECKING:
    from stare_agent.engines.sglang_engine import SGLangEngine

__all__ = ["SGLangEngine", "TransformersEngine"]


def __getattr__(name: str) -> Any:
    if name == "SGLangEngine":
        from stare_agent.engines.sglang_engine import SGLangEngine

        return SGLangEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
