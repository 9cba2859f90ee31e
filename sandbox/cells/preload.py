"""What a local kernel runs once at its start: import the modules of ``SandboxConfig.preload``
outside the user namespace (the Docker warden imports them itself, before it forks kernels)."""

import importlib


def preload(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
