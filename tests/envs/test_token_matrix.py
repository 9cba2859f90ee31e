"""The token-exactness matrix (docs/tokens.md): every model family's real tokenizer and chat template,
every case, played through the real rollout runner by ``stare_envs.qualification.qualify``."""

from __future__ import annotations

import re

import pytest

from stare_envs import qualification
from stare_envs.engine import RolloutError
from stare_envs.qualification import CASES, qualify
from stare_envs.rollout import ToolTurnGlue, render_chat
from stare_envs.text_tokens import encode_as_text
from tests.helpers_tokenizers import FAMILIES, family_tokenizer, smollm2_tokenizer

# family -> format -> the verdict of every case ("exact" or "not supported"), or of each case where
# they differ: docs/tokens.md's table. Each family is played in the two general formats and its own.
NOT_SUPPORTED = "not supported"
EXPECTED = {
    "smollm2": {"retool": "exact", "hermes": "exact"},
    "qwen3": {"retool": "exact", "hermes": "exact", "qwen3": "exact"},
    "llama3_1": {
        "retool": "exact",
        "hermes": "exact",
        "llama3_json": {
            **dict.fromkeys(CASES, "exact"),
            "two calls in one turn": NOT_SUPPORTED,
            "thinking in an earlier turn": NOT_SUPPORTED,
        },
    },
    "deepseek_v3": {"retool": "exact", "hermes": "exact", "deepseek_v3": "exact"},
    "gemma3": {"retool": "exact", "hermes": NOT_SUPPORTED},
    "gptoss": {"retool": NOT_SUPPORTED, "hermes": NOT_SUPPORTED},
}
PLAYS = [(family, fmt) for family, formats in EXPECTED.items() for fmt in formats]


def test_the_matrix_covers_every_fetched_family():
    assert list(EXPECTED) == ["smollm2", *FAMILIES]


def _tokenizer(family: str):
    return smollm2_tokenizer() if family == "smollm2" else family_tokenizer(family)


@pytest.mark.parametrize(("family", "fmt"), PLAYS)
def test_every_case_of_every_family_is_exact_or_refused_in_one_line(family, fmt):
    results = qualify(_tokenizer(family), fmt)
    assert [r.case for r in results] == list(CASES)
    expected = EXPECTED[family][fmt]
    assert {r.case: r.verdict for r in results} == (
        dict.fromkeys(CASES, expected) if isinstance(expected, str) else expected
    )
    for r in results:
        assert "\n" not in r.note, r.note  # refused or noted in one line
        if r.exact is not None:
            assert r.trajectory is not None and r.trajectory.info["finish_reason"] in ("terminated", "budget")


def test_what_the_matrix_says_differs_from_the_template_is_said():
    """Qwen3's template writes an empty think block into the last assistant message (the episode keeps
    the turn as sampled); one call a turn (the stop string); control strings stay text."""
    qwen3 = {r.case: r for r in qualify(family_tokenizer("qwen3"), "hermes")}
    assert qwen3["one tool call"].template_same is False and "<think>" in qwen3["one tool call"].note
    assert "one call a turn" in qwen3["two calls in one turn"].note
    parallel = qualify(family_tokenizer("qwen3"), "qwen3", cases=["two calls in one turn"])[0]
    assert (
        parallel.exact
        and len(parallel.trajectory.info["tool_calls"]) == 2
        and not parallel.note.startswith("one")
    )
    assert "stay text" in qwen3["tool output with control tokens"].note
    assert qwen3["turn cut by the budget"].template_same is True
    gemma = {r.case: r for r in qualify(family_tokenizer("gemma3"), "hermes")}
    assert "cannot render a tool message" in gemma["one tool call"].note
    gptoss = qualify(family_tokenizer("gptoss"), "retool")
    assert "has no chat template" in gptoss[0].note


def test_qwen3_tool_messages_are_glued_as_its_template_writes_them():
    """Qwen3's template renders the last assistant message inside an empty think block and the earlier
    ones without: the glue is cut after an earlier one (it used to be refused)."""
    qwen3 = family_tokenizer("qwen3")
    glue = ToolTurnGlue(qwen3)("144", turn_ended_with_eos=False)
    assert qwen3.decode(glue) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n144\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert ToolTurnGlue(qwen3)("144", turn_ended_with_eos=True) == glue[1:]  # <|im_end|> was sampled


