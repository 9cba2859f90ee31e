"""What makes two registrations the same definition, for the registries that must let a module be
imported twice (run as a script, then by name through ``module:id``) without refusing itself."""

from __future__ import annotations

import inspect
import os
from typing import Any


def definition(obj: Any) -> tuple[Any, ...]:
    """What makes two objects the same definition: the same qualified name written by the same source
    lines (a module run as a script, ``__main__``, and imported again by name defines its functions
    twice, equal but not identical); an object without source is only the same as itself."""
    try:
        lines, first = inspect.getsourcelines(obj)
        where = os.path.realpath(inspect.getsourcefile(obj) or "")
    except (OSError, TypeError):
        return (id(obj),)
    return (getattr(obj, "__qualname__", None), where, first, "".join(lines))
