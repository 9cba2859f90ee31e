"""Failures of the sandbox infrastructure (never of the executed code, which are ExecResults)."""


class SandboxError(RuntimeError):
    """Base class: the sandbox itself failed. Messages name the cause and the fix."""


class SandboxUnavailable(SandboxError):
    """A backend cannot be used here (no daemon, no image, missing permission)."""


class SandboxClosed(SandboxError):
    """The sandbox was used after ``close()``."""


class PoolExhausted(SandboxError):
    """No sandbox could be leased from the pool within the lease timeout."""


class SandboxKilled(SandboxError):
    """The sandbox was ended from outside while code ran in it, not by that code: its container
    killed, stopped or removed (``docker kill``, ``docker stop``, ``docker rm``, a Docker daemon
    that stopped or restarted, the node's OOM killer taking the container's init) or its daemon
    gone. Raised, never shown to the model as the code's crash: an infrastructure failure. Only
    positive evidence of an outside end raises it (``stare_sandbox.docker`` says which); a
    kernel that died while the code could have ended it (its own ``os._exit``, a signal, the
    memory limit) stays a ``KernelDied`` result."""
