"""What a run's config opens and resolves when the run starts, apart from the config's schema: the
sandbox pool its episodes lease from, its environments, and the problems it trains and evaluates on.
The trainer, ``stare-agent eval``, ``evaluate()``, the quickstart and the study all go through these."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from stare_agent.config import ENV_KWARG_FIELDS, EnvConfig, RunConfig, SandboxSection
from stare_envs.problems import Problem
from stare_envs.problems.selection import source_name
from stare_envs.registry import make_tool_env, registered_kwargs, registered_problems
from stare_sandbox import SandboxPool, open_pool
from stare_sandbox.ray_fleet import RaySandboxFleet


def open_sandboxes(section: SandboxSection, size: int | None = None) -> SandboxPool | RaySandboxFleet:
    """What a run's episodes lease sandboxes from (``stare_sandbox.open_pool``): ``size`` (default
    ``sandbox.pool_size``) warm sandboxes of ``sandbox.backend`` with ``sandbox.limits``, or the client
    of the Ray fleet ``sandbox.ray`` describes. Close it when done."""
    return open_pool(
        section.pool_size if size is None else size, section.backend, section.limits, fleet=section.ray
    )


def make_env(env: EnvConfig, *, evaluation: bool = False, **runtime: Any) -> Any:
    """The env of ``env.id`` with ``env.env_kwargs(evaluation=...)`` and ``runtime`` (``pool``,
    ``tokenizer``, ...)."""
    return make_tool_env(env.id, **env.env_kwargs(evaluation=evaluation), **runtime)


DEFAULT_TRAIN_PROBLEMS = "mixed"
_said: set[tuple[str, str]] = set()  # (env id, split) whose choice was said


def train_source(config: RunConfig) -> str | Sequence[Problem]:
    """The training problems: ``data.train`` when set, else the problems ``env.id`` was registered
    with (``register_tool_env(..., problems=...)``), else ``mixed`` (see :func:`_configured_or_registered`)."""
    source = _configured_or_registered(config, "train")
    return DEFAULT_TRAIN_PROBLEMS if source is None else source


def eval_source(config: RunConfig) -> str | Sequence[Problem] | None:
    """The validation problems: ``data.eval`` when set, else the problems ``env.id`` was registered
    with, else None."""
    return _configured_or_registered(config, "eval")


def periodic_eval_config(config: RunConfig) -> RunConfig:
    """The config of the periodic validation (``trainer.eval_every``): ``data.eval_limit`` lowered to
    ``trainer.eval_every_limit`` when that is set."""
    limit = config.trainer.eval_every_limit
    if limit is None or (config.data.eval_limit is not None and config.data.eval_limit <= limit):
        return config
    return dataclasses.replace(config, data=dataclasses.replace(config.data, eval_limit=limit))


def _configured_or_registered(config: RunConfig, split: str) -> str | Sequence[Problem] | None:
    """``data.<split>``, else the env's registered problems; when both are set the config wins and one
    line (once per process and env) says so."""
    _say_env_overrides(config)
    configured = config.data.train if split == "train" else config.data.eval
    registered = registered_problems(config.env.id)
    if configured is None:
        return registered
    if (
        registered is not None
        and source_name(registered) != repr(configured)
        and (config.env.id, split) not in _said
    ):
        _said.add((config.env.id, split))
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"[data] data.{split}={configured!r} is used, not the problems {config.env.id} was registered "
                f"with ({source_name(registered)}): set data.{split}=null to use those"
            )
    return configured


def _say_env_overrides(config: RunConfig) -> None:
    """One line (once per process, env and setting) for each ``env`` field the config sets to another
    value than the one ``env.id`` was registered with: the config wins, as it does for the data."""
    registered = registered_kwargs(config.env.id)
    for name, value in config.env.env_kwargs().items():
        key = (config.env.id, f"env.{name}")
        if name not in registered or registered[name] == value or key in _said:
            continue
        _said.add(key)
        if int(os.environ.get("RANK", "0")) == 0:
            own = name in ENV_KWARG_FIELDS
            field = f"env.{name}" if own else f"env.kwargs.{name}"
            fix = f"set {field}=null" if own else f"leave {name} out of env.kwargs"
            print(
                f"[env] {field}={value!r} is used, not the {registered[name]!r} {config.env.id} was registered "
                f"with: {fix} to use that"
            )
