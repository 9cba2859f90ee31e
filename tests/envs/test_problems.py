"""Problem sources: real data files read in place, verl parquet, error messages, generators."""

from __future__ import annotations

import contextlib
import io
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stare_envs.problems import (
    DIFFICULTIES,
    PROBLEM_FAMILIES,
    Problem,
    ProblemSourceError,
    generate_problems,
    load_problems,
    procedural_family,
    register_family,
)
from stare_envs.tool_env import resolve_problems

# -- files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["aime2024", "aime2025"])
def test_aime_files_load_with_integer_answers(shared_data, name):
    problems = load_problems(shared_data / f"{name}.jsonl")
    assert len(problems) == 30
    assert len({p.id for p in problems}) == 30
    assert all(p.id.startswith(name) for p in problems)
    assert all(p.answer.isdigit() and 0 <= int(p.answer) <= 999 for p in problems)
    assert all(p.source.startswith("AIME") for p in problems)


def test_first_aime_2024_problem(shared_data):
    first = load_problems(str(shared_data / "aime2024.jsonl"), limit=1)
    assert len(first) == 1
    assert first[0].id == "aime2024-I-01"
    assert first[0].answer == "204"
    assert first[0].problem.startswith("Every morning Aya goes for a $9$-kilometer-long walk")


def test_math500_keeps_latex_answers(shared_data):
    problems = load_problems(shared_data / "math500.jsonl")
    assert len(problems) == 500
    polar = next(p for p in problems if p.id == "test/precalculus/807.json")
    assert polar.answer == r"\left( 3, \frac{\pi}{2} \right)"


def test_chat_style_rows_with_gt(shared_data):
    """tora_examples rows carry ``messages`` (chat) and ``gt``: the last user message is the problem."""
    problems = load_problems(shared_data / "tora_examples.jsonl", limit=3)
    raw = [json.loads(line) for line in (shared_data / "tora_examples.jsonl").open()][:3]
    assert [p.answer for p in problems] == [row["gt"] for row in raw]
    user = [m["content"] for m in raw[0]["messages"] if m["role"] == "user"][-1]
    assert problems[0].problem == user
    assert problems[0].meta["dataset"] == raw[0]["dataset"]


def test_verl_parquet(tmp_path):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "Reason step by step."},
                {"role": "user", "content": "What is 6 * 7?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": 17},
        },
        {
            "data_source": "dapo",
            "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "4"},
            "extra_info": {"split": "train", "index": 18},
        },
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = load_problems(path)
    assert problems[0] == Problem(
        id="17",
        problem="What is 6 * 7?",
        answer="42",
        source="openai/gsm8k",
        meta={"ability": "math", "extra_info": {"split": "train", "index": 17}},
    )
    assert [p.answer for p in problems] == ["42", "4"]
    assert load_problems(path, limit=1) == problems[:1]


def test_flat_parquet_and_json_and_retool_names(tmp_path):
    pq.write_table(
        pa.Table.from_pylist([{"id": "a", "problem": "1+1?", "answer": 2}]), tmp_path / "f.parquet"
    )
    (tmp_path / "r.json").write_text(json.dumps([{"question": "3+3?", "answer": "6"}]))
    (tmp_path / "v.jsonl").write_text('{"prompt": "5+5?", "ground_truth": "10"}\n\n')
    assert load_problems(tmp_path / "f.parquet") == [Problem("a", "1+1?", "2")]
    assert load_problems(tmp_path / "r.json") == [Problem("r-000000", "3+3?", "6")]
    assert load_problems(tmp_path / "v.jsonl") == [Problem("v-000000", "5+5?", "10")]


def test_missing_file_says_cause_and_fix(tmp_path):
    with pytest.raises(ProblemSourceError, match=r"nope\.jsonl: no such file: check the path"):
        load_problems(tmp_path / "nope.jsonl")
    with pytest.raises(ProblemSourceError, match="no such file"):
        load_problems(str(tmp_path / "nope.parquet"))


def test_malformed_rows_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "ok", "answer": "1"}\n{"problem": "broken", \n')
    with pytest.raises(ProblemSourceError, match=r"bad\.jsonl:2: invalid JSON"):
        load_problems(path)
    path.write_text('{"problem": "ok", "answer": "1"}\n\n{"problem": "no answer"}\n')
    with pytest.raises(ProblemSourceError, match=r"bad\.jsonl:3: no answer \(looked for answer"):
        load_problems(path)
    path.write_text('{"answer": "1"}\n')
    with pytest.raises(ProblemSourceError, match=r"bad\.jsonl:1: no problem text"):
        load_problems(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ProblemSourceError, match=r"bad\.jsonl:1: expected an object, got list"):
        load_problems(path)
    path.write_text('{"prompt": [{"role": "system", "content": "x"}], "answer": "1"}\n')
    with pytest.raises(ProblemSourceError, match=r"bad\.jsonl:1: the chat prompt has no user message"):
        load_problems(path)


def test_unknown_suffix_and_unreadable_parquet(tmp_path):
    (tmp_path / "data.csv").write_text("problem,answer\n")
    with pytest.raises(
        ProblemSourceError, match=r"unknown file type '\.csv': use \.jsonl, \.json or \.parquet"
    ):
        load_problems(tmp_path / "data.csv")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ProblemSourceError, match="not a readable Parquet file"):
        load_problems(tmp_path / "junk.parquet")


def test_hub_name_without_datasets_or_network_fails_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # fail fast where `datasets` is installed, never go online
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ProblemSourceError) as error:
        load_problems("no-such-owner/no-such-dataset")
    message = str(error.value)
    assert "\n" not in message
    assert "no-such-owner/no-such-dataset" in message
    assert "pass a local .jsonl/.parquet file" in message or "pass a local file" in message


