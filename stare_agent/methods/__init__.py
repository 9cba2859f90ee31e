"""The advantage and token-weighting methods, by name: ``algorithm.name`` picks one.

A method is a :class:`~stare_agent.methods.base.Method`: from the pre-update pass of a step's batch
(log-probs, entropy, advantages, the gate) it gives the token weights, KL coefficients or shaped
advantages the loss takes, and the entropy bonus's coefficient. The trainer runs whichever method the
config names and compares no name; adding a method is one module, its line in the registry and one
test. The registry (``stare_agent.options.METHODS``) holds entry points, as Gymnasium's does, so that a
config names a method without importing torch::

    from stare_agent.methods import register_method
    register_method("my_weighting", "my_package.weighting:MyWeighting")   # or the class itself

Then ``algorithm.name=my_weighting`` trains with it (register before the config is loaded).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from stare_agent.options import METHODS, MethodRegistryError, entry_label, method_names, register_method

if TYPE_CHECKING:
    from stare_agent.config import AlgorithmConfig
    from stare_agent.methods.base import Method

__all__ = ["MethodRegistryError", "make_method", "method_class", "method_names", "register_method"]


def method_class(name: str) -> type[Method]:
    """The class registered under ``name`` (its module imported now)."""
    if name not in METHODS:
        raise MethodRegistryError(f"no method named {name!r}: use one of {', '.join(METHODS)}")
    entry = METHODS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise MethodRegistryError(f"method {name!r}: cannot load {entry_label(entry)} ({exc})") from None
    return entry  # type: ignore[no-any-return]


def make_method(config: AlgorithmConfig) -> Method:
    """The method ``config.name`` names, built from the ``algorithm`` section."""
    return method_class(config.name)(config)
