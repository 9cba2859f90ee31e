"""One parser of problem sources and one reader of files: the trainer, the evaluation set, SFT data
and the environment read a source the same way and fail on it with the same message."""

from __future__ import annotations

import json

import pytest

from stare_agent.train.sft_data import SFTDataError, read_traces
from stare_envs.problems import (
    ProblemSourceError,
    ProblemStream,
    eval_problems,
    generate_problems,
    load_problems,
)


def test_trainer_and_eval_parse_procedural_sources_like_the_env():
    stream = ProblemStream("procedural:", seed=0)
    assert stream.family == "mixed"
    assert ProblemStream("procedural:modpow", seed=0).take(1)[0].meta["family"] == "modpow"
    held_out = eval_problems("procedural:", seed=0, difficulty=1, limit=3)
    assert [p.id for p in held_out] == [
        p.id for p in generate_problems("mixed", 3, seed=held_out[0].meta["seed"])
    ]
    for make in (
        lambda: ProblemStream("procedural:nope", seed=0),
        lambda: eval_problems("procedural:nope", seed=0, difficulty=1, limit=2),
    ):
        with pytest.raises(ProblemSourceError, match=r"^unknown problem family 'nope' in 'procedural:nope'"):
            make()


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.jsonl", None),
        ("bad.jsonl", '{"broken": \n'),
        ("object.json", json.dumps({"messages": []})),
        ("data.csv", "a,b\n"),
    ],
)
def test_sft_data_and_problems_share_one_reader(tmp_path, name, content):
    """The same bad file gives the same one-line message to SFT and to the problem loader."""
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProblemSourceError) as problems_error:
        load_problems(path)
    with pytest.raises(SFTDataError) as sft_error:
        read_traces(path)
    assert str(sft_error.value) == str(problems_error.value)
    assert "\n" not in str(sft_error.value)
