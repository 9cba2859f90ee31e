"""Run once after each kernel start (outside the user namespace): record what the soft reset
(``soft_reset.reset``) restores, and forget the error of ``stare_sandbox.kernel.WARM_TRACEBACKS``
(``sys.last_*``)."""

import os
import sys
import types


def snapshot() -> None:
    boot = sys.modules["_stare_boot"] = types.ModuleType("_stare_boot")
    boot.environ = dict(os.environ)  # type: ignore[attr-defined]
    boot.path = list(sys.path)  # type: ignore[attr-defined]
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        sys.__dict__.pop(name, None)
