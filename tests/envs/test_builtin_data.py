"""The evaluation sets shipped inside ``stare_envs`` (package data): the same bytes as ../shared/data, loadable by
short name, behind the ``stare/<BENCHMARK>-v0`` ids without any path, with their provenance and licences."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium
import pytest

import stare_envs
from stare_envs.problems import BUILTIN_SETS, ProblemSourceError, builtin_set_path, load_problems
from stare_envs.registry import BENCHMARKS, benchmark_path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DATA = Path(stare_envs.__file__).resolve().parent / "data"
SIZES = {"aime2024": 30, "aime2025": 30, "amc23": 40, "math500": 500}


def test_the_four_sets_are_package_data_identical_to_shared_data(shared_data):
    assert set(BUILTIN_SETS) == set(SIZES)
    for name in BUILTIN_SETS:
        shipped = builtin_set_path(name)
        assert shipped.parent == PACKAGE_DATA
        assert shipped.read_bytes() == (shared_data / f"{name}.jsonl").read_bytes(), name


@pytest.mark.parametrize("name", sorted(SIZES))
def test_short_names_load_the_shipped_sets(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing relative to the repository
    problems = load_problems(name)
    assert len(problems) == SIZES[name]
    first_ids = {"aime2024": "aime2024-I-01", "aime2025": "aime2025-I-01", "amc23": "amc23-00"}
    assert problems[0].id == first_ids.get(name, "test/precalculus/807.json")
    assert len({p.id for p in problems}) == SIZES[name]
    assert load_problems(name, limit=2) == problems[:2]


def test_first_aime_2024_problem_by_short_name():
    first = load_problems("aime2024", limit=1)[0]
    assert (first.id, first.answer) == ("aime2024-I-01", "204")


def test_unknown_short_name_lists_the_builtin_sets():
    with pytest.raises(
        ProblemSourceError,
        match=r"'aime2023' is neither an existing file nor .* built-in set \(aime2024, aime2025",
    ):
        load_problems("aime2023")
    with pytest.raises(ProblemSourceError, match=r"unknown built-in set 'gsm8k': use one of aime2024"):
        builtin_set_path("gsm8k")


def test_a_folder_named_like_a_set_does_not_shadow_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "aime2024").mkdir()  # not a problem file: the shipped set loads
    assert len(load_problems("aime2024")) == 30


def test_benchmark_ids_need_no_path(monkeypatch, tmp_path):
    monkeypatch.delenv("STARE_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    for benchmark, name in BENCHMARKS.items():
        assert benchmark_path(benchmark) == builtin_set_path(name)
    env = gymnasium.make("stare/AIME2024-v0", sandbox_backend="local")
    assert len(env.unwrapped.problems) == 30
    assert env.reset(seed=0)[1]["problem_id"].startswith("aime2024-")
    env.close()


def test_data_dir_variable_is_used_and_a_missing_file_there_is_an_error(monkeypatch, tmp_path, shared_data):
    monkeypatch.setenv("STARE_DATA_DIR", str(shared_data))
    assert benchmark_path("AMC23") == shared_data / "amc23.jsonl"
    monkeypatch.setenv("STARE_DATA_DIR", str(tmp_path))
    with pytest.raises(
        FileNotFoundError,
        match=r"amc23.jsonl: it is STARE_DATA_DIR's folder: put amc23.jsonl there, or unset STARE_DATA_DIR for the",
    ):
        benchmark_path("AMC23")


def test_provenance_names_every_shipped_file_its_source_and_licence():
    sources = (PACKAGE_DATA / "SOURCES.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\w+\.jsonl) \|.*$", sources, re.M)}
    assert sorted(rows) == sorted(f"{name}.jsonl" for name in BUILTIN_SETS)
    for row in rows.values():
        assert re.search(r"@ [0-9a-f]{7}", row), row  # repository at a commit
        assert "Apache-2.0" in row or "MIT" in row, row
    for licence in ("Apache-2.0", "MIT"):
        assert (PACKAGE_DATA / "LICENSES" / f"{licence}.txt").is_file()
    shipped = {p.relative_to(PACKAGE_DATA).as_posix() for p in PACKAGE_DATA.rglob("*") if p.is_file()}
    expected = {f"{n}.jsonl" for n in BUILTIN_SETS} | {
        "SOURCES.md",
        "LICENSES/Apache-2.0.txt",
        "LICENSES/MIT.txt",
    }
    assert shipped == expected


def test_module_doctests():
    import doctest

    import stare_envs.problems
    import stare_envs.registry

    for module in (stare_envs.problems, stare_envs.registry):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
