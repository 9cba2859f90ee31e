"""``ToolEnv``: a multi-turn, text-in/text-out Gymnasium environment where a model solves a problem
with tools and is rewarded for the verified final answer.

One episode is one problem. ``reset`` gives the prompt; each ``step(model_turn)`` parses the turn
with the episode's ``ToolFormat``, runs its tool calls and returns their output as the next
observation. The reward is 0 until the episode ends, then the verified outcome reward.

- ``terminated``: the turn gave a final answer, or called no tool and had no tool-call parse
  error (the model stopped).
- ``truncated``: ``max_turns`` turns were played, or the turn asked for a tool call beyond
  ``max_tool_calls`` (the calls over the limit are not run). The episode is then scored as if it
  gave no answer.
- A turn with a malformed tool call (stray closing tag, broken JSON, empty code, unknown tool,
  oversized input) continues the episode with an observation saying what went wrong.
- ``end_episode(turn)`` / ``end_episode()``: the caller ends the episode (the model's message ended
  with EOS; a token budget ran out); see :meth:`ToolEnv.end_episode`.

Tools that need a sandbox share one leased from a ``SandboxPool`` on the episode's first such
call (so ``reset`` never blocks and episodes without tool calls hold none); it keeps state for the
rest of the episode and goes back to the pool (which resets it) when the episode ends, at the next
``reset``, or at ``close``.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import gymnasium
from gymnasium.spaces import Text
from gymnasium.spaces.space import Space

from stare_envs.errors import EnvError
from stare_envs.formats import (
    ToolCall,
    ToolFormat,
    clean_model_text,
    get_format,
    observation_charset,
    printable,
)
from stare_envs.problems import (
    DIFFICULTIES,
    PROBLEM_FAMILIES,
    Problem,
    generate_problems,
    load_problems,
    procedural_family,
)
from stare_envs.rewards import AnswerChecker, AnswerCheckerError, RewardConfig, compute_reward, reward_config
from stare_envs.text_tokens import encode_as_text
from stare_envs.tools import BoundTool, ToolResult, ToolSpec, get_tool
from stare_sandbox.backends import resolve_backend
from stare_sandbox.config import Backend, SandboxConfig
from stare_sandbox.errors import SandboxError
from stare_sandbox.pool import PooledSandbox, SandboxPool
from stare_sandbox.result import truncate_text

MAX_ACTION_CHARS = 1 << 18
"""``action_space.max_length``: a turn of ~64k tokens. Longer turns are still handled."""

MAX_OBSERVATION_CHARS = 1 << 20
"""``observation_space.max_length``; observations are clipped to it (with a marker)."""


class EnvStateError(EnvError, RuntimeError):
    """The environment was used out of order (``step`` before ``reset`` or after the episode ended)."""


class EpisodeInfrastructureError(EnvError, RuntimeError):
    """The episode's infrastructure failed (its sandbox or container died or was removed, a Docker API
    error, the pool had no sandbox to lease): not the model's doing, so not an observation. The env
    has already ended the episode and given its sandbox back as broken (the pool replaces it); the
    episode can be played again after ``reset``. The original exception is the ``__cause__``."""


_INFRASTRUCTURE_MODULES = frozenset({"docker", "requests", "urllib3", "jupyter_client", "zmq"})


def is_infrastructure_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the sandbox infrastructure (our sandbox errors, OS and connection
    errors, and the errors of the Docker SDK and the Jupyter/ZeroMQ clients) rather than a bug."""
    if isinstance(exc, SandboxError | OSError):
        return True
    return type(exc).__module__.split(".")[0] in _INFRASTRUCTURE_MODULES


