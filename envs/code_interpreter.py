"""``CodeInterpreterEnv``: solve a math problem with a stateful Python interpreter (ReTool format).

Example:
    >>> from stare_envs.code_interpreter import CodeInterpreterEnv
    >>> env = CodeInterpreterEnv("multiplication", sandbox_backend="local")  # doctest: +SKIP
    >>> prompt, info = env.reset(seed=0)  # doctest: +SKIP
    >>> obs, reward, terminated, truncated, info = env.step(
    ...     "<code>\\n```python\\nprint(6 * 7)\\n```\\n</code>")  # doctest: +SKIP
    >>> obs  # doctest: +SKIP
    '\\n<interpreter>\\n42\\n</interpreter>\\n'
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from stare_envs.formats import ToolFormat
from stare_envs.problems import Problem
from stare_envs.tool_env import ToolEnv


class CodeInterpreterEnv(ToolEnv):
    """A ``ToolEnv`` with the single tool ``code_interpreter``, in the ReTool format by default.

    Args:
        problems: See ``ToolEnv`` (problems, a file, or a generator family; default all families).
        format: ``"retool"`` (default) or ``"hermes"``.
        timeout_s: Per-call timeout of the code; None for the sandbox config's ``timeout_s``.
        **kwargs: Everything else ``ToolEnv`` takes (``pool``, ``max_turns``, ``max_tool_calls``,
            ``max_output_chars``, ``tokenizer``, ``reward``, ``system_prompt``, ...).
    """

    def __init__(
        self,
        problems: Sequence[Problem] | str | os.PathLike[str] = "mixed",
        *,
        format: str | ToolFormat = "retool",
        timeout_s: float | None = None,
        tool_options: Mapping[str, Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        if "tools" in kwargs:
            raise TypeError(
                "CodeInterpreterEnv has the one tool code_interpreter: use ToolEnv(tools=...) for others"
            )
        options = {name: dict(value) for name, value in (tool_options or {}).items()}
        if timeout_s is not None:
            if timeout_s <= 0:
                raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
            options.setdefault("code_interpreter", {})["timeout_s"] = timeout_s
        super().__init__(problems, tools=("code_interpreter",), format=format, tool_options=options, **kwargs)
