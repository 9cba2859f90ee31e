"""`stare-agent doctor tokens` and what the learner makes of the matrix's episodes: its input is the
trajectory's ids, its loss mask exactly the model's tokens, for every family (docs/tokens.md)."""

from __future__ import annotations

import pytest

from stare_agent.train.batch import collate
from stare_envs.qualification import CASES, qualify
from tests.helpers_tokenizers import FAMILY_DIR, family_tokenizer
from tests.stare_agent.test_cli import cli


@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "deepseek_v3", "gemma3"])
def test_the_learners_input_is_each_played_trajectory(family):
    tokenizer = family_tokenizer(family)
    played = [r.trajectory for fmt in ("retool", "hermes") for r in qualify(tokenizer, fmt) if r.trajectory]
    assert len(played) >= len(CASES)
    batch = collate(played, pad_id=0)
    for i, t in enumerate(played):
        ids = t.prompt_ids + t.response_ids
        mask = [0] * len(t.prompt_ids) + t.loss_mask
        assert batch["input_ids"][i, : len(ids)].tolist() == ids
        assert batch["targets"][i, : len(ids) - 1].tolist() == ids[1:]
        assert batch["response_mask"][i, : len(ids) - 1].tolist() == [float(m) for m in mask[1:]]
        assert batch["response_mask"][i, len(ids) - 1 :].sum() == 0


def test_doctor_tokens_prints_the_matrix_of_a_local_tokenizer():
    family_tokenizer("qwen3")  # fetched, or the need said
    done = cli("doctor", "tokens", "--model", str(FAMILY_DIR / "qwen3"), "--formats", "hermes")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("hermes ")]
    assert [row.split()[-1] if False else row[9:41].strip() for row in rows] == list(CASES)
    assert all(" exact " in row for row in rows), done.stdout


def test_doctor_tokens_says_in_one_line_what_cannot_be_read(tmp_path):
    done = cli("doctor", "tokens", "--model", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