class Tokenizer(Protocol):
    """What token truncation of tool output needs (a Hugging Face tokenizer satisfies it)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class UnicodeText(Text):
    """``Text`` over every printable Unicode character plus newline and tab.

    The charset tables (~145k characters) are built once and shared by all instances.
    """

    _tables: tuple[Any, ...] | None = None

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        if UnicodeText._tables is None:
            base = Text(1, charset=observation_charset())
            UnicodeText._tables = (base._char_set, base._char_list, base._char_index, base._char_str)
        self.min_length, self.max_length = int(min_length), int(max_length)
        self._char_set, self._char_list, self._char_index, self._char_str = UnicodeText._tables
        Space.__init__(self, dtype=str, seed=seed)

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length}, charset=<printable unicode, \\n, \\t>)"


def resolve_problems(problems: Sequence[Problem] | str | os.PathLike[str]) -> list[Problem] | str:
    """A list of problems, or the name of a generator family (``"mixed"`` for all families)."""
    family = procedural_family(problems) if isinstance(problems, str) else None
    if family is not None:
        return family
    if isinstance(problems, str | os.PathLike):
        loaded = load_problems(problems)
    else:
        loaded = list(problems)
    if not loaded or not all(isinstance(p, Problem) for p in loaded):
        raise ValueError(
            f"problems must be a non-empty list of stare_envs.problems.Problem, a file, or a family in "
            f"{sorted(PROBLEM_FAMILIES) + ['mixed']}; got {type(problems).__name__} with {len(loaded)} items"
        )
    return loaded


def initial_messages(problem: str, *, system_prompt: str, prompt_template: str) -> list[dict[str, Any]]:
    """The messages an episode starts from, for RL and SFT alike: the system prompt (none when empty)
    and the user message ``prompt_template`` with the problem, made printable as every observation is.

    Example:
        >>> initial_messages("1+1?\x1b", system_prompt="", prompt_template="Solve: {problem}")
        [{'role': 'user', 'content': 'Solve: 1+1?\\\\x1b'}]
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": printable(prompt_template.format(problem=problem))})
    return messages


LIMITS = {
    "max_turns": (1, ""),
    "max_tool_calls": (1, ""),
    "max_output_chars": (64, " so the truncation marker fits"),
    "max_output_tokens": (64, " so the truncation marker fits"),
}
"""The episode limits of a ``ToolEnv``: name -> (least value, why)."""


def broken_limit(**limits: int | None) -> tuple[str, int, str] | None:
    """The first of ``limits`` (names of :data:`LIMITS`; None: not set) that breaks its rule, as
    ``(name, value, rule)``, e.g. ``("max_turns", 0, "must be >= 1")``; None when all keep theirs. The
    one check of the limits: ``ToolEnv`` and ``EnvConfig`` word its error each in its own terms.

    >>> broken_limit(max_turns=0, max_output_chars=4096)
    ('max_turns', 0, 'must be >= 1')
    """
    for name, value in limits.items():
        least, why = LIMITS[name]
        if value is not None and value < least:
            return name, value, f"must be >= {least}{why}"
    return None


