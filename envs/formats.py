"""Tool-call formats: how a model writes tool calls and a final answer, and how it reads results back.

A format parses one model turn into tool calls / a final answer / parse errors for the model, and
renders tool results into the observation text (``retool``) or ``tool`` messages (the others). Shipped:

- ``retool`` (default): ``<code>```python ...```</code>``; the result comes back inside the same
  assistant message as ``<interpreter>...</interpreter>``. Only the FIRST code block of a turn runs
  (a generator stops at ``</code>``, so later blocks were written without seeing the output); the
  model is told when later blocks were ignored.
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; results are ``tool``-role
  chat messages. A turn stops at its first ``</tool_call>`` (one call a turn); a parser handed a turn
  with several runs them all, in order, their results in one message.
- ``qwen3``: hermes calls, any number a turn, which ends with EOS; each result a message of its own.
- ``llama3_json``: a turn that is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1).
- ``deepseek_v3``: DeepSeek-V3's tool-call tokens, any number a turn; each result a message of its own.

All take the final answer from ``<answer> ... \\boxed{X} ... </answer>`` (the last box inside the
tag; the tag's whole text when it has no box), or else from the last bare ``\\boxed{}`` of the turn. A
turn that calls a tool never ends the episode: its answer, if any, is ignored and the model is told so.
docs/tokens.md says which format is token-exact with which model family's chat template.
"""

from __future__ import annotations

import abc
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from stare_envs.errors import EnvError
from stare_envs.rewards import extract_boxed

CODE_TOOL = "code_interpreter"


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it: ``raw`` is the exact text it came from."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class ParsedTurn:
    """What one model turn asked for.

    Attributes:
        tool_calls: Calls to run, in order.
        final_answer: The answer (content of the box), or None when the turn gives none.
        errors: Parse problems, each one line telling the model what went wrong and what to write.
        has_answer_tag: True when the turn contains an ``<answer>`` tag.
    """

    tool_calls: list[ToolCall] = field(default_factory=list)
    final_answer: str | None = None
    errors: list[str] = field(default_factory=list)
    has_answer_tag: bool = False


# ----------------------------------------------------------------------------- characters


@lru_cache(maxsize=1)
def observation_charset() -> frozenset[str]:
    """Every printable Unicode character plus newline and tab: the charset of the text spaces."""
    return frozenset([chr(i) for i in range(0x110000) if chr(i).isprintable()] + ["\n", "\t"])


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_model_text(text: str | bytes) -> tuple[str, int]:
    """Make a model turn safe to parse and to send to a kernel.

    Bytes are decoded as UTF-8 (invalid bytes become U+FFFD); lone surrogates (text that was not
    valid UTF-8) and control characters other than tab/newline/carriage return become U+FFFD;
    ``\\r\\n`` becomes ``\\n``.

    Returns:
        The cleaned text and how many characters were replaced.

    >>> clean_model_text("a\\x00b\\udcff")
    ('a\\ufffdb\\ufffd', 2)
    """
    replaced = 0
    if isinstance(text, bytes):
        decoded = text.decode("utf-8", errors="replace")
        replaced += decoded.count("\ufffd") - text.count("\ufffd".encode())
        text = decoded
    text, n = _CONTROL.subn("\ufffd", text)
    return text.replace("\r\n", "\n"), replaced + n


def printable(text: str) -> str:
    """Map ``text`` into the observation charset, visibly.

    Carriage returns become newlines, Unicode spaces become " ", and any other character that is
    not printable (escape codes, zero-width characters, lone surrogates) becomes its Python escape,
    e.g. ``\\x1b``, so the model still sees that something was there.

    >>> printable("a\\x1b[0m\\u00a0b\\r\\n")
    'a\\\\x1b[0m b\\n'
    """
    if text.replace("\n", "").replace("\t", "").isprintable():
        return text
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for char in text:
        if char.isprintable() or char in "\n\t":
            out.append(char)
        elif unicodedata.category(char) == "Zs":
            out.append(" ")
        else:
            out.append(repr(char)[1:-1])
    return "".join(out)


# ----------------------------------------------------------------------------- answers

