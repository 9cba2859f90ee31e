"""The root of the ``stare_agent`` package's errors: ``except StareError`` catches every one of them.

Each subclass keeps the built-in base callers may already catch (``ValueError`` for a bad config or
bad data, ``RuntimeError`` for a failed run, ``ImportError`` for a missing optional package) as its
second base, and its message names the cause and the fix in one line, which the CLI prints as is.
This module imports nothing, so the CLI can catch the root where torch is missing or broken.

Example:
    >>> from stare_agent.config import ConfigError
    >>> issubclass(ConfigError, StareError) and issubclass(ConfigError, ValueError)
    True
"""

from __future__ import annotations

__all__ = ["StareError"]


class StareError(Exception):
    """Base class of the errors raised by ``stare_agent``. Messages name the cause and the fix."""
