"""Every error of every package reaches the user as one line of cause and fix (exit code 2), through
the one error root of its package; and the commands that messages point to exist."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import envs
import sandbox
import stare_agent
from envs.errors import EnvError
from sandbox.errors import SandboxError
from stare_agent import cli
from stare_agent.errors import StareError

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"stare_agent.engines.sglang_engine"}  # imports sglang only when an engine is built
# Control flow inside the sandbox's kernel driver, never raised to a caller: not an error of the
# package's API (NotSent is the zmq.Again the driver's reconnect logic catches).
INTERNAL = {"sandbox.kernel.MalformedMessage", "sandbox.zmtp.DroppedMessage", "sandbox.zmtp.NotSent"}


def _import_all() -> None:
    """Import every module of the three packages, so that every error class is defined."""
    for package in (sandbox, envs, stare_agent):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if module.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(module.name)
            except ImportError:
                if module.name not in OPTIONAL:
                    raise


def _subclasses(root: type) -> list[type]:
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


_import_all()
ERRORS = [
    cls
    for root in (SandboxError, EnvError, StareError)
    for cls in _subclasses(root)
    if cls.__module__.split(".")[0] in {"sandbox", "envs", "stare_agent"}
]


def test_each_package_has_one_error_root():
    """Every exception class defined by the packages derives from its package's root."""
    roots = {"sandbox": SandboxError, "envs": EnvError, "stare_agent": StareError}
    for package in (sandbox, envs, stare_agent):
        for module in list(importlib.sys.modules.values()):
            name = getattr(module, "__name__", "")
            if name.split(".")[0] != package.__name__:
                continue
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and issubclass(value, BaseException)
                    and value.__module__ == name
                    and f"{name}.{value.__qualname__}" not in INTERNAL
                ):
                    assert issubclass(value, roots[package.__name__]), f"{name}.{value.__qualname__}"
    assert len(ERRORS) >= 20


@pytest.mark.parametrize("error", ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_is_one_line_of_cause_and_fix(monkeypatch, capsys, error):
    def fail(args):
        raise error("the cause: the fix")

    monkeypatch.setattr(cli, "_plot", fail)
    assert cli.main(["plot", "some-run"]) == 2
    assert capsys.readouterr().err == "error: the cause: the fix\n"


def test_messages_name_only_commands_that_exist():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here
    sandbox_commands = commands["sandbox"]._subparsers._group_actions[0].choices  # noqa: SLF001
    named = set()
    for path in [*ROOT.glob("sandbox/*.py"), *ROOT.glob("envs/*.py"), *ROOT.glob("stare_agent/**/*.py")]:
        named |= {(m[0], m[1]) for m in re.findall(r"stare-agent (\w[\w-]*)(?: (\w+))?", path.read_text())}
    assert ("sandbox", "doctor") in named
    for command, sub in named:
        assert command in commands, f"stare-agent {command}"
        if command == "sandbox" and sub:
            assert sub in sandbox_commands, f"stare-agent sandbox {sub} does not exist"
