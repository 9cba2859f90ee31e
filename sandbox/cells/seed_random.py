"""Run after each kernel start and at each soft reset: ``random``, and ``numpy.random``'s global
generator where numpy is imported (``SandboxConfig.preload``; numpy 2 imports ``numpy.random`` on
first use, here), start from ``seed`` (``stare_sandbox.config.RANDOM_SEED``). Code that broke
``numpy.random.seed`` in a local kernel keeps its break after a soft reset, like any monkey-patch."""

import random
import sys


def seed_random(seed: int) -> None:
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        try:
            numpy.random.seed(seed)
        except Exception:  # noqa: BLE001 - code in the sandbox may have broken it
            pass