class ToolEnv(gymnasium.Env[str, str]):
    """Solve a problem with tools over several turns; reward = verified final answer.

    Args:
        problems: Problems (list), a file for ``load_problems``, or a generator family
            (``"modpow"`` or ``"procedural:modpow"``; ``"mixed"`` for all), generated afresh at each reset from the env's seeded RNG.
        tools: Registered tool names (or specs) the model may call.
        format: ``"retool"``, ``"hermes"`` or a ``ToolFormat``.
        pool: Shared ``SandboxPool`` for tools that need a sandbox; when None the env starts a
            private pool of one (``sandbox_backend``, ``sandbox_config``), closed by ``close()``.
        max_turns: Model turns per episode.
        max_tool_calls: Tool calls per episode.
        max_output_chars: Tool output beyond this is cut (head and tail kept, with a marker; the head
            alone for output a timeout cut short, whose length depends on timing).
        max_output_tokens: With ``tokenizer``, tool output is also cut to this many tokens.
        tokenizer: Anything with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``.
        max_tool_input_chars: A tool call longer than this is refused with a message (not run).
        tool_options: Per-tool keyword options for class tools, e.g. ``{"code_interpreter":
            {"timeout_s": 5}}``.
        reward: Reward mode and shaping: a ``RewardConfig``, or a mapping of its fields (as a YAML
            config's ``env.kwargs.reward`` gives it).
        checker: Answer checker (``stare_envs.rewards.default_checker()`` when None).
        system_prompt: None for the format's instructions, "" for no system message, or a text.
        prompt_template: The user message; ``{problem}`` is replaced by the problem text.
        difficulty: Difficulty of generated problems.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # fps: only to satisfy the checker (text)

    def __init__(
        self,
        problems: Sequence[Problem] | str | os.PathLike[str] = "mixed",
        *,
        tools: Sequence[str | ToolSpec] = ("code_interpreter",),
        format: str | ToolFormat = "hermes",
        pool: SandboxPool | None = None,
        sandbox_backend: Backend = "auto",
        sandbox_config: SandboxConfig | None = None,
        max_turns: int = 8,
        max_tool_calls: int = 8,
        max_output_chars: int = 4096,
        max_output_tokens: int = 1024,
        tokenizer: Tokenizer | None = None,
        max_tool_input_chars: int = 100_000,
        tool_options: Mapping[str, Mapping[str, Any]] | None = None,
        reward: RewardConfig | Mapping[str, Any] | None = None,
        checker: AnswerChecker | None = None,
        system_prompt: str | None = None,
        prompt_template: str = "{problem}",
        difficulty: int = 1,
        render_mode: str | None = None,
    ) -> None:
        broken = broken_limit(
            max_turns=max_turns,
            max_tool_calls=max_tool_calls,
            max_output_chars=max_output_chars,
            max_output_tokens=max_output_tokens,
        )
        if broken is not None:
            name, value, rule = broken
            raise ValueError(f"{name} {rule}, got {value}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.format = get_format(format)
        self.tools: dict[str, ToolSpec] = {}
        for tool in tools:
            spec = tool if isinstance(tool, ToolSpec) else get_tool(tool)
            self.tools[spec.name] = spec
        if self.format.name == "retool" and list(self.tools) != ["code_interpreter"]:
            raise ValueError(
                f"the retool format only calls 'code_interpreter', but tools={list(self.tools)}: "
                "use format='hermes' for other tools"
            )
        unknown = sorted(set(tool_options or {}) - set(self.tools))
        if unknown:
            raise ValueError(f"tool_options for {unknown}, which are not among tools={list(self.tools)}")
        self.problems = resolve_problems(problems)
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
        self.difficulty = difficulty
        self.pool = pool
        self._owns_pool = pool is None
        # Resolved here, when the env is made: `auto` without a usable Docker is an error now, not at the
        # first tool call of an episode. An env whose tools run no code never needs one.
        needs_sandbox = any(spec.needs_sandbox for spec in self.tools.values())
        resolve = pool is None and (needs_sandbox or sandbox_backend != "auto")
        self._sandbox_backend = (
            resolve_backend(sandbox_backend, sandbox_config) if resolve else sandbox_backend
        )
        self._sandbox_config = sandbox_config
        self.max_turns, self.max_tool_calls = max_turns, max_tool_calls
        self.max_output_chars, self.max_output_tokens = max_output_chars, max_output_tokens
        self.tokenizer = tokenizer
        self.max_tool_input_chars = max_tool_input_chars
        self.tool_options = {name: dict(options) for name, options in (tool_options or {}).items()}
        self.reward_config = reward_config(reward)
        self.checker = checker
        self.prompt_template = prompt_template
        self.system_prompt = (
            self.format.system_prompt(self.tool_schemas()) if system_prompt is None else system_prompt
        )
        self.render_mode = render_mode
        self.observation_space = UnicodeText(MAX_OBSERVATION_CHARS)
        self.action_space = UnicodeText(MAX_ACTION_CHARS)
        self.messages: list[dict[str, Any]] = []
        self.problem: Problem | None = None
        self.check_time_s = 0.0  # cumulative seconds spent verifying final answers (for step timing)
        self._sandbox: PooledSandbox | None = None
        self._bound: dict[str, BoundTool] = {}
        self._active = False
        self._turn = self._num_tool_calls = self._num_parse_errors = 0

    # ------------------------------------------------------------------ gymnasium API

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI-style function schemas of the env's tools (a fresh copy)."""
        return [copy.deepcopy(spec.schema()) for spec in self.tools.values()]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """Start an episode on a new problem.

        Options:
            problem: A ``Problem`` to use instead of drawing one.
            problem_index: Index into the env's problem list (for in-order evaluation).
        """
        super().reset(seed=seed)
        self._end_episode()
        self.problem = self._choose_problem(options or {})
        self.messages = initial_messages(
            self.problem.problem, system_prompt=self.system_prompt, prompt_template=self.prompt_template
        )
        prompt = self.messages[-1]["content"]
        self._turn = self._num_tool_calls = self._num_parse_errors = 0
        self._active = True
        info = {
            "problem_id": self.problem.id,
            "messages": copy.deepcopy(self.messages),
            "tools": self.tool_schemas(),
            "format": self.format.name,
            "stop_strings": list(self.format.stop_strings),
        }
        return prompt, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play one model turn; see the module docstring for when the episode ends."""
        if not self._active:
            raise EnvStateError("step() called without an active episode: call reset() first")
        text, replaced = clean_model_text(action)
        self._turn += 1
        parsed = self.format.parse(text)
        notes = list(parsed.errors)
        if replaced:
            notes.insert(
                0,
                f"Your turn contained {replaced} invalid character(s) (control characters or text that "
                "was not valid UTF-8); they were replaced with U+FFFD.",
            )
        results, summaries, over_limit = self._run_calls(parsed.tool_calls, notes)
        self._num_parse_errors += len(notes) - (1 if replaced else 0)
        self._append_message("assistant", text)

        tried_tool = bool(parsed.tool_calls) or bool(parsed.errors)
        terminated = parsed.final_answer is not None or not tried_tool
        truncated = not terminated and (over_limit or self._turn >= self.max_turns)
        info: dict[str, Any] = {
            "tool_calls": summaries,
            "num_tool_calls": self._num_tool_calls,
            "num_parse_errors": self._num_parse_errors,
            "turn": self._turn,
        }
        if not tried_tool and parsed.final_answer is None:
            info["void_turn"] = True  # neither a tool call nor an answer: it ends the episode
        if terminated or truncated:
            return self._final(parsed.final_answer if terminated else None, terminated, info)
        if self.format.observation_role == "tool":  # one tool message, or one per call (parallel calls)
            contents = self.format.render_messages(results, notes)
            share = (MAX_OBSERVATION_CHARS - 64 - 2 * (len(contents) - 1)) // len(contents)
            contents = [truncate_text(printable(c), share)[0] for c in contents]
            for content in contents:
                self._append_message("tool", content)
            info["tool_messages"] = contents
            return "\n\n".join(contents), 0.0, False, False, info
        observation = self.format.render_observation(results, notes)
        observation, _ = truncate_text(printable(observation), MAX_OBSERVATION_CHARS - 64)
        self._append_message(self.format.observation_role, observation)
        return observation, 0.0, False, False, info

    def end_episode(self, action: str | None = None) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """End the active episode from outside the turn protocol, scored by the reward config.

        - ``action`` given: the model's last turn, which ended its message (an EOS token) although the
          turn is not final (an unclosed ``<code>``, a stray ``</code>``, a bad ``<answer>``). Nothing in
          it runs; the episode terminates with the turn's final answer (None when it gives none, or a
          malformed one). The rollout runner does this for formats whose observations stay inside the
          assistant message (ReTool), as verl does, so EOS is never trained as a mid-response token.
        - ``action`` None: the episode is cut from outside (the runner's token budget): truncated and
          scored as giving no answer, like ``max_turns``.

        Either way the reward is the reward config's for that answer (e.g. -1 under ``plus_minus``,
        minus ``format_penalty`` when there is no answer) and the sandbox goes back to the pool at once.
        Returns ``step``'s five-tuple with an empty observation.
        """
        if not self._active:
            raise EnvStateError("end_episode() called without an active episode: call reset() first")
        info: dict[str, Any] = {"tool_calls": [], "turn": self._turn}
        answer = None
        if action is not None:
            text, _ = clean_model_text(action)
            self._turn += 1
            parsed = self.format.parse(text)
            self._num_parse_errors += len(parsed.errors)
            self._append_message("assistant", text)
            answer, info["turn"] = parsed.final_answer, self._turn
            if answer is None and not parsed.tool_calls and not parsed.errors:
                info["void_turn"] = True
        info.update(num_tool_calls=self._num_tool_calls, num_parse_errors=self._num_parse_errors)
        return self._final(answer, action is not None, info)

    def render(self) -> str | None:
        """With ``render_mode="ansi"``: the conversation so far as text."""
        if self.render_mode != "ansi":
            return None
        return "\n".join(f"[{m['role']}]\n{m['content']}" for m in self.messages)

    def close(self) -> None:
        """Return the leased sandbox and close the env's private pool. Idempotent."""
        self._end_episode()
        if self._owns_pool and self.pool is not None:
            self.pool.close()
            self.pool = None
        super().close()

    # ------------------------------------------------------------------ internals

    def _choose_problem(self, options: Mapping[str, Any]) -> Problem:
        if isinstance(options.get("problem"), Problem):
            return options["problem"]
        if isinstance(self.problems, str):
            seed = int(self.np_random.integers(2**31))
            return generate_problems(self.problems, 1, seed=seed, difficulty=self.difficulty)[0]
        if "problem_index" in options:
            return self.problems[int(options["problem_index"]) % len(self.problems)]
        return self.problems[int(self.np_random.integers(len(self.problems)))]

    def _run_calls(
        self, calls: Sequence[ToolCall], notes: list[str]
    ) -> tuple[list[tuple[ToolCall, str]], list[dict[str, Any]], bool]:
        """Run the turn's calls in order; problems go to ``notes``. Returns results, summaries and
        whether a call was refused for exceeding ``max_tool_calls``."""
        results: list[tuple[ToolCall, str]] = []
        summaries: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if self._num_tool_calls >= self.max_tool_calls:
                notes.append(
                    f"Tool call limit of {self.max_tool_calls} per episode reached; "
                    f"{len(calls) - index} call(s) were not run."
                )
                return results, summaries, True
            if call.name not in self.tools:
                notes.append(f"Unknown tool {call.name!r}: available tools are {sorted(self.tools)}.")
                continue
            if len(call.raw) > self.max_tool_input_chars:
                notes.append(
                    f"The {call.name} call is {len(call.raw):,} characters long; the limit is "
                    f"{self.max_tool_input_chars:,}. Nothing was run: send shorter input."
                )
                continue
            result = self._call(call)
            self._num_tool_calls += 1
            text = printable(result.text)
            shown = self._truncate(text, head_only=result.error_type == "Timeout")
            cut = shown != text
            if result.note:
                shown = f"{shown}\n{printable(result.note)}" if shown else printable(result.note)
            results.append((call, shown))
            summaries.append(_summary(call, result, cut=cut))
        return results, summaries, False

    def _call(self, call: ToolCall) -> ToolResult:
        """Run one call. Failures end the episode and give the sandbox back as broken; infrastructure
        failures raise :class:`EpisodeInfrastructureError`, anything else (a bug) propagates as is."""
        try:
            tool = self._bound.get(call.name)
            if tool is None:
                spec = self.tools[call.name]
                sandbox = self._lease() if spec.needs_sandbox else None
                tool = self._bound[call.name] = spec.bind(sandbox, **self.tool_options.get(call.name, {}))
            return tool(call.arguments)
        except Exception as exc:
            self._end_episode(broken=True)
            if is_infrastructure_error(exc):
                raise EpisodeInfrastructureError(
                    f"the {call.name} call failed in the sandbox infrastructure ({type(exc).__name__}: "
                    f"{exc}); the episode was ended and its sandbox handed back for replacement"
                ) from exc
            raise
        except BaseException:
            self._end_episode(broken=True)
            raise

    def _lease(self) -> PooledSandbox:
        if self._sandbox is None:
            if self.pool is None:
                self.pool = SandboxPool(1, backend=self._sandbox_backend, config=self._sandbox_config)
            self._sandbox = self.pool.acquire()
        return self._sandbox

    def _truncate(self, text: str, *, head_only: bool = False) -> str:
        """``text`` within ``max_output_chars`` and ``max_output_tokens``: head and tail with a marker
        saying how much was cut; ``head_only`` (output cut short by a timeout, whose length depends on
        timing) keeps the head alone, with a marker that names no amount, so that the same code
        shows the same output in every run once it printed more than the limit."""
        if head_only:
            start = text[: self.max_output_chars]
            if self.tokenizer is not None:
                ids = encode_as_text(self.tokenizer, start)
                if len(ids) > self.max_output_tokens:
                    start = self.tokenizer.decode(ids[: self.max_output_tokens])
            return text if start == text else f"{start}\n... [the output went on until the timeout]"
        text, _ = truncate_text(text, self.max_output_chars)
        if self.tokenizer is None:
            return text
        # the tokens the model sees: a special-token string printed by the code is text, several tokens
        ids = encode_as_text(self.tokenizer, text)
        if len(ids) <= self.max_output_tokens:
            return text
        head = self.max_output_tokens // 2
        tail = self.max_output_tokens - head
        cut = len(ids) - self.max_output_tokens
        return (
            f"{self.tokenizer.decode(ids[:head])}\n... [{cut} tokens truncated] ...\n"
            f"{self.tokenizer.decode(ids[len(ids) - tail :])}"
        )

    def _final(
        self, answer: str | None, terminated: bool, info: dict[str, Any]
    ) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Score the episode on ``answer``, close it (sandbox back to the pool) and return the last step."""
        reward, reward_info = self._score(answer)
        info.update(answer=reward_info["answer"], correct=reward_info["correct"], gold=self._gold())
        # Timings (e.g. the checker's ``check_s``) stay out: a seeded replay must give equal infos.
        info["reward_info"] = {k: v for k, v in reward_info.items() if not k.endswith("_s")}
        self._end_episode()
        return "", reward, terminated, not terminated, info

    def _score(self, answer: str | None) -> tuple[float, dict[str, Any]]:
        assert self.problem is not None
        start = time.perf_counter()
        try:
            reward, info = compute_reward(
                answer,
                self.problem.answer,
                config=self.reward_config,
                checker=self.checker,
                num_tool_calls=self._num_tool_calls,
            )
        except AnswerCheckerError as exc:  # the checker could not give a verdict: never a silent 0
            raise EpisodeInfrastructureError(
                f"the answer of this episode could not be checked ({exc}); the episode is played again"
            ) from exc
        info["check_s"] = elapsed = time.perf_counter() - start
        self.check_time_s += elapsed
        return reward, info

    def _gold(self) -> str:
        if self.problem is None:
            raise EnvStateError("no problem drawn yet: call reset() first")
        return self.problem.answer

    def _append_message(self, role: str, content: str) -> None:
        last = self.messages[-1] if self.messages else None
        if role == "assistant" and last is not None and last["role"] == "assistant":
            last["content"] += content
        else:
            self.messages.append({"role": role, "content": content})

    def _end_episode(self, broken: bool = False) -> None:
        """Close the episode's tools and give its sandbox back (replaced when ``broken``)."""
        self._active = False
        bound, self._bound = self._bound, {}
        for tool in bound.values():
            tool.close()
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None and self.pool is not None:
            self.pool.release(sandbox, broken=broken)


def _summary(call: ToolCall, result: ToolResult, cut: bool) -> dict[str, Any]:
    """Per-call numbers for ``info["tool_calls"]``; ``truncated`` covers the sandbox's and our cut."""
    exec_result = result.exec_result
    return {
        "name": call.name,
        "duration_s": exec_result.duration_s if exec_result else None,
        "cpu_s": exec_result.cpu_s if exec_result else None,
        "peak_memory_bytes": exec_result.peak_memory_bytes if exec_result else None,
        "timed_out": exec_result.timed_out if exec_result else False,
        "state_lost": exec_result.state_lost if exec_result else False,
        "error_type": result.error_type,
        "truncated": cut or bool(exec_result and exec_result.truncated),
    }
