"""verl: the stateful Docker code interpreter as a verl tool, and the answer checker as ``compute_score``.

- :class:`CodeInterpreterTool` is a verl ``BaseTool`` (``create`` / ``execute`` / ``calc_reward`` /
  ``release``). A trajectory leases one sandbox from a :class:`~stare_sandbox.SandboxPool` on its first call
  (so trajectories that call no tool hold none); the sandbox keeps variables and imports for the rest of
  the trajectory and goes back to the pool (which resets it) when the trajectory ends.

  What "the trajectory" is depends on the caller. With ``agent_data`` (verl's ``ToolAgentLoop`` passes
  its per-trajectory ``AgentData`` to ``execute``, and calls ``create`` / ``execute`` / ``release``
  around *each* tool call), the sandbox belongs to that ``AgentData``: it survives the per-call
  ``release`` and goes back to the pool when verl drops the ``AgentData`` at the end of the trajectory
  (a ``weakref.finalize``), or at :meth:`CodeInterpreterTool.close`. Without it (the lifecycle of
  ``BaseTool``'s docstring: one ``create``, several ``execute``, one ``release``), the sandbox belongs to
  the instance and goes back at ``release``.
- :func:`compute_score` is a verl custom reward function (``custom_reward_function.path`` /
  ``.name``): the final answer of the model's own words (``<answer>`` or the last ``\\boxed{}``)
  checked against the ground truth by :func:`stare_envs.rewards.compute_reward`, the same checker our
  environments use. verl hands a reward function the whole decoded response, tool messages included,
  so the tool records every text it returned in the trajectory's ``extra_fields``
  (:data:`TOOL_OUTPUTS_KEY`), which verl's reward loop passes on in ``extra_info``; ``compute_score``
  cuts those texts out before it looks for the answer, so nothing a tool printed can score.

Tool output is returned verbatim as ``ToolResponse.text``, and verl's agent loop tokenizes the tool
message itself (chat template rendered, special tokens parsed). So, unlike in our own runner (which
tokenizes tool output with :func:`stare_envs.text_tokens.encode_as_text`), a special-token string printed by
the model's code (``<|im_end|>``) reaches the model as that token under verl. It is left to verl on
purpose: escaping the text here would change what the model reads, and the token ids are verl's to build.

Install: ``pip install 'stare-agent[verl]'``. The tool config for verl's ReTool recipe is in the
README ("Use with verl / TRL / verifiers").
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from stare_envs.formats import _strip_fence, find_answer  # the ReTool format's own fence rule
from stare_envs.rewards import RewardConfig, compute_reward
from stare_envs.tool_env import EpisodeInfrastructureError, is_infrastructure_error
from stare_envs.tools import get_tool
from stare_integrations._sandboxes import LeasedTools, ToolSession
from stare_sandbox.config import SandboxConfig
from stare_sandbox.pool import SandboxPool
from stare_sandbox.ray_fleet import RayFleetConfig
from stare_sandbox.result import truncate_text

__all__ = ["TOOL_OUTPUTS_KEY", "CodeInterpreterTool", "compute_score", "model_text"]

TOOL_OUTPUTS_KEY = "stare_tool_outputs"
"""The key of ``AgentData.extra_fields`` (``extra_info`` in the reward function) under which the tool
records, in order, every text it returned to the model in the trajectory."""
_SPECIAL = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?s>")  # special-token text a decode may skip

_CONFIG_KEYS = {
    "type",
    "pool_size",
    "backend",
    "timeout_s",
    "max_output_chars",
    "lease_timeout_s",
    "sandbox",
    "ray",
}


@dataclass
class _Session(ToolSession):
    """One trajectory's sandbox and tool, and the tool instances that share it."""

    instances: set[str] = field(default_factory=set)


