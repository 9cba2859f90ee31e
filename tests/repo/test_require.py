"""tests/conftest.py's ``require``: a missing dependency skips, or fails where ``STARE_REQUIRE`` names it
(``all`` names every one); an unknown name stops the run with one line listing the valid ones. Checked in
process, and end to end by pytest runs of a generated test file that uses the real fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import NEEDS, require

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("value", "fails"),
    [
        (None, set()),
        ("", set()),
        ("docker", {"docker"}),
        ("vllm, shared", {"vllm", "shared"}),
        ("all", set(NEEDS)),
    ],
)
def test_require_skips_unless_the_need_is_named(monkeypatch, value, fails):
    if value is None:
        monkeypatch.delenv("STARE_REQUIRE", raising=False)
    else:
        monkeypatch.setenv("STARE_REQUIRE", value)
    for need in NEEDS:
        require(need, None)  # met: nothing happens
        expected = pytest.fail.Exception if need in fails else pytest.skip.Exception
        with pytest.raises(expected, match="nothing here") as caught:
            require(need, "nothing here")
        assert type(caught.value) is expected, need
    with pytest.raises(ValueError, match="valid: docker"):
        require("dockr", None)


CONFTEST = """
import sys
import types
from pathlib import Path

import tests.conftest
from tests.conftest import *  # noqa: F403 - the real hooks and fixtures
from tests.conftest import pytest_configure, pytest_runtest_setup  # noqa: F401

tests.conftest.SHARED_DATA = Path("/nonexistent/shared/data")
# No CUDA, whatever this machine has (and no real torch to import).
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
"""

TESTS = """
import pytest
from tests.conftest import require

def test_met():
    require("docker", None)

def test_docker():
    require("docker", "no daemon in this test")

def test_shared(shared_data):
    pass

@pytest.mark.gpu
def test_gpu():
    pass
"""


def _run(tmp_path: Path, value: str | None) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """pytest on the generated file; the outcome of each test (passed, skipped, failed)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: a CUDA GPU\n")
    env = {k: v for k, v in os.environ.items() if k != "STARE_REQUIRE"}
    env["PYTHONPATH"] = str(REPO)
    if value is not None:
        env["STARE_REQUIRE"] = value
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "test_generated.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    outcomes = {}
    if report.exists():
        for case in ET.parse(report).iter("testcase"):
            kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcomes[case.get("name")] = {"failure": "failed", "error": "failed"}.get(
                kinds[0] if kinds else "", kinds[0] if kinds else "passed"
            )
    return run, outcomes


def test_unset_skips_every_missing_need(tmp_path):
    run, outcomes = _run(tmp_path, None)
    assert run.returncode == 0, run.stdout[-2000:]
    assert outcomes == {
        "test_met": "passed",
        "test_docker": "skipped",
        "test_shared": "skipped",
        "test_gpu": "skipped",
    }


def test_named_needs_fail_with_the_problem_and_others_still_skip(tmp_path):
    run, outcomes = _run(tmp_path, "shared,gpu")
    assert run.returncode == 1, run.stdout[-2000:]
    assert outcomes == {
        "test_met": "passed",
        "test_docker": "skipped",
        "test_shared": "failed",
        "test_gpu": "failed",
    }
    assert "STARE_REQUIRE=shared,gpu but /nonexistent/shared/data not found" in run.stdout
    assert "STARE_REQUIRE=shared,gpu but no CUDA GPU on this machine" in run.stdout


def test_all_requires_everything(tmp_path):
    run, outcomes = _run(tmp_path, "all")
    assert run.returncode == 1, run.stdout[-2000:]
    assert outcomes == {
        "test_met": "passed",
        "test_docker": "failed",
        "test_shared": "failed",
        "test_gpu": "failed",
    }
    assert "STARE_REQUIRE=all but no daemon in this test" in run.stdout


def test_an_unknown_name_stops_the_run_with_the_valid_names(tmp_path):
    run, outcomes = _run(tmp_path, "docker,dockr")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert outcomes == {}
    [line] = [line for line in run.stderr.splitlines() if "STARE_REQUIRE" in line]
    assert (
        "unknown dockr; valid names: docker, vllm, ray, integrations, shared, gpu, train, embedded, host, tokenizers, all"
        in line
    )


def test_every_skip_goes_through_require():
    """A test skips only through ``require`` (so that CI's STARE_REQUIRE turns the skip into a failure):
    no ``pytest.skip``, ``importorskip`` or ``skipif`` outside tests/conftest.py, and nothing calls
    ``require`` with a need CI does not name except ``gpu``."""
    import re

    direct = re.compile(r"pytest\.skip\(|importorskip\(|\.skipif\(|mark\.skip\b")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path.name != "conftest.py" or path.parent != REPO / "tests"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if direct.search(line) and "pytest.skip.Exception" not in line
    ]
    assert not found, "\n".join(found)
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    named = set(re.search(r"STARE_REQUIRE=([\w,]+)", ci).group(1).split(","))  # type: ignore[union-attr]
    assert named == set(NEEDS) - {"gpu"}, named
