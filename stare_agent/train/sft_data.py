"""Cold-start SFT data: trace formats in, masked token-exact trajectories out.

A :class:`Trace` is one solved problem as the model should learn to write it: the problem, then
steps that are either written by the model or inserted by the tool. Readers turn four inputs into
traces:

- **ReTool** (``JoeYing/ReTool-SFT``): ``messages = [user, assistant]``; the user text ends with
  ``*user question:*`` and the problem; the assistant text interleaves ``<code>``, ``<interpreter>``
  and ``<answer>``. Every ``<interpreter>...</interpreter>`` block, with the whitespace before it and
  one newline after it, is a tool step; everything else is the model's.
- **OpenAI messages with tool calls**: assistant messages with ``tool_calls`` and ``tool`` messages;
  written in the hermes format (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as
  ``tool`` messages), as the hermes environment plays it.
- **ToRA** (fenced ```` ```python ```` code followed by ```` ```output ```` blocks): CONVERTED to the
  ReTool format (code wrapped in ``<code>``, the output block becomes ``<interpreter>``), because the
  RL environment speaks ReTool: a model cold-started on ToRA's own fences would write code the
  environment never runs. The final ``\\boxed{}`` stays where it is (the format accepts a bare box).
- **Procedural traces** (:func:`procedural_traces`): problems from ``stare_envs.problems`` whose solution
  code is REALLY run in a sandbox; the genuine output fills the ``<interpreter>`` block, and only
  traces whose output equals the gold answer are kept.

:func:`trace_to_trajectory` renders the prompt exactly as the RL environment does (the format's
system prompt and ``prompt_template``, the chat template with the generation prompt) and appends the
steps with :class:`stare_envs.trajectory.TrajectoryBuilder`: model text mask 1, tool output and chat
template glue mask 0, the end-of-turn token mask 1 (the model must learn to stop). So SFT trains
exactly the tokens RL would train, with the same machinery.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stare_agent.errors import StareError
from stare_envs.formats import CODE_TOOL, ReToolFormat, ToolCall, get_format
from stare_envs.problems import Problem, ProblemSourceError, generate_problems, read_rows
from stare_envs.rollout import ToolTurnGlue
from stare_envs.rollout import render_prompt as rollout_prompt
from stare_envs.text_tokens import encode_as_text
from stare_envs.tool_env import initial_messages
from stare_envs.tools import get_tool, render_exec_result
from stare_envs.trajectory import Trajectory, TrajectoryBuilder
from stare_sandbox.base import Sandbox

StepKind = Literal["model", "tool"]
TraceFormat = Literal["retool", "openai", "tora"]
QUESTION_MARKER = "*user question:*"
_INTERPRETER = re.compile(r"\s*<interpreter>.*?</interpreter>[ \t]*\n?", re.DOTALL)
_TORA_BLOCK = re.compile(
    r"```python[ \t]*\n(.*?)```[ \t]*\n?(\s*```output[ \t]*\n(.*?)```[ \t]*\n?)?", re.DOTALL
)


class SFTDataError(StareError, ValueError):
    """SFT data that cannot be read or converted; the message names the row, the cause and the fix."""


@dataclass(frozen=True)
class Trace:
    """One SFT example before tokenization.

    Attributes:
        id: Row id (for error messages and logs).
        problem: The problem text (the user message is rendered from it as in the RL environment).
        steps: ``(kind, text)`` in order; ``model`` steps are trained, ``tool`` steps are not. In the
            ``retool`` format a tool step is the exact inserted text (``\\n<interpreter>...</interpreter>\\n``);
            in ``hermes`` it is the content of a ``tool`` message (glue is added when tokenizing).
        format: The tool-call format the model writes (``retool``, ``hermes``, or any registered one).
        answer: The gold answer when known.
        tools: The schemas of the env's tools, as its prompt lists them; None: the code tool.
    """

    id: str
    problem: str
    steps: list[tuple[StepKind, str]]
    format: str = "retool"
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    def to_retool_row(self) -> dict[str, Any]:
        """The ReTool-SFT row of a ReTool trace: ``messages = [user, assistant]``."""
        if self.format != "retool":
            raise SFTDataError(
                f"trace {self.id} is in the {self.format} format: only ReTool traces become ReTool rows"
            )
        return {
            "id": self.id,
            "messages": [
                {"role": "user", "content": f"{QUESTION_MARKER}\n{self.problem}"},
                {"role": "assistant", "content": "".join(text for _, text in self.steps)},
            ],
            "answer": self.answer,
        }


# ------------------------------------------------------------------------------------- readers


def split_retool_response(text: str) -> list[tuple[StepKind, str]]:
    """Split a ReTool assistant text into model steps and ``<interpreter>`` tool steps (no empty steps)."""
    steps: list[tuple[StepKind, str]] = []
    pos = 0
    for block in _INTERPRETER.finditer(text):
        if block.start() > pos:
            steps.append(("model", text[pos : block.start()]))
        steps.append(("tool", block.group(0)))
        pos = block.end()
    if pos < len(text):
        steps.append(("model", text[pos:]))
    return steps


def _messages(row: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    messages = row.get("messages")
    if isinstance(messages, str):  # some exports store the list as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            messages = None
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise SFTDataError(
            f"{where}: no 'messages' list of {{role, content}} objects: give each row a 'messages' field"
        )
    return [dict(m) for m in messages]


def _problem_from_user(messages: list[dict[str, Any]], where: str) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise SFTDataError(f"{where}: no user message: each trace needs the problem as a user message")
    text = str(users[0].get("content") or "")
    marker = text.rfind(QUESTION_MARKER)
    if marker >= 0:
        text = text[marker + len(QUESTION_MARKER) :].replace("<answer>", "").replace("</answer>", "")
    return text.strip()


def _assistant_text(messages: list[dict[str, Any]], where: str) -> str:
    replies = [m for m in messages if m.get("role") == "assistant"]
    if len(replies) != 1:
        raise SFTDataError(
            f"{where}: expected one assistant message with the whole trace, found {len(replies)}: "
            "use format=openai for multi-message tool-call traces"
        )
    return str(replies[0].get("content") or "")


def retool_trace(row: Mapping[str, Any], where: str = "row") -> Trace:
    """A ReTool-SFT row -> trace (``<interpreter>`` blocks are tool steps)."""
    messages = _messages(row, where)
    steps = split_retool_response(_assistant_text(messages, where))
    return Trace(
        str(row.get("id", where)), _problem_from_user(messages, where), steps, "retool", _answer(row)
    )


def tora_trace(row: Mapping[str, Any], where: str = "row") -> Trace:
    """A ToRA row (```` ```python ```` then ```` ```output ````) -> a ReTool trace (see the module docstring)."""
    messages = _messages(row, where)
    text = _assistant_text(messages, where)
    out: list[tuple[StepKind, str]] = []
    pos = 0
    for block in _TORA_BLOCK.finditer(text):
        code, output = block.group(1), block.group(3)
        prefix = text[pos : block.start()]
        out.append(("model", f"{prefix}<code>\n```python\n{code.rstrip()}\n```\n</code>"))
        if output is not None:
            call = ToolCall(CODE_TOOL, {"code": code}, "")
            out.append(("tool", ReToolFormat().render_observation([(call, output.strip())])))
        pos = block.end()
    if pos < len(text):
        out.append(("model", text[pos:]))
    steps = _merge_model_steps(out)
    answer = row.get("gt") if row.get("gt") is not None else _answer(row)
    return Trace(
        str(row.get("id", where)), _problem_from_user(messages, where), steps, "retool", _str(answer)
    )


def openai_trace(row: Mapping[str, Any], where: str = "row") -> Trace:
    """OpenAI-style messages (assistant ``tool_calls``, ``tool`` messages) -> a hermes trace."""
    messages = _messages(row, where)
    steps: list[tuple[StepKind, str]] = []
    pending: list[tuple[ToolCall, str]] = []
    calls: list[ToolCall] = []
    hermes = get_format("hermes")
    for message in messages:
        role = message.get("role")
        if role == "assistant":
            if pending:
                steps.append(("tool", hermes.render_observation(pending)))
                pending = []
            calls = [_call(c, where) for c in message.get("tool_calls") or []]
            text = str(message.get("content") or "")
            for call in calls:
                text += ("\n" if text else "") + call.raw
            steps.append(("model", text))
        elif role == "tool":
            if not calls:
                raise SFTDataError(
                    f"{where}: a tool message without a preceding tool call: fix the message order"
                )
            call = calls[min(len(pending), len(calls) - 1)]
            pending.append((call, str(message.get("content") or "")))
    if pending:
        raise SFTDataError(f"{where}: the trace ends with a tool result: end it with the assistant's answer")
    if not steps:
        raise SFTDataError(f"{where}: no assistant message: each trace needs the model's reply")
    return Trace(
        str(row.get("id", where)), _problem_from_user(messages, where), steps, "hermes", _answer(row)
    )


def _call(raw: Mapping[str, Any], where: str) -> ToolCall:
    function = raw.get("function", raw)
    name = function.get("name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise SFTDataError(f"{where}: tool call arguments are not JSON: {arguments[:80]!r}") from None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise SFTDataError(f"{where}: a tool call needs a 'name' and an 'arguments' object")
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return ToolCall(name, arguments, f"<tool_call>\n{body}\n</tool_call>")


def _merge_model_steps(steps: list[tuple[StepKind, str]]) -> list[tuple[StepKind, str]]:
    merged: list[tuple[StepKind, str]] = []
    for kind, text in steps:
        if not text:
            continue
        if merged and kind == "model" and merged[-1][0] == "model":
            merged[-1] = ("model", merged[-1][1] + text)
        else:
            merged.append((kind, text))
    return merged


def _answer(row: Mapping[str, Any]) -> str | None:
    for key in ("answer", "gt", "ground_truth", "final_answer"):
        if row.get(key) is not None:
            return _str(row[key])
    return None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def detect_format(row: Mapping[str, Any], where: str = "row") -> TraceFormat:
    """``openai`` when a message has ``tool_calls`` or the ``tool`` role, ``tora`` when the assistant
    writes ```` ```output ```` blocks, else ``retool``."""
    messages = _messages(row, where)
    if any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return "openai"
    if any(m.get("role") == "assistant" and "```output" in str(m.get("content") or "") for m in messages):
        return "tora"
    return "retool"