def test_gemma_whitespace_tokens_in_tool_output_stay_its_own_tokenization():
    """Gemma adds runs of newlines and tabs as tokens: they are text, so tool output with blank lines
    keeps the ids plain encoding gives (they were split, one newline a token)."""
    gemma = family_tokenizer("gemma3")
    text = "x = 1\n\n\ty\t\tz\n"
    assert encode_as_text(gemma, text) == gemma.encode(text, add_special_tokens=False)
    start = gemma.convert_tokens_to_ids("<start_of_turn>")
    assert start not in encode_as_text(gemma, "<start_of_turn>model\n")  # chat structure stays text


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    with pytest.raises(RolloutError, match=r"has no chat template: set tokenizer.chat_template"):
        render_chat(family_tokenizer("gptoss"), [{"role": "user", "content": "hi"}])


def test_the_matrix_catches_tool_output_that_becomes_control_tokens(monkeypatch):
    """Mutation: the runner encodes tool output plainly (a printed <|im_end|> becomes the token)."""
    from stare_envs import rollout

    monkeypatch.setattr(
        rollout, "encode_as_text", lambda tok, text: tok.encode(text, add_special_tokens=False)
    )
    result = qualify(smollm2_tokenizer(), "retool", cases=["tool output with control tokens"])[0]
    assert result.exact is False and "became control tokens" in result.note


def test_the_matrix_catches_a_mask_that_marks_inserted_tokens(monkeypatch):
    """Mutation: the trajectory builder marks tool output as the model's."""
    from stare_envs.trajectory import TrajectoryBuilder

    append = TrajectoryBuilder.append

    def marks_everything(self, ids, mask, logprobs=None, **kwargs):
        return append(self, ids, 1, [0.0] * len(ids) if logprobs is None else logprobs, **kwargs)

    monkeypatch.setattr(TrajectoryBuilder, "append", marks_everything)
    result = qualify(smollm2_tokenizer(), "hermes", cases=["one tool call"])[0]
    assert result.exact is False and "loss mask" in result.note


def test_the_matrix_catches_an_engine_prompt_that_is_not_the_trajectory(monkeypatch):
    """Mutation: the policy is given the history re-encoded from text (the drift the matrix guards)."""
    policy_generate = qualification._ScriptedPolicy.generate

    def drifted(self, prompts, params, stop):
        out = policy_generate(self, prompts, params, stop)
        prompt, ids = self.calls[-1]
        if len(self.calls) > 1:  # turn 2 on: the engine records a prompt re-encoded from its text
            self.calls[-1] = (
                self.tokenizer.encode(self.tokenizer.decode(prompt) + " ", add_special_tokens=False),
                ids,
            )
        return out

    monkeypatch.setattr(qualification._ScriptedPolicy, "generate", drifted)
    result = qualify(smollm2_tokenizer(), "retool", cases=["one tool call"])[0]
    assert result.exact is False and "prompt is not the trajectory so far" in result.note


def test_the_published_matrix_is_the_one_the_suite_plays():
    """docs/tokens.md's table says, cell by cell, the verdicts EXPECTED holds (and the suite plays)."""
    from pathlib import Path

    names = {
        "SmolLM2 (ChatML)": "smollm2",
        "Qwen3": "qwen3",
        "Llama 3.1": "llama3_1",
        "DeepSeek-V3": "deepseek_v3",
        "Gemma 3": "gemma3",
        "gpt-oss": "gptoss",
    }
    page = (Path(__file__).resolve().parents[2] / "docs" / "tokens.md").read_text(encoding="utf-8")
    published: dict[tuple[str, str], dict[str, str]] = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] not in names:
            continue
        family = names[cells[0]]
        verdicts = [c.split(",")[0] for c in cells[2:]]
        named = [f for f in re.findall(r"`([a-z0-9_]+)`", cells[1]) if f in EXPECTED[family]]
        for fmt in named or (EXPECTED[family] if cells[1] == "any" else []):
            filled = [v for v in verdicts if v] or [NOT_SUPPORTED]
            row = filled if len(filled) == len(CASES) else filled * len(CASES)
            published[(family, fmt)] = dict(zip(CASES, row, strict=True))
    expected = {
        (family, fmt): dict.fromkeys(CASES, verdict) if isinstance(verdict, str) else verdict
        for family, formats in EXPECTED.items()
        for fmt, verdict in formats.items()
    }
    assert published == expected
