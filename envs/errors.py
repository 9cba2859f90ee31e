"""The root of the ``stare_envs`` package's errors: ``except EnvError`` catches every one of them.

Each subclass keeps the built-in base callers may already catch (``ValueError`` for bad input,
``RuntimeError`` for a failed run, ``LookupError`` for an unknown name) as its second base, and its
message names the cause and the fix in one line. Failures of the model's own code or tool input are
observations for the model, not errors (``ToolInputError`` is caught by the environment).

Example:
    >>> from stare_envs.problems import ProblemSourceError
    >>> issubclass(ProblemSourceError, EnvError) and issubclass(ProblemSourceError, ValueError)
    True
"""

from __future__ import annotations

__all__ = ["EnvError"]


class EnvError(Exception):
    """Base class of the errors raised by ``stare_envs``. Messages name the cause and the fix."""
