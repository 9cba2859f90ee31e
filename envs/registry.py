"""Gymnasium ids of the built-in environments, ``register_tool_env`` for new ones, and discovery
of third-party tools and environments through Python entry points.

Built-in ids (registered when ``stare_envs`` is imported):

- ``stare/CodeInterpreter-v0``: generated exact-computation problems of every family.
- ``stare/CodeInterpreter-<Family>-v0``: one generator family, e.g. ``stare/CodeInterpreter-Multiplication-v0``.
- ``stare/AIME2024-v0``, ``stare/AIME2025-v0``, ``stare/AMC23-v0``, ``stare/MATH500-v0``: the
  evaluation sets shipped with this package (``stare_envs.problems.BUILTIN_SETS``), or your own copy:
  ``data_path`` (a file or the folder holding ``aime2024.jsonl`` etc.) or ``$STARE_DATA_DIR``.

Third-party packages declare entry points in the groups ``stare_agent.tools`` (the object is loaded,
which runs its ``@register_tool``; a ``ToolSpec`` is registered), ``stare_agent.envs`` (a callable
is called with no arguments to register its environments) and ``stare_agent.formats`` (a
``ToolFormat`` subclass, registered under its ``name``). They are loaded once, at import of
``stare_envs``; a plugin that fails to load is reported with a warning and skipped.

Example:
    >>> import gymnasium, envs
    >>> "stare/CodeInterpreter-Multiplication-v0" in gymnasium.registry
    True
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gymnasium

from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.definitions import definition
from stare_envs.errors import EnvError
from stare_envs.formats import register_format
from stare_envs.problems import PROBLEM_FAMILIES, builtin_set_path, load_problems
from stare_envs.tool_env import ToolEnv
from stare_envs.tools import ToolSpec, add_tool, get_tool

TOOL_GROUP = "stare_agent.tools"
ENV_GROUP = "stare_agent.envs"
FORMAT_GROUP = "stare_agent.formats"
DATA_DIR_VAR = "STARE_DATA_DIR"
BENCHMARKS = {"AIME2024": "aime2024", "AIME2025": "aime2025", "AMC23": "amc23", "MATH500": "math500"}
"""Benchmark environment name -> built-in set (``stare_envs.problems.BUILTIN_SETS``)."""


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
    env_id: str, *, entry_point: str | Callable[..., gymnasium.Env] = "stare_envs:ToolEnv", **kwargs: Any
) -> None:
    """Register a tool environment under ``env_id`` (``gymnasium.make(env_id)`` then builds it).

    Unlike ``gymnasium.register``, an id taken by another registration is an error (the same one again,
    from a module imported a second time, is a no-op), and the tools named in ``kwargs["tools"]`` must
    already be registered.

    Args:
        env_id: ``namespace/Name-vN``.
        entry_point: The env class or factory; ``ToolEnv`` by default.
        **kwargs: Default keyword arguments of the env (``tools``, ``format``, ``problems``, ...).

    Raises:
        EnvRegistrationError: the id is taken by another registration.
        ToolRegistryError: a tool is not registered (the message lists the registered ones).
    """
    if env_id in gymnasium.registry:
        taken = gymnasium.registry[env_id]
        if _same_registration(taken.entry_point, taken.kwargs, entry_point, kwargs):
            return
        raise EnvRegistrationError(
            f"environment id {env_id!r} is already registered with other settings ({_describe(taken.kwargs)}; "
            f"now {_describe(kwargs)}): bump its version (-v1) or pick another name"
        )
    for tool in kwargs.get("tools", ()):
        if not isinstance(tool, ToolSpec):
            get_tool(tool)
    gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs, disable_env_checker=False)


def _same_registration(
    entry_a: Any, kwargs_a: Mapping[str, Any], entry_b: Any, kwargs_b: Mapping[str, Any]
) -> bool:
    """Two registrations are the same when their entry points and keyword arguments are the same
    definitions (callables and tool specs compared by :func:`stare_envs.definitions.definition`)."""

    def key(value: Any) -> Any:
        if isinstance(value, ToolSpec):
            return ("tool", value.name, definition(value.impl))
        if isinstance(value, Mapping):
            return {k: key(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [key(v) for v in value]
        return definition(value) if callable(value) else value

    return key(entry_a) == key(entry_b) and key(dict(kwargs_a)) == key(dict(kwargs_b))


def _describe(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())[:300] or "no settings"


BUILTIN_LIMITS = {"max_turns": 16, "max_tool_calls": 16}
"""The episode limits the built-in ids are registered with: the paper's (ReTool: 16 tool calls)."""


