"""Shared fixtures. Docker tests skip when no daemon/image is usable, unless STARE_REQUIRE_DOCKER=1
(CI), in which case they fail with the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _docker_problem() -> str | None:
    """None when the Docker backend is usable, else one line saying why not."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed: pip install docker"
    from sandbox.config import DEFAULT_IMAGE

    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
        return f"Docker daemon not reachable ({exc.__class__.__name__}): start dockerd"
    try:
        client.images.get(DEFAULT_IMAGE)
    except Exception:  # noqa: BLE001
        return f"sandbox image {DEFAULT_IMAGE} missing: run `stare-agent sandbox build`"
    return None


@pytest.fixture(scope="session")
def docker_ready() -> None:
    """Use in every test that needs the Docker backend."""
    problem = _docker_problem()
    if problem is None:
        return
    if os.environ.get("STARE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"STARE_REQUIRE_DOCKER=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def ray_ready() -> None:
    """Use in every test that needs Ray (the ``ray`` extra): skipped where it is not installed,
    failed instead with STARE_REQUIRE_RAY=1 (CI, whose setup installs it)."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        message = f"ray is not importable ({exc}): pip install 'stare-agent[ray]'"
        if os.environ.get("STARE_REQUIRE_RAY") == "1":
            pytest.fail(f"STARE_REQUIRE_RAY=1 but {message}")
        pytest.skip(message)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, read in place (never copied into the repository)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not found")
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
