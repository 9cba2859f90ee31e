"""Failures of the sandbox infrastructure (never of the executed code, which are ExecResults)."""


class SandboxError(RuntimeError):
    """Base class: the sandbox itself failed. Messages name the cause and the fix."""


class SandboxUnavailable(SandboxError):
    """A backend cannot be used here (no daemon, no image, missing permission)."""


class SandboxClosed(SandboxError):
    """The sandbox was used after ``close()``."""


class PoolExhausted(SandboxError):
    """No sandbox could be leased from the pool within the lease timeout."""
