"""The examples in every module's docstrings run (doctest), so the documentation cannot drift from
the code. Examples that need a GPU, the network or minutes are marked ``# doctest: +SKIP`` in place."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import stare_agent
import stare_envs
import stare_research
import stare_sandbox


def _modules() -> list[str]:
    names = []
    for package in (stare_sandbox, stare_envs, stare_agent, stare_research):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    return sorted(n for n in names if not n.endswith("__main__"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples of {name} failed (output above)"
    )
