"""The tool registry: named tools with a JSON schema, implemented by a function or a class.

A tool is registered once under a unique name, with the JSON schema of its arguments (inferred from
the signature when not given). A function tool is called with the model's arguments as keywords; a
class tool is instantiated once per episode (so it may keep state) and then called the same way.
Tools with ``needs_sandbox=True`` receive the episode's leased sandbox as the keyword ``sandbox``
(functions: on every call; classes: at construction).

Exceptions listed in ``model_errors`` (and ``ToolInputError``) become a message for the model; any
other exception is a bug in the tool and propagates.

Example:
    >>> @register_tool("add_demo", description="Add two integers.")
    ... def add(a: int, b: int) -> int:
    ...     return a + b
    >>> get_tool("add_demo").bind()({"a": 2, "b": 3}).text
    '5'
    >>> unregister_tool("add_demo")
"""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from stare_envs.definitions import definition
from stare_envs.errors import EnvError
from stare_sandbox.base import Sandbox
from stare_sandbox.result import ExecResult


class ToolRegistryError(EnvError, LookupError):
    """A tool could not be registered or found; the message says why and what to do."""


class ToolInputError(EnvError):
    """Raised by a tool when the model's arguments are unusable; the message is shown to the model."""


@dataclass(frozen=True)
class ToolResult:
    """What one tool call produced.

    Attributes:
        text: The output shown to the model (before the environment's truncation).
        exec_result: The sandbox's record of the call, for tools that run code.
        error_type: Name of the error the call ended with (exception type, ``"Timeout"``), if any.
            With ``"Timeout"``, ``text`` is what the call wrote before a limit stopped it, so how much
            of it there is depends on timing: the environment shows only its head (the tail and the
            amount cut would differ from run to run).
        note: A closing line the environment shows in full after the (truncated) ``text``: e.g. the
            timeout's, which must survive however long the output was.
    """

    text: str
    exec_result: ExecResult | None = None
    error_type: str | None = None
    note: str = ""


_JSON_TYPES: dict[Any, str] = {}
for _py, _json in (
    (str, "string"),
    (int, "integer"),
    (float, "number"),
    (bool, "boolean"),
    (list, "array"),
    (dict, "object"),
):
    _JSON_TYPES[_py] = _JSON_TYPES[_py.__name__] = _json  # annotations may be strings (PEP 563)