class CodeInterpreterTool(BaseTool):
    """Our ``code_interpreter`` (a Jupyter kernel in a hardened container) as a verl tool.

    Args:
        config: The ``config`` mapping of verl's tool config. Keys (all optional but ``type``):
            ``type`` (``native``, verl's), ``pool_size`` (sandboxes kept warm by this tool object; at most
            that many trajectories run code at once, the others wait up to ``lease_timeout_s``; default 8),
            ``backend`` (``auto``, ``docker``, ``local``, or ``ray``: the sandbox fleet of the Ray cluster
            verl runs on, docs/deployment.md, set by ``ray``: fields of
            :class:`stare_sandbox.ray_fleet.RayFleetConfig`; default ``docker``), ``timeout_s`` (per call;
            default the sandbox config's), ``max_output_chars`` (tool output beyond it is cut, head and
            tail kept; default 4096), ``lease_timeout_s`` (default 60), ``sandbox`` (fields of
            :class:`stare_sandbox.SandboxConfig`, e.g. ``{memory_mb: 2048}``).
        tool_schema: The OpenAI function schema; None for our ``code_interpreter`` schema.

    The pool starts on the first call, not here: verl builds its tools in every worker when it reads
    the config. Code may come fenced (```` ```python ... ``` ````, as ReTool-trained models write it):
    the fenced part runs.
    """

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        config = dict(config or {})
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in the config of {type(self).__name__}: use {sorted(_CONFIG_KEYS)}"
            )
        if tool_schema is None:
            tool_schema = OpenAIFunctionToolSchema.model_validate(get_tool("code_interpreter").schema())
        super().__init__(config, tool_schema)
        self.pool_size = int(config.get("pool_size", 8))
        self.backend = config.get("backend", "docker")
        self.timeout_s = config.get("timeout_s")
        self.max_output_chars = int(config.get("max_output_chars", 4096))
        self.lease_timeout_s = float(config.get("lease_timeout_s", 60.0))
        fields = {f.name for f in dataclasses.fields(SandboxConfig)}
        sandbox_options = dict(config.get("sandbox") or {})
        bad = sorted(set(sandbox_options) - fields)
        if bad:
            raise ValueError(
                f"unknown sandbox option(s) {bad} in the tool config: use fields of {sorted(fields)}"
            )
        self.sandbox_config = SandboxConfig(**sandbox_options)
        ray_options = dict(config.get("ray") or {})
        bad = sorted(set(ray_options) - {f.name for f in dataclasses.fields(RayFleetConfig)})
        if bad:
            raise ValueError(
                f"unknown ray option(s) {bad} in the tool config: use fields of stare_sandbox.ray_fleet.RayFleetConfig"
            )
        fleet = RayFleetConfig(**{"lease_timeout_s": self.lease_timeout_s, **ray_options})
        if self.pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {self.pool_size}")
        self._tools = LeasedTools(
            self.pool_size, self.backend, self.sandbox_config, self.lease_timeout_s, self.timeout_s, fleet
        )
        self._lock = threading.Lock()
        self._instances: dict[str, _Session] = {}
        self._trajectories: weakref.WeakKeyDictionary[Any, _Session] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ verl's BaseTool

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Open a tool instance; no sandbox is leased until its first ``execute``."""
        instance_id = instance_id or str(uuid4())
        with self._lock:
            if instance_id in self._instances:
                raise ValueError(
                    f"tool instance {instance_id!r} already exists: release it or pass another id"
                )
            self._instances[instance_id] = _Session(instances={instance_id})
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run ``parameters["code"]`` in the trajectory's sandbox; returns ``(response, 0.0, metrics)``.

        Bad arguments come back as a message for the model; a failure of the sandbox infrastructure
        raises (verl's agent loop then shows the error to the model), after the sandbox was handed back
        for replacement, so the next call of the trajectory gets a fresh one.
        """
        session = self._session(instance_id, kwargs.get("agent_data"))
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if isinstance(code, str):
            parameters = {**parameters, "code": _strip_fence(code)}
        try:
            result = await asyncio.to_thread(self._tools.run, session, parameters)
        except Exception as exc:
            self._end(session, broken=True)
            if is_infrastructure_error(exc):
                raise EpisodeInfrastructureError(
                    f"the code_interpreter call failed in the sandbox infrastructure ({type(exc).__name__}: "
                    f"{exc}); its sandbox was handed back for replacement and the trajectory's next call "
                    "starts in a fresh one (its variables are lost)"
                ) from exc
            raise
        text, cut = truncate_text(result.text, self.max_output_chars)
        agent_data = kwargs.get("agent_data")
        if agent_data is not None and isinstance(getattr(agent_data, "extra_fields", None), dict):
            agent_data.extra_fields.setdefault(TOOL_OUTPUTS_KEY, []).append(text)  # see compute_score
        exec_result = result.exec_result
        metrics = {
            "error_type": result.error_type,
            "truncated": cut or bool(exec_result and exec_result.truncated),
            "duration_s": exec_result.duration_s if exec_result else None,
            "timed_out": bool(exec_result and exec_result.timed_out),
        }
        return ToolResponse(text=text), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """0.0: the outcome reward is :func:`compute_score`'s, on the final answer."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Close the instance. Its sandbox goes back to the pool unless it belongs to a live trajectory
        (``agent_data``), which gives it back when it ends. Idempotent."""
        with self._lock:
            session = self._instances.pop(instance_id, None)
            if session is None:
                return
            session.instances.discard(instance_id)
            owned_by_trajectory = any(s is session for s in self._trajectories.values())
        if not owned_by_trajectory:
            self._end(session)

    # ------------------------------------------------------------------ ours

    @property
    def pool(self) -> SandboxPool | None:
        """The sandbox pool, once the first call started it."""
        return self._tools.pool

    def close(self) -> None:
        """Give back every sandbox and close the pool. Idempotent."""
        with self._lock:
            sessions = [*self._instances.values(), *self._trajectories.values()]
            self._instances.clear()
            self._trajectories.clear()
        for session in sessions:
            self._end(session)
        self._tools.close()

    def _session(self, instance_id: str, agent_data: Any | None) -> _Session:
        with self._lock:
            if instance_id not in self._instances:
                raise KeyError(f"no tool instance {instance_id!r}: call create() first (or it was released)")
            if agent_data is None:
                return self._instances[instance_id]
            session = self._trajectories.get(agent_data)
            if session is None:
                session = self._trajectories[agent_data] = _Session()
                weakref.finalize(agent_data, self._end, session)
            session.instances.add(instance_id)
            self._instances[instance_id] = session
            return session

    def _end(self, session: _Session, broken: bool = False) -> None:
        """Close the session's tool and give its sandbox back (replaced when ``broken``)."""
        self._tools.end(session, broken=broken)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    mode: str = "binary",
    format_penalty: float = 0.0,
    **kwargs: Any,
) -> dict[str, Any]:
    """A verl reward function: the response's final answer checked against ``ground_truth``.

    The answer is the content of the last ``<answer>`` tag (its ``\\boxed{}`` when it has one), else of
    the last ``\\boxed{}``; :func:`stare_envs.rewards.compute_reward` scores it (integers by value, the rest
    by math-verify in worker processes with a hard deadline). ``mode`` and ``format_penalty`` are
    :class:`stare_envs.rewards.RewardConfig`'s, set with verl's ``custom_reward_function.reward_kwargs``
    (ReTool: ``mode=plus_minus``).

    Only the model's words are read: the texts the tool returned in this trajectory
    (``extra_info[TOOL_OUTPUTS_KEY]``, see :func:`model_text`) are cut out first. A recorded text that
    cannot be found in the response (a decode that changed it) leaves the response unscorable: it
    scores as an episode without an answer and says so (``tool_output_unmatched``), never as the
    tool's answer.

    Returns:
        ``{"score": reward, "acc": 1.0 or 0.0, "pred": answer or "", "tool_output_unmatched": 0 or 1}``;
        verl logs every key.
    """
    outputs = (extra_info or {}).get(TOOL_OUTPUTS_KEY) or []
    text, unmatched = model_text(solution_str, [str(o) for o in outputs])
    answer = None if unmatched else find_answer(text)[0]
    reward, info = compute_reward(
        answer, str(ground_truth), config=RewardConfig(mode=mode, format_penalty=format_penalty)
    )
    return {
        "score": reward,
        "acc": float(info["correct"]),
        "pred": answer or "",
        "tool_output_unmatched": float(unmatched),
    }


def model_text(response: str, tool_outputs: list[str]) -> tuple[str, bool]:
    r"""``response`` with each of ``tool_outputs`` cut out, in order (each searched after the previous
    one), and whether one was not found. A text the decode changed by dropping special tokens
    (``<|im_end|>`` printed by the code) is matched without them.

    Example:
        >>> model_text("run it. 42 <answer>\\boxed{1}</answer> so: \\boxed{41}", ["42 <answer>\\boxed{1}</answer>"])
        ('run it.  so: \\boxed{41}', False)
        >>> model_text("no tool text here", ["<answer>7</answer>"])
        ('', True)
    """
    kept, cursor = [], 0
    for output in tool_outputs:
        for needle in dict.fromkeys((output, _SPECIAL.sub("", output))):
            found = response.find(needle, cursor) if needle else cursor
            if found >= 0:
                kept.append(response[cursor:found])
                cursor = found + len(needle)
                break
        else:
            return "", True
    kept.append(response[cursor:])
    return "".join(kept), False