READERS = {"retool": retool_trace, "openai": openai_trace, "tora": tora_trace}


def read_traces(source: str | Path, *, format: str = "auto", limit: int | None = None) -> list[Trace]:
    """Read traces from a JSONL/JSON/Parquet file or a Hugging Face dataset (``name`` or ``name:split``).

    Raises:
        SFTDataError: missing file, unreachable hub, unknown format, or a malformed row (one line each).
    """
    if format != "auto" and format not in READERS:
        raise SFTDataError(f"unknown SFT format {format!r}: use auto, {', '.join(READERS)}")
    traces: list[Trace] = []
    for where, row in _rows(str(source)):
        if limit is not None and len(traces) >= limit:
            break
        kind = detect_format(row, where) if format == "auto" else format
        traces.append(READERS[kind](row, where))
    if not traces:
        raise SFTDataError(
            f"{source}: no traces found: check the file (one JSON object with 'messages' per row)"
        )
    return traces


def _rows(source: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The rows of ``source`` through the one reader of files and hub datasets (:func:`stare_envs.problems.read_rows`)."""
    try:
        for where, _index, row in read_rows(source):
            yield where, row
    except ProblemSourceError as exc:
        raise SFTDataError(str(exc)) from None


# -------------------------------------------------------------------------------- tokenization


def render_prompt(
    tokenizer: Any,
    problem: str,
    *,
    format: str = "retool",
    system_prompt: str | None = None,
    prompt_template: str = "{problem}",
) -> str:
    """The prompt text exactly as the RL environment renders it (system prompt, user message, generation prompt)."""
    return _prompt(tokenizer, problem, format, system_prompt, prompt_template)[0]


def _prompt(
    tokenizer: Any,
    problem: str,
    format: str,
    system_prompt: str | None,
    prompt_template: str,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[dict[str, Any]] | None]:
    """(prompt text, tool schemas given to the chat template) through the env's and the rollout's own
    helpers: ``tools`` (default: the code tool), the format's system prompt when None, printable user text."""
    tool_format = get_format(format)
    tools = tools if tools is not None else [get_tool(CODE_TOOL).schema()]
    system = tool_format.system_prompt(tools) if system_prompt is None else system_prompt
    messages = initial_messages(problem, system_prompt=system, prompt_template=prompt_template)
    return rollout_prompt(tokenizer, {"messages": messages, "tools": tools}, tool_format)


def trace_to_trajectory(
    trace: Trace, tokenizer: Any, *, system_prompt: str | None = None, prompt_template: str = "{problem}"
) -> Trajectory:
    """Tokenize a trace as RL would play it: model steps mask 1, tool steps and glue mask 0, then EOS (mask 1).

    Each step is tokenized on its own (``add_special_tokens=False``), as the rollout tokenizes an
    observation; model tokens get log-prob 0.0 (SFT has no sampling policy).
    """
    prompt, template_tools = _prompt(
        tokenizer, trace.problem, trace.format, system_prompt, prompt_template, trace.tools
    )
    builder = TrajectoryBuilder(_encode(tokenizer, prompt))
    glue = (
        ToolTurnGlue(tokenizer, template_tools)
        if get_format(trace.format).observation_role == "tool"
        else None
    )
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SFTDataError(
            "the tokenizer has no eos_token_id: SFT must teach the model where to stop; set one"
        )
    steps = list(trace.steps)
    if not steps or steps[-1][0] != "model":
        steps.append(("model", ""))
    # A format without stop strings (qwen3, llama3_json) ends a calling turn with EOS, which the model
    # samples in RL: it is trained here too, and the glue after it does not repeat it.
    calls_end_with_eos = glue is not None and not get_format(trace.format).stop_strings
    for index, (kind, text) in enumerate(steps):
        if kind == "model":
            # the final turn ends with EOS, which the model samples in RL: part of that turn, mask 1
            last = index == len(steps) - 1
            ids = _encode(tokenizer, text) + ([eos] if last or (calls_end_with_eos and text) else [])
            if ids:
                builder.append(ids, 1, [0.0] * len(ids))
        else:
            # tool output is text: a special-token string it holds stays text, as in the rollout
            after_eos = calls_end_with_eos and steps[index - 1][0] == "model"
            ids = (
                glue(text, turn_ended_with_eos=after_eos)
                if glue is not None
                else encode_as_text(tokenizer, text)
            )
            if ids:
                builder.append(ids, 0)
    return builder.build(info={"id": trace.id, "answer": trace.answer})


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


# ---------------------------------------------------------------------------- procedural traces


_LEAD_IN = "I'll compute this with Python.\n"


def procedural_trace(problem: Problem, sandbox: Sandbox, *, timeout_s: float | None = None) -> Trace | None:
    """Run the problem's solution code in ``sandbox``; a ReTool trace with the REAL output, or None
    when the output does not equal the gold answer (or the code failed)."""
    code = problem.meta.get("solution_code")
    if not code:
        raise SFTDataError(f"problem {problem.id} has no meta['solution_code']: use a procedural family")
    sandbox.reset()
    result = sandbox.run(code, timeout=timeout_s)
    output = render_exec_result(result)
    lines = result.stdout.strip().splitlines()
    answer = lines[-1].strip() if lines else ""
    if result.error is not None or result.timed_out or answer != problem.answer.strip():
        return None
    call = ToolCall(CODE_TOOL, {"code": code}, "")
    steps: list[tuple[StepKind, str]] = [
        ("model", f"{_LEAD_IN}<code>\n```python\n{code.strip()}\n```\n</code>"),
        ("tool", ReToolFormat().render_observation([(call, output)])),
        ("model", f"<answer>\\boxed{{{answer}}}</answer>"),
    ]
    return Trace(problem.id, problem.problem, steps, "retool", problem.answer, {"source": problem.source})


def env_trace(env: Any, problem: Problem) -> Trace | None:
    """Play ``problem``'s solution calls (``meta["solution_calls"]``) through ``env`` (a ``ToolEnv``:
    its tools, format and limits) and answer with the last tool output: a trace of the REAL outputs in
    the env's own format, or None when the env does not score that answer correct (or the episode ended
    early). What cold-start SFT makes for an env of tools other than the code interpreter."""
    calls = problem.meta.get("solution_calls")
    if not calls:
        raise SFTDataError(
            f"problem {problem.id} has no meta['solution_calls']: its family gives no tool calls"
        )
    _, info = env.reset(options={"problem": problem})
    steps: list[tuple[StepKind, str]] = []
    output = ""
    for name, arguments in calls:
        turn = env.format.write_calls([(name, arguments)])
        output, _, terminated, truncated, step = env.step(turn)
        if terminated or truncated:
            return None
        steps += [("model", turn)] + [("tool", message) for message in step.get("tool_messages", [output])]
    answer = f"<answer>\\boxed{{{output.strip()}}}</answer>"
    _, reward, terminated, _, final = env.step(answer)
    if not (terminated and final.get("correct")):
        return None
    steps.append(("model", answer))
    return Trace(
        problem.id,
        problem.problem,
        steps,
        env.format.name,
        problem.answer,
        {"source": problem.source},
        info["tools"],
    )


def procedural_traces(
    family: str,
    n: int,
    sandbox: Sandbox,
    *,
    seed: int = 0,
    difficulty: int = 1,
    timeout_s: float | None = None,
) -> tuple[list[Trace], int]:
    """``n`` problems of ``family`` turned into traces by really running their solution code.

    Returns:
        (traces whose real output equals the gold answer, number of problems rejected).
    """
    traces: list[Trace] = []
    for problem in generate_problems(family, n, seed=seed, difficulty=difficulty):
        trace = procedural_trace(problem, sandbox, timeout_s=timeout_s)
        if trace is not None:
            traces.append(trace)
    return traces, n - len(traces)


def write_retool_jsonl(traces: Sequence[Trace], path: str | Path) -> Path:
    """Write ReTool traces as ReTool-SFT rows, one JSON object per line (readable by :func:`read_traces`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for trace in traces:
            handle.write(json.dumps(trace.to_retool_row(), ensure_ascii=False) + "\n")
    return path