_JSON_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    """JSON schema of ``fn``'s keyword arguments (``sandbox`` and ``self`` excluded).

    Not ``transformers.utils.get_json_schema``: ``stare_envs`` installs without transformers (the slim
    install), and that function refuses any tool whose docstring does not describe every argument.

    >>> schema_from_signature(lambda expression, digits=10: None)["required"]
    ['expression']
    """
    target = fn.__call__ if inspect.isclass(fn) else fn  # a class tool gets the arguments in __call__
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(target).parameters.values():
        if param.name in ("self", "sandbox") or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        json_type = _JSON_TYPES.get(param.annotation)
        properties[param.name] = {"type": json_type} if json_type else {}
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """A registered tool.

    Attributes:
        name: Unique name the model calls it by.
        description: One or two sentences for the model.
        parameters: JSON schema (an ``object``) of the arguments.
        impl: The function or class implementing it.
        needs_sandbox: True when it runs code in the episode's sandbox.
        model_errors: Exception types whose message is shown to the model instead of raised.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    impl: Callable[..., Any]
    needs_sandbox: bool = False
    model_errors: tuple[type[BaseException], ...] = (ToolInputError,)

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates and system prompts use."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Mapping[str, Any]) -> str | None:
        """A one-line message for the model when ``arguments`` do not fit the schema, else None."""
        properties = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"{self.name}: missing required argument(s) {missing}; expected {sorted(properties)}."
        if self.parameters.get("additionalProperties") is False:
            unknown = sorted(set(arguments) - set(properties))
            if unknown:
                return f"{self.name}: unknown argument(s) {unknown}; expected {sorted(properties)}."
        for key, value in arguments.items():
            expected = properties.get(key, {}).get("type")
            check = _JSON_CHECKS.get(expected) if isinstance(expected, str) else None
            if check is not None and not check(value):
                return f"{self.name}: argument {key!r} must be a JSON {expected}, got {type(value).__name__}."
        return None

    def bind(self, sandbox: Sandbox | None = None, **options: Any) -> BoundTool:
        """The tool ready for one episode (a class tool is instantiated here with ``options``)."""
        if self.needs_sandbox and sandbox is None:
            raise ValueError(f"tool {self.name!r} needs a sandbox: bind it with sandbox=<leased sandbox>")
        extra = {"sandbox": sandbox} if self.needs_sandbox else {}
        if inspect.isclass(self.impl):
            instance = cast(Callable[..., Any], self.impl(**extra, **options))
            return BoundTool(self, instance, {})
        return BoundTool(self, self.impl, {**extra, **options})


@dataclass
class BoundTool:
    """A tool bound to one episode: call it with the model's arguments."""

    spec: ToolSpec
    target: Callable[..., Any]
    keywords: dict[str, Any] = field(default_factory=dict)

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        """Run the tool. Bad arguments and ``model_errors`` come back as a ToolResult for the model."""
        problem = self.spec.validate(arguments)
        if problem is not None:
            return ToolResult(problem, error_type="InvalidArguments")
        try:
            value = self.target(**arguments, **self.keywords)
        except self.spec.model_errors as exc:
            return ToolResult(
                f"{self.spec.name} error: {type(exc).__name__}: {exc}", error_type=type(exc).__name__
            )
        return value if isinstance(value, ToolResult) else ToolResult(str(value))

    def close(self) -> None:
        """Let a class tool release what it holds (calls its ``close()`` if it has one)."""
        closer = getattr(self.target, "close", None)
        if callable(closer) and not inspect.isfunction(self.target):
            closer()


_TOOLS: dict[str, ToolSpec] = {}
_LOCK = threading.Lock()
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


def register_tool(
    name: str,
    impl: Callable[..., Any] | None = None,
    *,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    needs_sandbox: bool = False,
    model_errors: tuple[type[BaseException], ...] = (),
) -> Any:
    """Register a tool; with ``impl`` omitted, returns a decorator.

    Args:
        name: Unique name (letters, digits, ``_.-``; 64 characters at most).
        impl: Function or class implementing the tool.
        description: For the model; defaults to the first line of ``impl``'s docstring.
        parameters: JSON schema of the arguments; inferred from the signature when None.
        needs_sandbox: Pass the episode's sandbox as the keyword ``sandbox``.
        model_errors: Exceptions to show to the model (``ToolInputError`` always is).

    Registering the same definition again is a no-op (a module run as a script and then imported by
    name, as ``module:id`` in a config does, registers its tools twice).

    Raises:
        ToolRegistryError: the name is invalid, or taken by another definition.
    """

    def decorate(target: Callable[..., Any]) -> Callable[..., Any]:
        if not _NAME.match(name):
            raise ToolRegistryError(f"tool name {name!r} is invalid: use letters, digits and _.- (max 64)")
        doc = (inspect.getdoc(target) or "").strip().splitlines()
        spec = ToolSpec(
            name=name,
            description=description or (doc[0] if doc else name),
            parameters=parameters if parameters is not None else schema_from_signature(target),
            impl=target,
            needs_sandbox=needs_sandbox,
            model_errors=(ToolInputError, *model_errors),
        )
        add_tool(spec)
        return target

    return decorate if impl is None else decorate(impl)


def _same_tool(a: ToolSpec, b: ToolSpec) -> bool:
    return (a.name, a.description, a.parameters, a.needs_sandbox) == (
        b.name,
        b.description,
        b.parameters,
        b.needs_sandbox,
    ) and [definition(x) for x in (a.impl, *a.model_errors)] == [
        definition(x) for x in (b.impl, *b.model_errors)
    ]