def test_neither_file_nor_hub_name():
    with pytest.raises(ProblemSourceError, match="neither an existing file nor a hub name: pass") as error:
        load_problems("just some words")
    message = str(error.value)
    assert "did you mean" not in message and "a procedural family (base_conversion, " in message


def test_a_misspelt_source_names_the_closest_one():
    """data.train=mixd said what a source may be but not which one was meant."""
    with pytest.raises(ProblemSourceError, match=r"'mixd' is neither .*: did you mean 'mixed'\? pass"):
        load_problems("mixd")
    with pytest.raises(ProblemSourceError, match=r"did you mean 'aime2024'\?"):
        load_problems("aime2204")


def test_procedural_sources_are_parsed_in_one_place():
    """``procedural:<family>``, a bare family and ``procedural:`` (all families) mean the same
    everywhere; an unknown family after the prefix is refused with the valid names, not read as a path."""
    assert procedural_family("procedural:modpow") == "modpow"
    assert procedural_family("modpow") == "modpow"
    assert procedural_family("procedural:") == procedural_family("mixed") == "mixed"
    assert procedural_family("aime2024") is None
    assert procedural_family("owner/name") is None
    with pytest.raises(
        ProblemSourceError,
        match=r"^unknown problem family 'nope' in 'procedural:nope': use procedural:<family> with one of "
        r"base_conversion, .*procedural:mixed$",
    ):
        procedural_family("procedural:nope")
    # the environment takes the same sources as the trainer and SFT
    assert resolve_problems("procedural:modpow") == "modpow"
    assert resolve_problems("procedural:") == "mixed"


# -- generators -------------------------------------------------------------------------------------


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # our own reference programs
    return out.getvalue().strip()


def test_expected_families_are_registered():
    assert set(PROBLEM_FAMILIES) == {
        "multiplication",
        "modpow",
        "gcd_lcm",
        "divisors",
        "base_conversion",
        "sequence_sum",
        "combinatorics",
    }


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("family", [*sorted(PROBLEM_FAMILIES), "mixed"])
def test_solution_code_prints_the_answer(family, difficulty):
    for problem in generate_problems(family, 4, seed=11, difficulty=difficulty):
        assert problem.answer.isdigit()
        assert _run(problem.meta["solution_code"]) == problem.answer
        assert problem.meta["difficulty"] == difficulty
        assert problem.source == f"generated:{problem.meta['family']}"


def test_same_seed_same_problems_and_prefix_stability():
    first = generate_problems("mixed", 20, seed=5, difficulty=2)
    assert first == generate_problems("mixed", 20, seed=5, difficulty=2)
    assert first[:7] == generate_problems("mixed", 7, seed=5, difficulty=2)
    assert first != generate_problems("mixed", 20, seed=6, difficulty=2)
    assert len({p.meta["family"] for p in first}) >= 4
    assert first[17].id == "mixed-d2-s5-000017"


def test_ids_and_answers_checked_by_hand():
    problem = generate_problems("multiplication", 18, seed=0, difficulty=2)[17]
    assert problem.id == "multiplication-d2-s0-000017"
    a, b = (int(x) for x in problem.problem.split("$")[1].split(r" \times "))
    assert len(str(a)) == 8 and len(str(b)) == 7
    assert int(problem.answer) == a * b


def test_difficulty_makes_numbers_larger():
    def mean_answer_digits(difficulty: int) -> float:
        problems = generate_problems("mixed", 40, seed=1, difficulty=difficulty)
        return sum(len(p.answer) for p in problems) / len(problems)

    assert mean_answer_digits(1) < mean_answer_digits(2) < mean_answer_digits(3)


def test_divisor_counts_and_modpow_against_brute_force():
    for problem in generate_problems("divisors", 5, seed=2, difficulty=2):
        n, count = int(problem.problem.split("$")[1]), 1
        for p in range(2, 100):  # the generator builds n from primes below 100
            exponent = 0
            while n % p == 0:
                n, exponent = n // p, exponent + 1
            count *= exponent + 1
        assert n == 1
        assert int(problem.answer) == count
    for problem in generate_problems("modpow", 5, seed=2, difficulty=1):
        base, exponent = problem.problem.split("$")[1].replace("}", "").split("^{")
        modulus = int(problem.problem.split("$")[3])
        value = 1
        for _ in range(int(exponent)):
            value = value * int(base) % modulus
        assert int(problem.answer) == value


def test_registry_refuses_duplicates_and_lists_names():
    with pytest.raises(ValueError, match="'modpow' is already registered"):
        register_family("modpow")(lambda rng, difficulty: ("", 0, ""))
    with pytest.raises(KeyError, match="unknown problem family 'primes': choose one of base_conversion, "):
        generate_problems("primes", 1)
    with pytest.raises(ValueError, match=r"difficulty must be one of \(1, 2, 3\)"):
        generate_problems("modpow", 1, difficulty=4)


def test_registering_a_new_family():
    @register_family("test_squares")
    def squares(rng: random.Random, difficulty: int):
        n = rng.randrange(10**5, 10**6)
        return f"Compute ${n}^2$.", n * n, f"print({n} ** 2)"

    try:
        [problem] = generate_problems("test_squares", 1, seed=3)
        assert _run(problem.meta["solution_code"]) == problem.answer
        assert problem.id == "test_squares-d1-s3-000000"
    finally:
        dict.pop(PROBLEM_FAMILIES, "test_squares")
