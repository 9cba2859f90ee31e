"""verifiers: our code-interpreter environment as a verifiers environment.

``load_environment(...)`` returns a :class:`StareCodeInterpreterEnv`, a verifiers ``StatefulToolEnv``
(the classic environment API, ``import verifiers as vf``, which verifiers 0.3 serves from
``verifiers.legacy``): the model gets our ``code_interpreter`` tool as an OpenAI function (native
tool calling, so any served model with a tool-call parser works), each rollout leases one Docker
sandbox from a :class:`~stare_sandbox.SandboxPool` at its first call and keeps its variables until the
rollout ends (a verifiers ``@cleanup`` handler gives it back), and the rubric scores the final
answer with our checker (:func:`stare_envs.rewards.compute_reward`).

Run it with verifiers' own tooling, e.g. against any OpenAI-compatible server::

    vf-eval stare_integrations.verifiers_env -a '{"data": "aime2024"}' -m MODEL -b http://host:port/v1

Tool output goes back to verifiers as the verbatim content of a ``tool`` message; the served model's
chat template turns the conversation into tokens on the server, with special tokens parsed. So, unlike in
our own runner (:func:`stare_envs.text_tokens.encode_as_text`), a special-token string printed by the model's
code (``<|im_end|>``) can reach the model as that token there. It is left to the server on purpose:
escaping the text here would change what the model reads, and the token ids are the server's to build.

Install: ``pip install 'stare-agent[verifiers]'``. Example in the README ("Use with verl / TRL /
verifiers").
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import verifiers as vf
from datasets import Dataset

from stare_envs.formats import find_answer
from stare_envs.problems import generate_problems, load_problems, procedural_family
from stare_envs.rewards import RewardConfig, compute_reward
from stare_integrations._sandboxes import LeasedTools, ToolSession
from stare_sandbox.config import SandboxConfig
from stare_sandbox.pool import SandboxPool
from stare_sandbox.ray_fleet import RayFleetConfig
from stare_sandbox.result import truncate_text

__all__ = ["StareCodeInterpreterEnv", "correct_answer", "load_environment"]

SYSTEM_PROMPT = (
    "Solve the problem. You can run Python code with the code_interpreter tool: it is a stateful Jupyter "
    "kernel (variables and imports persist between calls) with numpy, sympy and scipy; print what you "
    "want to see. Give the final answer as \\boxed{...}."
)


def correct_answer(completion: Any, answer: str, **kwargs: Any) -> float:
    """Rubric function: 1.0 when the last assistant message's final answer (``<answer>`` or the last
    ``\\boxed{}``) is ``answer`` by our checker (integers by value, the rest by math-verify), else 0.0."""
    text = ""
    for message in reversed(completion if isinstance(completion, list) else []):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if role == "assistant" and isinstance(content, str) and content.strip():
            text = content
            break
    if isinstance(completion, str):
        text = completion
    final, _, _ = find_answer(text)
    reward, _ = compute_reward(final, str(answer), config=RewardConfig())
    return reward


class StareCodeInterpreterEnv(vf.StatefulToolEnv):
    """A verifiers ``StatefulToolEnv`` whose one tool is our sandboxed, stateful ``code_interpreter``.

    Args:
        dataset: Rows with ``question`` and ``answer`` (see :func:`load_environment`).
        pool_size: Sandboxes kept warm (rollouts that run code at once; the others wait up to
            ``lease_timeout_s``). The pool starts at the first call.
        backend: ``"docker"`` (default), ``"local"``, ``"auto"``, or ``"ray"``: the sandbox fleet of the
            Ray cluster this process runs in (docs/deployment.md), as ``ray_fleet`` configures it.
        sandbox_config: Limits of each sandbox.
        timeout_s: Per-call timeout of the code; None for the sandbox config's.
        max_output_chars: Tool output beyond this is cut (head and tail kept, with a marker).
        lease_timeout_s: How long a rollout waits for a free sandbox.
        ray_fleet: With ``backend="ray"``: the fleet's settings (None: ``RayFleetConfig``'s defaults).
        **kwargs: verifiers' environment options (``max_turns``, ``system_prompt``, ``eval_dataset``, ...).
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        pool_size: int = 4,
        backend: str = "docker",
        sandbox_config: SandboxConfig | None = None,
        timeout_s: float | None = None,
        max_output_chars: int = 4096,
        lease_timeout_s: float = 60.0,
        ray_fleet: RayFleetConfig | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        kwargs.setdefault("max_turns", 8)
        super().__init__(dataset=dataset, rubric=vf.Rubric(funcs=[correct_answer]), **kwargs)
        self.pool_size, self.backend, self.sandbox_config = pool_size, backend, sandbox_config
        self.timeout_s, self.max_output_chars, self.lease_timeout_s = (
            timeout_s,
            max_output_chars,
            lease_timeout_s,
        )
        self._tools = LeasedTools(pool_size, backend, sandbox_config, lease_timeout_s, timeout_s, ray_fleet)
        self._lock = threading.Lock()
        self._sessions: dict[str, ToolSession] = {}
        self.add_tool(self.code_interpreter, args_to_skip=["session"])

    async def setup_state(self, state: vf.State, **kwargs: Any) -> vf.State:
        """Name the rollout's sandbox session (the sandbox itself is leased at the first call)."""
        state = await super().setup_state(state, **kwargs) or state
        state["stare_session"] = uuid.uuid4().hex
        return state

    def update_tool_args(
        self, tool_name: str, tool_args: dict, messages: vf.Messages, state: vf.State, **kwargs: Any
    ) -> dict:
        return (
            {**tool_args, "session": state["stare_session"]} if tool_name == "code_interpreter" else tool_args
        )

    async def code_interpreter(self, code: str, session: str) -> str:
        """Run Python code in a stateful Jupyter kernel (variables and imports persist between calls) and
        return what it prints. numpy, sympy and scipy are available.

        Args:
            code: Python code to run.
        """
        result = await asyncio.to_thread(self._run, session, code)
        return truncate_text(result.text, self.max_output_chars)[0]

    @vf.cleanup
    async def release_sandbox(self, state: vf.State) -> None:
        """Give the rollout's sandbox back to the pool (which resets it) when the rollout ends."""
        self._release(state.get("stare_session"))

    @vf.teardown
    async def close_pool(self) -> None:
        """Close the pool (every sandbox) when verifiers tears the environment down."""
        self.close()

    @property
    def pool(self) -> SandboxPool | None:
        """The sandbox pool, once the first call started it."""
        return self._tools.pool

    def close(self) -> None:
        """Give back every sandbox and close the pool. Idempotent."""
        for session in list(self._sessions):
            self._release(session)
        self._tools.close()

    def _run(self, session: str, code: str) -> Any:
        with self._lock:
            leased = self._sessions.setdefault(session, ToolSession())
        try:
            return self._tools.run(leased, {"code": code})
        except Exception:
            self._release(session, broken=True)
            raise

    def _release(self, session: str | None, broken: bool = False) -> None:
        with self._lock:
            leased = self._sessions.pop(session, None) if session else None
        if leased is not None:
            self._tools.end(leased, broken=broken)


def load_environment(
    data: str = "aime2024",
    *,
    limit: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> StareCodeInterpreterEnv:
    """Our code-interpreter environment for verifiers (``vf.load_environment`` / ``vf-eval``).

    Args:
        data: A built-in set (``aime2024``, ``aime2025``, ``amc23``, ``math500``), a problem file
            (JSONL/Parquet, as ``stare_envs.problems.load_problems`` reads), or a generator family
            (``procedural:<family>``, a bare family name, ``mixed``) for ``limit`` (default 100)
            generated problems (``stare_envs.problems.procedural_family`` decides which).
        limit: At most this many problems.
        seed: Seed of generated problems.
        **kwargs: :class:`StareCodeInterpreterEnv`'s options (``pool_size``, ``backend``, ``timeout_s``,
            ``max_turns``, ...).
    """
    family = procedural_family(data)
    if family is not None:
        problems = generate_problems(family, limit or 100, seed=seed)
    else:
        problems = load_problems(data, limit=limit)
    rows = [{"question": p.problem, "answer": p.answer, "info": {"problem_id": p.id}} for p in problems]
    return StareCodeInterpreterEnv(Dataset.from_list(rows), **kwargs)