def add_tool(spec: ToolSpec) -> None:
    """Register a ready ``ToolSpec``. The same definition again (the module that registers it imported
    a second time) is a no-op; another one under a taken name raises ``ToolRegistryError`` naming both."""
    with _LOCK:
        if spec.name in _TOOLS:
            if _same_tool(_TOOLS[spec.name], spec):
                return
            owner, new = _TOOLS[spec.name].impl, spec.impl
            raise ToolRegistryError(
                f"tool {spec.name!r} is already registered (by {owner.__module__}.{owner.__qualname__}), "
                f"another definition (by {new.__module__}.{new.__qualname__}) cannot take its name: pick "
                f"another name or call unregister_tool({spec.name!r}) first"
            )
        _TOOLS[spec.name] = spec


def unregister_tool(name: str) -> None:
    """Remove a tool (a no-op when it is not registered)."""
    with _LOCK:
        _TOOLS.pop(name, None)


def get_tool(name: str) -> ToolSpec:
    """The registered tool ``name``; ``ToolRegistryError`` lists the valid names when unknown."""
    with _LOCK:
        if name in _TOOLS:
            return _TOOLS[name]
        valid = sorted(_TOOLS)
    raise ToolRegistryError(
        f"no tool named {name!r}: registered tools are {valid}; register it with @register_tool({name!r}, ...)"
    )


def list_tools() -> list[str]:
    """Names of all registered tools, sorted."""
    with _LOCK:
        return sorted(_TOOLS)


# ----------------------------------------------------------------------------- code_interpreter

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


NO_OUTPUT = "(no output: use print() to show values)"
"""What the model reads after code that printed nothing and raised nothing."""


def render_exec_result(result: ExecResult) -> str:
    """What the model reads after running code: output, the error, and timeout/state notes.

    A timeout is one line naming the limit the sandbox applied (``after 5 s`` of wall time, or
    ``after 5 s of CPU time``) and whether variables survived. ANSI color codes (tracebacks,
    colored prints) are removed: they are noise to a model.
    """
    text, note = exec_result_parts(result)
    return "\n".join(part for part in (text, note) if part) or NO_OUTPUT


def exec_result_parts(result: ExecResult) -> tuple[str, str]:
    """:func:`render_exec_result` as (the output and error, the timeout's closing line or "")."""
    parts = [_ANSI.sub("", text.rstrip("\r\n")) for text in (result.stdout, result.stderr) if text.strip()]
    note = ""
    if result.timed_out:
        limit = result.error.message.partition(";")[0] if result.error else "the code timed out"
        state = (
            "The interpreter was restarted: all variables and imports are lost."
            if result.state_lost
            else "The interpreter was interrupted; variables defined before this call are kept."
        )
        note = f"TimeoutError: {limit} (output so far is shown above). {state}"
    elif result.error is not None:
        trace = _ANSI.sub("", result.error.traceback).strip()
        parts.append(trace or _ANSI.sub("", f"{result.error.type}: {result.error.message}"))
    elif result.state_lost:
        parts.append("The interpreter crashed and was restarted: all variables and imports are lost.")
    return "\n".join(parts), note


@register_tool(
    "code_interpreter",
    description="Run Python code in a stateful Jupyter kernel (variables persist between calls) and "
    "return what it prints. numpy, sympy and scipy are available.",
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python code to run."}},
        "required": ["code"],
        "additionalProperties": False,
    },
    needs_sandbox=True,
)
class CodeInterpreterTool:
    """Runs code in the episode's leased sandbox (state persists across the episode's calls)."""

    def __init__(self, sandbox: Sandbox, timeout_s: float | None = None) -> None:
        self.sandbox = sandbox
        self.timeout_s = timeout_s

    def __call__(self, code: str) -> ToolResult:
        result = self.sandbox.run(code, timeout=self.timeout_s)
        error_type = "Timeout" if result.timed_out else (result.error.type if result.error else None)
        text, note = exec_result_parts(result)
        return ToolResult(
            text or ("" if note else NO_OUTPUT), exec_result=result, error_type=error_type, note=note
        )
