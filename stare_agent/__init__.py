"""stare-agent: RL training of tool-using LLM agents with STARE (arXiv 2606.19236).

The learner side: engines, collation, the algorithm, the DeepSpeed learner, SFT, evaluation.
Heavy submodules load on first use, so ``import stare_agent`` stays cheap.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("stare-agent")  # the distribution's, from pyproject.toml (CHANGELOG.md)
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# OpenMP threads that spin while waiting make torch on a busy CPU dramatically slower: with one of
# two cores taken by another process (a sandbox kernel, a test runner), a 2-thread forward pass of
# the embedded model took 3.6 s instead of 0.13 s. Passive waiting costs nothing measurable on an
# idle machine. It only takes effect when set before torch loads OpenMP, hence here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from stare_agent.config import RunConfig, load_config
    from stare_agent.evaluation import evaluate
    from stare_agent.train.learner import Learner
    from stare_agent.train.sft import sft
    from stare_agent.train.trainer import Trainer

__all__ = ["Learner", "RunConfig", "Trainer", "__version__", "evaluate", "load_config", "sft"]

_LAZY = {
    "RunConfig": "stare_agent.config",
    "load_config": "stare_agent.config",
    "evaluate": "stare_agent.evaluation",
    "Learner": "stare_agent.train.learner",
    "sft": "stare_agent.train.sft",
    "Trainer": "stare_agent.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stare_agent' has no attribute {name!r}")