def register_builtin_envs() -> None:
    """Register the built-in ids (those already registered are left alone)."""
    limits = dict(BUILTIN_LIMITS)
    builtins: dict[str, tuple[Any, dict[str, Any]]] = {
        # No problems named: the env's own default (mixed) serves any that are not given to reset(),
        # and training and evaluation take theirs from data.train (default mixed) / data.eval.
        "stare/CodeInterpreter-v0": ("stare_envs.code_interpreter:CodeInterpreterEnv", limits)
    }
    for family in PROBLEM_FAMILIES:
        builtins[family_env_id(family)] = (
            "stare_envs.code_interpreter:CodeInterpreterEnv",
            {"problems": family, **limits},
        )
    for benchmark in BENCHMARKS:
        builtins[f"stare/{benchmark}-v0"] = (
            "stare_envs.registry:make_benchmark_env",
            {"benchmark": benchmark, **limits},
        )
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
                except Exception as exc:  # noqa: BLE001 - one broken plugin must not break `import stare_envs`
                    warnings.warn(
                        f"plugin {entry_point.name!r} ({entry_point.value}, group {group}) failed to load: "
                        f"{type(exc).__name__}: {exc}; fix or uninstall the package that provides it",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                loaded.append(f"{group}:{entry_point.name}")
        return loaded


def make_tool_env(env_id: str, **kwargs: Any) -> Any:
    """``gymnasium.make(env_id, **kwargs)``, unwrapped: the one way training and evaluation build envs.

    ``env_id`` is a Gymnasium id (built-in, registered in Python, or by a ``stare_agent.envs`` entry
    point), or ``module:id`` to import ``module`` (which registers the id) first, as Gymnasium allows.
    The rollout runner drives the ``ToolEnv`` itself (it enforces its own turn and tool-call limits),
    so Gymnasium's checker and order-enforcing wrappers are left out.

    Raises:
        EnvRegistrationError: the id is not registered, its env is not an ``stare_envs.ToolEnv``, or it is registered
            with ``max_episode_steps`` (a wrapper's limit, which the unwrapped env would lose silently).
    """
    return make_tool_envs(env_id, 1, **kwargs)[0]


def make_tool_envs(env_id: str, count: int, **kwargs: Any) -> list[Any]:
    """``count`` envs of :func:`make_tool_env`, the id checked once for all of them (a batch of an
    evaluation or a training step); on an error the ones already made are closed."""
    check_env_id(env_id)
    steps = gymnasium.spec(env_id.split(":")[-1]).max_episode_steps
    if steps is not None:
        raise EnvRegistrationError(
            f"env.id={env_id!r} is registered with max_episode_steps={steps}, a TimeLimit wrapper the rollout "
            f"runner does not use: register it with max_turns={steps} among its kwargs instead"
        )
    made: list[Any] = []
    try:
        for _ in range(count):
            env = gymnasium.make(env_id, disable_env_checker=True, **kwargs).unwrapped
            if not isinstance(env, ToolEnv):
                env.close()
                raise EnvRegistrationError(
                    f"env.id={env_id!r} makes a {type(env).__name__}, not an stare_envs.ToolEnv: register a ToolEnv "
                    "(or subclass) to train or evaluate it"
                )
            made.append(env)
    except BaseException:
        for env in made:
            env.close()
        raise
    return made


def check_env_id(env_id: str) -> None:
    """Fail fast, before a model is loaded, when ``env_id`` is not registered (see :func:`make_tool_env`).

    Raises:
        EnvRegistrationError: naming the id and the three ways to register one.
    """
    # The built-in ids and the entry-point plugins are registered: importing stare_envs.registry ran envs/__init__.
    module, _, name = env_id.rpartition(":")
    if module:
        import_env_module(module, env_id)
    try:
        gymnasium.spec(name)
    except gymnasium.error.Error as exc:
        raise EnvRegistrationError(
            f"env.id={env_id!r} is not a registered Gymnasium id ({str(exc).splitlines()[0]}): register "
            "it first (stare_envs.register_tool_env, or a package's stare_agent.envs entry point), write "
            "module:id to import the module that registers it, or use stare/CodeInterpreter-v0"
        ) from None


def env_needs_sandbox(env_id: str, **kwargs: Any) -> bool:
    """Whether episodes of ``env_id``, made with ``kwargs``, run code in a sandbox: one of its tools (the
    ``tools`` of ``kwargs``, else of its registration, else ``ToolEnv``'s default) has ``needs_sandbox``.
    A run opens a sandbox pool (and needs Docker, for ``auto``) only then.

    Raises:
        EnvRegistrationError: the id is not registered (see :func:`check_env_id`).
    """
    check_env_id(env_id)
    registered = gymnasium.spec(env_id.split(":")[-1]).kwargs
    default = inspect.signature(ToolEnv.__init__).parameters["tools"].default
    tools = kwargs.get("tools", registered.get("tools", default))
    return any((tool if isinstance(tool, ToolSpec) else get_tool(tool)).needs_sandbox for tool in tools)


def registered_kwargs(env_id: str) -> dict[str, Any]:
    """The keyword arguments ``env_id`` was registered with (a copy).

    Raises:
        EnvRegistrationError: the id is not registered (see :func:`check_env_id`).
    """
    check_env_id(env_id)
    return dict(gymnasium.spec(env_id.split(":")[-1]).kwargs)


def registered_problems(env_id: str) -> Any:
    """The ``problems`` ``env_id`` was registered with (``register_tool_env(..., problems=...)``): a
    source name (a family, a file, a built-in set) or a list of problems; a built-in benchmark id's
    set (``stare/AIME2024-v0``: ``aime2024``); None when it names none.

    Raises:
        EnvRegistrationError: the id is not registered (see :func:`check_env_id`).
    """
    kwargs = registered_kwargs(env_id)
    problems = kwargs.get("problems", BENCHMARKS.get(kwargs.get("benchmark")))  # type: ignore[arg-type]
    return os.fspath(problems) if isinstance(problems, os.PathLike) else problems


def import_env_module(module: str, env_id: str) -> None:
    """Import the ``module`` of a ``module:id`` env id as ``python -m`` would from the working
    directory: a module that is not importable otherwise is looked up in the current directory too
    (console scripts such as ``stare-agent`` put their own directory on ``sys.path``, not it).

    Raises:
        EnvRegistrationError: the module is not found in either place, naming how to make it importable.
    """
    import importlib
    import sys

    top = module.split(".")[0]
    try:
        importlib.import_module(module)
        return
    except ModuleNotFoundError as exc:
        if exc.name != top or os.getcwd() in sys.path or "" in sys.path:
            missing = exc
        else:
            sys.path.insert(0, os.getcwd())
            try:
                importlib.import_module(module)
                return
            except ModuleNotFoundError as again:
                sys.path.remove(os.getcwd())
                missing = again
    if missing.name != top:  # the module exists but imports something that is missing
        raise EnvRegistrationError(
            f"env.id={env_id!r}: importing {module} failed ({missing}): install what it imports"
        ) from None
    raise EnvRegistrationError(
        f"env.id={env_id!r}: no module named {top!r} here ({os.getcwd()}) or on sys.path: run from the "
        f"directory that holds {top}.py, add that directory to PYTHONPATH, or pip install the package "
        "that provides it"
    ) from None