_ANSWER_OPEN = re.compile(r"<answer>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"</answer>", re.IGNORECASE)


def _boxed(text: str) -> str | None:
    content = extract_boxed(text)
    return None if content is None or not content.strip() else content.strip()


def find_answer(text: str) -> tuple[str | None, bool, list[str]]:
    """The final answer of a turn: ``(answer, has_answer_tag, errors)``.

    ``<answer>`` wins over bare boxes; an unclosed ``<answer>`` runs to the end of the turn (a
    generator may stop before the closing tag); an empty one is an error for the model.
    """
    errors: list[str] = []
    opens = list(_ANSWER_OPEN.finditer(text))
    if not opens:
        if _ANSWER_CLOSE.search(text):
            errors.append("Found </answer> without <answer>: write <answer> ... \\boxed{...} </answer>.")
        return _boxed(text), False, errors
    start = opens[-1].end()
    close = _ANSWER_CLOSE.search(text, start)
    body = text[start : close.start() if close else len(text)]
    answer = _boxed(body)
    if answer is None:
        answer = body.strip() or None
    if answer is None:
        errors.append("The <answer> tag is empty: put the final result inside it as \\boxed{...}.")
    return answer, True, errors


# ----------------------------------------------------------------------------- formats


class ToolFormat(abc.ABC):
    """How tool calls and their results are written as text.

    Attributes:
        name: Registry name.
        stop_strings: Strings a generator should stop on (the end of a tool call).
        observation_role: ``"assistant"`` when the observation text is appended inside the same
            assistant message; ``"tool"`` when it is the content of a ``tool``-role chat message.
    """

    name: str = "abstract"
    stop_strings: list[str] = []
    observation_role: Literal["assistant", "tool"] = "assistant"

    @abc.abstractmethod
    def parse(self, turn_text: str) -> ParsedTurn:
        """Parse one model turn. Never raises for anything the model wrote."""

    @abc.abstractmethod
    def render_observation(self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()) -> str:
        """The observation text for the model: tool results in order, preceded by ``errors``."""

    @abc.abstractmethod
    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """Instructions describing the format and ``tools`` (OpenAI-style function schemas)."""

    def render_messages(
        self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()
    ) -> list[str]:
        """The contents of the ``tool`` messages a turn's results become (``observation_role == "tool"``):
        one message holding them all (:meth:`render_observation`), unless the format gives each call
        a message of its own (parallel calls, as Qwen3's and DeepSeek-V3's templates render them)."""
        return [self.render_observation(results, errors)]

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        """The text a model writes for ``calls`` (``(tool name, arguments)`` pairs) in this format: what
        :meth:`parse` reads back as those calls (scripted policies, traces for cold-start SFT)."""
        raise NotImplementedError(f"the {self.name!r} format does not say how a call is written")


_CODE_OPEN = re.compile(r"<code>", re.IGNORECASE)
_CODE_CLOSE = re.compile(r"</code>", re.IGNORECASE)
_FENCE_OPEN = re.compile(r"^\s*```[ \t]*(?:python3?|py|ipython)?[ \t]*\n?", re.IGNORECASE)
_FENCE_CLOSE = re.compile(r"\n?[ \t]*```\s*$")


def _strip_fence(block: str) -> str:
    """Code inside a ``<code>`` block: the fenced part when fenced, else the whole block."""
    opened = _FENCE_OPEN.match(block)
    if opened is None:
        return block.strip("\n")
    inner = block[opened.end() :]
    end = inner.find("```")
    if end >= 0:
        inner = inner[:end]
    return inner.strip("\n")


class ReToolFormat(ToolFormat):
    """``<code>```python ...```</code>`` -> ``<interpreter>...</interpreter>`` (ReTool, Feng et al. 2025)."""

    name = "retool"
    stop_strings = ["</code>"]
    observation_role = "assistant"

    def parse(self, turn_text: str) -> ParsedTurn:
        errors: list[str] = []
        blocks: list[tuple[str, str]] = []  # (raw, code)
        pos = 0
        while (opened := _CODE_OPEN.search(turn_text, pos)) is not None:
            closed = _CODE_CLOSE.search(turn_text, opened.end())
            nested = _CODE_OPEN.search(turn_text, opened.end())
            if closed is None or (nested is not None and nested.start() < closed.start()):
                end = nested.start() if nested is not None else len(turn_text)
                if nested is not None:
                    errors.append(
                        "A <code> block was not closed before the next <code>: end each with </code>."
                    )
                raw, pos = turn_text[opened.start() : end], end
                body = turn_text[opened.end() : end]
            else:
                raw, pos = turn_text[opened.start() : closed.end()], closed.end()
                body = turn_text[opened.end() : closed.start()]
            blocks.append((raw, _strip_fence(body)))
        if not blocks and _CODE_CLOSE.search(turn_text):
            errors.append(
                "Found </code> without <code>: write code as <code>\n```python\n...\n```\n</code>. Nothing was run."
            )
        calls: list[ToolCall] = []
        if blocks:
            raw, code = blocks[0]
            if code.strip():
                calls.append(ToolCall(CODE_TOOL, {"code": code}, raw))
            else:
                errors.append(
                    "The code block is empty: put Python code between <code>```python and ```</code>."
                )
            if len(blocks) > 1:
                errors.append(
                    f"Only the first code block of a turn is run; {len(blocks) - 1} later block(s) were "
                    "ignored. Write one block, then wait for its output."
                )
        answer, has_tag, answer_errors = find_answer(turn_text)
        errors.extend(answer_errors)
        if blocks and answer is not None:
            errors.append(
                "A turn that runs code cannot also give the final answer; the answer was ignored. "
                "Read the output, then answer in a turn of its own."
            )
            answer = None
        return ParsedTurn(calls, answer, errors, has_tag)

    def render_observation(self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()) -> str:
        parts = [f"Error: {e}" for e in errors] + [text for _, text in results]
        return "\n<interpreter>\n" + "\n".join(parts) + "\n</interpreter>\n"

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        if any(name != CODE_TOOL for name, _ in calls):
            raise ValueError(f"the retool format only calls {CODE_TOOL!r}")
        return "\n".join(f"<code>\n```python\n{arguments['code']}\n```\n</code>" for _, arguments in calls)

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return (
            "Solve the problem step by step. You can run Python code in a stateful interpreter "
            "(variables persist between calls) by writing\n"
            "<code>\n```python\n# your code\n```\n</code>\n"
            "The printed output will be returned inside <interpreter> ... </interpreter>. "
            "Use print() to see values. Run one code block at a time. When you are done, give the "
            "final answer as <answer>\\boxed{...}</answer>."
        )


_CALL_OPEN = re.compile(r"<tool_call>", re.IGNORECASE)
_CALL_CLOSE = re.compile(r"</tool_call>", re.IGNORECASE)


class HermesFormat(ToolFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` with ``tool``-role results (Hermes/Qwen)."""

    name = "hermes"
    stop_strings = ["</tool_call>"]
    observation_role = "tool"

    def parse(self, turn_text: str) -> ParsedTurn:
        errors: list[str] = []
        calls: list[ToolCall] = []
        pos, index, outside = 0, 0, []
        while (opened := _CALL_OPEN.search(turn_text, pos)) is not None:
            index += 1
            outside.append(turn_text[pos : opened.start()])
            closed = _CALL_CLOSE.search(turn_text, opened.end())
            end = closed.start() if closed else len(turn_text)
            pos = closed.end() if closed else len(turn_text)
            call, error = self._parse_call(
                turn_text[opened.end() : end], turn_text[opened.start() : pos], index
            )
            if call is not None:
                calls.append(call)
            if error is not None:
                errors.append(error)
        outside.append(turn_text[pos:])
        if index == 0 and _CALL_CLOSE.search(turn_text):
            errors.append(
                'Found </tool_call> without <tool_call>: write <tool_call>{"name": ..., "arguments": {...}}'
                "</tool_call>. Nothing was run."
            )
        answer, has_tag, answer_errors = find_answer("".join(outside))
        errors.extend(answer_errors)
        if index and answer is not None:
            errors.append(
                "A turn that calls a tool cannot also give the final answer; the answer was ignored. "
                "Read the result, then answer in a turn of its own."
            )
            answer = None
        return ParsedTurn(calls, answer, errors, has_tag)

    @staticmethod
    def _parse_call(body: str, raw: str, index: int) -> tuple[ToolCall | None, str | None]:
        usage = 'write <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"Tool call {index} is not valid JSON ({exc.msg} at char {exc.pos}): {usage}."
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None, f'Tool call {index} has no "name" string: {usage}.'
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return None, f'Tool call {index}: "arguments" must be a JSON object: {usage}.'
        return ToolCall(payload["name"], arguments, raw), None

    def render_observation(self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()) -> str:
        return _numbered_results(results, errors)

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        return "\n".join(
            f"<tool_call>\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n</tool_call>"
            for name, arguments in calls
        )

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
            "When you are done, give the final answer as <answer>\\boxed{...}</answer>."
        )


def _numbered_results(results: Sequence[tuple[ToolCall, str]], errors: Sequence[str]) -> str:
    """One message: the errors, then each result (numbered and named when there are several)."""
    parts = [f"Error: {e}" for e in errors]
    if len(results) == 1 and not errors:
        return results[0][1]
    parts += [f"[{i}] {call.name}:\n{text}" for i, (call, text) in enumerate(results, 1)]
    return "\n".join(parts)


class _OneMessagePerCall:
    """For formats with parallel calls: each result a ``tool`` message of its own, the turn's errors
    in one before them; the observation text is the messages, a blank line apart."""

    def render_messages(
        self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()
    ) -> list[str]:
        messages = ["\n".join(f"Error: {e}" for e in errors)] if errors else []
        return messages + [text for _, text in results] if results or messages else [""]

    def render_observation(self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()) -> str:
        return "\n\n".join(self.render_messages(results, errors))


class Qwen3Format(_OneMessagePerCall, HermesFormat):
    """Qwen3's (and Qwen2.5's) own tool use: hermes calls, any number in a turn, which ends with
    ``<|im_end|>`` (no stop string), each result a ``tool`` message of its own (the template gathers
    them into one user turn of ``<tool_response>`` blocks). The ``hermes`` format instead stops a turn at
    its first ``</tool_call>``."""

    name = "qwen3"
    stop_strings: list[str] = []


_PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1/3.2/3.3's JSON tool calls: a turn that is one JSON object ``{"name": ..., "parameters":
    {...}}`` (optionally after ``<|python_tag|>``) calls that tool; the turn ends with ``<|eot_id|>`` (no
    stop string); the result is a ``tool`` message (which Llama 3.1's own template writes under the
    ``ipython`` header). One call a turn, as Llama 3.1 makes them."""

    name = "llama3_json"
    stop_strings: list[str] = []
    observation_role = "tool"

    def parse(self, turn_text: str) -> ParsedTurn:
        body = turn_text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            answer, has_tag, errors = find_answer(turn_text)
            return ParsedTurn([], answer, errors, has_tag)
        usage = 'write one JSON object {"name": "<tool>", "parameters": {...}} and nothing else'
        try:
            payload, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as exc:
            return ParsedTurn(
                [], None, [f"The tool call is not valid JSON ({exc.msg} at char {exc.pos}): {usage}."]
            )
        errors = [f"Text after the tool call's JSON was ignored: {usage}."] if body[end:].strip() else []
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedTurn([], None, [f'The tool call has no "name" string: {usage}.'])
        arguments = payload.get("parameters", payload.get("arguments", {}))
        if not isinstance(arguments, dict):
            return ParsedTurn([], None, [f'The tool call\'s "parameters" must be a JSON object: {usage}.'])
        return ParsedTurn([ToolCall(payload["name"], arguments, body[:end])], None, errors)

    def render_observation(self, results: Sequence[tuple[ToolCall, str]], errors: Sequence[str] = ()) -> str:
        return _numbered_results(results, errors)

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        if len(calls) != 1:
            raise ValueError("the llama3_json format makes one call a turn")
        ((name, arguments),) = calls
        return json.dumps({"name": name, "parameters": dict(arguments)})

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listing = "\n\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (
            "You have access to the following functions. To call a function, respond with a JSON for a "
            'function call with its proper arguments, in the format {"name": function name, "parameters": '
            "dictionary of argument name and its value}, and nothing else.\n\n"
            f"{listing}\n\n"
            "When you are done, give the final answer as <answer>\\boxed{...}</answer>."
        )


_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n<]*)\n```(?:json)?\n(?P<args>.*?)\n```"
    r"<｜tool▁call▁end｜>",
    re.DOTALL,
)


class DeepSeekV3Format(_OneMessagePerCall, ToolFormat):
    """DeepSeek-V3's tool-call tokens: ``<｜tool▁calls▁begin｜>`` then, per call, ``<｜tool▁call▁begin｜>function
    <｜tool▁sep｜>NAME`` and the arguments as a ```` ```json ```` block, ``<｜tool▁call▁end｜>``; the turn
    stops at ``<｜tool▁calls▁end｜>``. Any number of calls a turn, each result a ``tool`` message of its
    own (the template writes them as ``<｜tool▁output▁begin｜>`` blocks)."""

    name = "deepseek_v3"
    stop_strings = [_DS_CALLS_END]
    observation_role = "tool"

    def parse(self, turn_text: str) -> ParsedTurn:
        start = turn_text.find(_DS_CALLS_BEGIN)
        if start < 0:
            answer, has_tag, problems = find_answer(turn_text)
            if _DS_CALLS_END in turn_text or "<｜tool▁call▁begin｜>" in turn_text:
                problems.append(f"Tool calls must start with {_DS_CALLS_BEGIN}. Nothing was run.")
            return ParsedTurn([], answer, problems, has_tag)
        end = turn_text.find(_DS_CALLS_END, start)
        section = turn_text[start + len(_DS_CALLS_BEGIN) : end if end >= 0 else len(turn_text)]
        calls: list[ToolCall] = []
        errors: list[str] = []
        usage = "write <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, then the arguments as a ```json block"
        blocks = section.count("<｜tool▁call▁begin｜>")
        for index, match in enumerate(_DS_CALL.finditer(section), 1):
            try:
                arguments = json.loads(match["args"])
            except json.JSONDecodeError as exc:
                errors.append(f"Tool call {index}'s arguments are not valid JSON ({exc.msg}): {usage}.")
                continue
            if not isinstance(arguments, dict):
                errors.append(f"Tool call {index}'s arguments must be a JSON object: {usage}.")
                continue
            calls.append(ToolCall(match["name"].strip(), arguments, match.group()))
        well_formed = len(list(_DS_CALL.finditer(section)))
        if blocks > well_formed or blocks == 0:
            errors.append(
                f"{max(blocks - well_formed, 1)} tool call(s) were not well formed and not run: {usage}."
            )
        outside = turn_text[:start] + (turn_text[end + len(_DS_CALLS_END) :] if end >= 0 else "")
        answer, has_tag, answer_errors = find_answer(outside)
        errors.extend(answer_errors)
        if answer is not None:
            errors.append(
                "A turn that calls a tool cannot also give the final answer; the answer was ignored. "
                "Read the result, then answer in a turn of its own."
            )
        return ParsedTurn(calls, None, errors, has_tag)

    def write_calls(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
        body = "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(dict(arguments))}\n```"
            "<｜tool▁call▁end｜>"
            for name, arguments in calls
        )
        return f"{_DS_CALLS_BEGIN}{body}{_DS_CALLS_END}"

    def system_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return (
            f"You can call these functions:\n{listing}\n\n"
            f"To call them, write {_DS_CALLS_BEGIN}, then for each call <｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "NAME, a newline, its arguments as a ```json block, and <｜tool▁call▁end｜>; then "
            f"{_DS_CALLS_END}. When you are done, give the final answer as <answer>\\boxed{{...}}</answer>."
        )


class FormatRegistryError(EnvError, KeyError):
    """A format name that is unknown, taken, or not a name; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class _FormatRegistry(dict[str, type[ToolFormat]]):
    """Formats by name: refuses to overwrite one and lists the valid names on a failed lookup."""

    def __setitem__(self, name: str, cls: type[ToolFormat]) -> None:
        if name in self:
            raise FormatRegistryError(
                f"tool format {name!r} is already registered ({self[name].__qualname__}): choose another name"
            )
        super().__setitem__(name, cls)

    def __missing__(self, name: str) -> type[ToolFormat]:
        raise FormatRegistryError(f"Unknown tool format {name!r}: use one of {sorted(self)}")


FORMATS: _FormatRegistry = _FormatRegistry(
    retool=ReToolFormat,
    hermes=HermesFormat,
    qwen3=Qwen3Format,
    llama3_json=Llama3JsonFormat,
    deepseek_v3=DeepSeekV3Format,
)
"""The tool-call formats by name; add one with :func:`register_format`."""


def register_format(cls: type[ToolFormat]) -> type[ToolFormat]:
    """Register a :class:`ToolFormat` subclass under its ``name`` (usable as a class decorator).

    A third-party package can also declare it as an entry point in the group
    ``stare_agent.formats`` (loaded at ``import stare_envs``), which makes ``env.format=<name>`` valid.

    Example:
        >>> @register_format
        ... class ShoutFormat(ReToolFormat):
        ...     name = "shout"
        >>> get_format("shout").name
        'shout'
        >>> unregister_format("shout")

    Raises:
        FormatRegistryError: the name is taken, or ``cls`` is not a ``ToolFormat`` with a name.
    """
    if not (isinstance(cls, type) and issubclass(cls, ToolFormat)) or cls.name in ("", "abstract"):
        raise FormatRegistryError(f"{cls!r} is not a ToolFormat subclass with a name: set its `name`")
    FORMATS[cls.name] = cls
    return cls


def unregister_format(name: str) -> None:
    """Remove a format (a no-op when it is not registered)."""
    FORMATS.pop(name, None)


def get_format(name: str | ToolFormat) -> ToolFormat:
    """A format instance by name (an instance passes through).

    Raises:
        FormatRegistryError: unknown name (a ``KeyError``); the message lists the valid ones.
    """
    if isinstance(name, ToolFormat):
        return name
    return FORMATS[name]()
