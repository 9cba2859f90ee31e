"""Gymnasium ids of the built-in environments, ``register_tool_env`` for new ones, and discovery
of third-party tools and environments through Python entry points.

Built-in ids (registered when ``envs`` is imported):

- ``stare/CodeInterpreter-v0``: generated exact-computation problems of every family.
- ``stare/CodeInterpreter-<Family>-v0``: one generator family, e.g. ``stare/CodeInterpreter-Multiplication-v0``.
- ``stare/AIME2024-v0``, ``stare/AIME2025-v0``, ``stare/AMC23-v0``, ``stare/MATH500-v0``: the
  evaluation sets shipped with this package (``envs.problems.BUILTIN_SETS``), or your own copy:
  ``data_path`` (a file or the folder holding ``aime2024.jsonl`` etc.) or ``$STARE_DATA_DIR``.

Third-party packages declare entry points in the groups ``stare_agent.tools`` (the object is loaded,
which runs its ``@register_tool``; a ``ToolSpec`` is registered), ``stare_agent.envs`` (a callable
is called with no arguments to register its environments) and ``stare_agent.formats`` (a
``ToolFormat`` subclass, registered under its ``name``). They are loaded once, at import of
``envs``; a plugin that fails to load is reported with a warning and skipped.

Example:
    >>> import gymnasium, envs
    >>> "stare/CodeInterpreter-Multiplication-v0" in gymnasium.registry
    True
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium

from envs.code_interpreter import CodeInterpreterEnv
from envs.errors import EnvError
from envs.formats import register_format
from envs.problems import PROBLEM_FAMILIES, builtin_set_path, load_problems
from envs.tools import ToolSpec, add_tool, get_tool

TOOL_GROUP = "stare_agent.tools"
ENV_GROUP = "stare_agent.envs"
FORMAT_GROUP = "stare_agent.formats"
DATA_DIR_VAR = "STARE_DATA_DIR"
BENCHMARKS = {"AIME2024": "aime2024", "AIME2025": "aime2025", "AMC23": "amc23", "MATH500": "math500"}
"""Benchmark environment name -> built-in set (``envs.problems.BUILTIN_SETS``)."""


class EnvRegistrationError(EnvError, ValueError):
    """An environment id is malformed or taken; the message says what to do."""


def family_env_id(family: str) -> str:
    """``"gcd_lcm"`` -> ``"stare/CodeInterpreter-GcdLcm-v0"``."""
    return f"stare/CodeInterpreter-{''.join(part.capitalize() for part in family.split('_'))}-v0"


def benchmark_path(benchmark: str, data_path: str | os.PathLike[str] | None = None) -> Path:
    """Where the ``benchmark`` file is: ``data_path`` (file or folder), else ``$STARE_DATA_DIR``, else
    the set shipped with this package.

    Raises:
        FileNotFoundError: ``data_path`` or ``$STARE_DATA_DIR`` lacks the file (the message says how
            to point at it, or to use the shipped set).
    """
    name = f"{BENCHMARKS[benchmark]}.jsonl"
    if data_path is not None:
        path = Path(data_path)
        candidate = path / name if path.is_dir() else path
        fix = f"pass data_path='/path/to/{name}' to gymnasium.make, or leave it out to use the shipped set"
    elif os.environ.get(DATA_DIR_VAR):
        candidate = Path(os.environ[DATA_DIR_VAR]) / name
        fix = f"it is {DATA_DIR_VAR}'s folder: put {name} there, or unset {DATA_DIR_VAR} for the shipped set"
    else:
        return builtin_set_path(BENCHMARKS[benchmark])
    if not candidate.is_file():
        raise FileNotFoundError(f"{benchmark} problems not found at {candidate}: {fix}")
    return candidate


def make_benchmark_env(
    benchmark: str, data_path: str | os.PathLike[str] | None = None, **kwargs: Any
) -> CodeInterpreterEnv:
    """A ``CodeInterpreterEnv`` on a benchmark file (entry point of ``stare/<BENCHMARK>-v0``)."""
    if benchmark not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {benchmark!r}: use one of {sorted(BENCHMARKS)}")
    return CodeInterpreterEnv(load_problems(benchmark_path(benchmark, data_path)), **kwargs)


def register_tool_env(
    env_id: str, *, entry_point: str | Callable[..., gymnasium.Env] = "envs:ToolEnv", **kwargs: Any
) -> None:
    """Register a tool environment under ``env_id`` (``gymnasium.make(env_id)`` then builds it).

    Unlike ``gymnasium.register``, a taken id is an error, and the tools named in ``kwargs["tools"]``
    must already be registered.

    Args:
        env_id: ``namespace/Name-vN``.
        entry_point: The env class or factory; ``ToolEnv`` by default.
        **kwargs: Default keyword arguments of the env (``tools``, ``format``, ``problems``, ...).

    Raises:
        EnvRegistrationError: the id is taken.
        ToolRegistryError: a tool is not registered (the message lists the registered ones).
    """
    if env_id in gymnasium.registry:
        raise EnvRegistrationError(
            f"environment id {env_id!r} is already registered: bump its version (-v1) or pick another name"
        )
    for tool in kwargs.get("tools", ()):
        if not isinstance(tool, ToolSpec):
            get_tool(tool)
    gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs, disable_env_checker=False)


def register_builtin_envs() -> None:
    """Register the built-in ids (those already registered are left alone)."""
    builtins: dict[str, tuple[Any, dict[str, Any]]] = {
        # No problems named: the env's own default (mixed) serves any that are not given to reset(),
        # and training and evaluation take theirs from data.train (default mixed) / data.eval.
        "stare/CodeInterpreter-v0": ("envs.code_interpreter:CodeInterpreterEnv", {})
    }
    for family in PROBLEM_FAMILIES:
        builtins[family_env_id(family)] = ("envs.code_interpreter:CodeInterpreterEnv", {"problems": family})
    for benchmark in BENCHMARKS:
        builtins[f"stare/{benchmark}-v0"] = ("envs.registry:make_benchmark_env", {"benchmark": benchmark})
    for env_id, (entry_point, kwargs) in builtins.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs)


_plugins_loaded = False
_plugins_lock = threading.Lock()


def load_plugins(*, reload: bool = False) -> list[str]:
    """Load the ``stare_agent.tools`` and ``stare_agent.envs`` entry points (once per process).

    Args:
        reload: Load again even if already loaded (for tests; registrations that exist fail).

    Returns:
        ``group:name`` of every entry point loaded now.
    """
    global _plugins_loaded
    with _plugins_lock:
        if _plugins_loaded and not reload:
            return []
        _plugins_loaded = True
        loaded = []
        for group in (TOOL_GROUP, ENV_GROUP, FORMAT_GROUP):
            for entry_point in importlib.metadata.entry_points(group=group):
                try:
                    target = entry_point.load()
                    if isinstance(target, ToolSpec):
                        add_tool(target)
                    elif group == FORMAT_GROUP:
                        register_format(target)
                    elif group == ENV_GROUP and callable(target):
                        target()
                except Exception as exc:  # noqa: BLE001 - one broken plugin must not break `import envs`
                    warnings.warn(
                        f"plugin {entry_point.name!r} ({entry_point.value}, group {group}) failed to load: "
                        f"{type(exc).__name__}: {exc}; fix or uninstall the package that provides it",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                loaded.append(f"{group}:{entry_point.name}")
        return loaded
