"""The one interface every backend implements."""

from __future__ import annotations

import abc
from types import TracebackType

from stare_sandbox.config import SandboxConfig
from stare_sandbox.result import ExecResult


class Sandbox(abc.ABC):
    """A stateful Python interpreter (a Jupyter kernel) that runs untrusted code.

    State persists across ``run`` calls like a notebook until ``reset()``. ``run`` never raises
    for anything the executed code does (exceptions, timeouts, crashes, killed kernels): those
    come back in the ``ExecResult``. It raises ``SandboxError`` only when the infrastructure fails.
    """

    backend: str = "abstract"

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    @abc.abstractmethod
    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        """Execute ``code``; ``timeout`` defaults to ``config.timeout_s``."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all state (variables, imports, files in the work dir, stray processes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the kernel, process or container and every temp file. Idempotent."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """True when the kernel answers."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
