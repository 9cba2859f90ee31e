"""Gymnasium environments for tool-using LLM agents: formats, tools, problems, rewards, rollouts.

The contracts a trainer meets are importable from here: ``Engine``, ``SamplingParams``, ``Generation``
(what an engine is given and returns), ``RolloutRunner`` (plays episodes with any engine) and
``Trajectory`` (what it returns: ids, loss mask, log-probs, as plain lists).

Importing ``stare_envs`` registers the built-in Gymnasium ids (``stare/CodeInterpreter-v0``, one per
problem family, ``stare/AIME2024-v0``, ...) and loads third-party tools and environments declared
as entry points (groups ``stare_agent.tools`` and ``stare_agent.envs``). No torch here.
"""

from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.engine import ContinuousEngine, Engine, Generation, RolloutError, SamplingParams
from stare_envs.formats import (
    FORMATS,
    HermesFormat,
    ParsedTurn,
    ReToolFormat,
    ToolCall,
    ToolFormat,
    get_format,
    register_format,
    unregister_format,
)
from stare_envs.registry import (
    load_plugins,
    make_benchmark_env,
    make_tool_env,
    make_tool_envs,
    register_builtin_envs,
    register_tool_env,
)
from stare_envs.rollout import RolloutRunner
from stare_envs.tool_env import EnvStateError, EpisodeInfrastructureError, ToolEnv
from stare_envs.tools import (
    ToolInputError,
    ToolRegistryError,
    ToolResult,
    ToolSpec,
    get_tool,
    list_tools,
    register_tool,
    unregister_tool,
)
from stare_envs.trajectory import Trajectory, TrajectoryBuilder, TrajectoryError

__all__ = [
    "FORMATS",
    "CodeInterpreterEnv",
    "ContinuousEngine",
    "Engine",
    "Generation",
    "RolloutError",
    "RolloutRunner",
    "SamplingParams",
    "Trajectory",
    "TrajectoryBuilder",
    "TrajectoryError",
    "EnvStateError",
    "EpisodeInfrastructureError",
    "HermesFormat",
    "ParsedTurn",
    "ReToolFormat",
    "ToolCall",
    "ToolEnv",
    "ToolFormat",
    "ToolInputError",
    "ToolRegistryError",
    "ToolResult",
    "ToolSpec",
    "get_format",
    "get_tool",
    "list_tools",
    "load_plugins",
    "make_benchmark_env",
    "make_tool_env",
    "make_tool_envs",
    "register_builtin_envs",
    "register_format",
    "register_tool",
    "register_tool_env",
    "unregister_format",
    "unregister_tool",
]

register_builtin_envs()
load_plugins()
