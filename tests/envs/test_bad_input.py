"""Malformed model turns: each gives an observation saying what went wrong, nothing raises, and the
episode goes on (a tool call was attempted) or ends (the model stopped), as documented in stare_envs.tool_env."""

from __future__ import annotations

import json

import pytest

from stare_envs import CodeInterpreterEnv
from stare_envs.problems import Problem

PROBLEM = Problem("p1", "What is 6 * 7?", "42")


@pytest.fixture
def retool(fake_pool):
    env = CodeInterpreterEnv([PROBLEM], pool=fake_pool, max_turns=4)
    env.reset(seed=0)
    yield env
    env.close()


@pytest.fixture
def hermes(fake_pool):
    env = CodeInterpreterEnv([PROBLEM], pool=fake_pool, format="hermes", max_turns=4)
    env.reset(seed=0)
    yield env
    env.close()


def play(env, action):
    """One step; checks the invariants every bad input must keep."""
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs in env.observation_space
    assert reward == 0.0 and not truncated
    return obs, terminated, info


def test_unclosed_code_tag_still_runs(retool):
    obs, terminated, info = play(retool, "<code>\n```python\nprint(6 * 7)\n")
    assert (obs, terminated, info["num_tool_calls"]) == ("\n<interpreter>\n42\n</interpreter>\n", False, 1)


def test_several_code_blocks_run_the_first_and_say_so(retool):
    obs, terminated, info = play(retool, "<code>print(1)</code><code>print(2)</code>")
    assert obs == (
        "\n<interpreter>\nError: Only the first code block of a turn is run; 1 later block(s) were ignored. "
        "Write one block, then wait for its output.\n1\n</interpreter>\n"
    )
    assert not terminated and info["num_tool_calls"] == 1 and info["num_parse_errors"] == 1


def test_empty_code_is_reported_and_nothing_runs(retool):
    obs, terminated, info = play(retool, "<code>\n```python\n\n```\n</code>")
    assert "Error: The code block is empty" in obs
    assert not terminated and info["num_tool_calls"] == 0 and info["num_parse_errors"] == 1


def test_megabytes_of_code_are_refused_with_the_limit(retool):
    action = "<code>\n```python\n" + "x = 1\n" * 500_000 + "```\n</code>"  # 3 MB
    obs, terminated, info = play(retool, action)
    assert f"The code_interpreter call is {len(action):,} characters long; the limit is 100,000." in obs
    assert "Nothing was run" in obs and not terminated and info["num_tool_calls"] == 0


def test_control_characters_and_invalid_utf8_are_replaced_and_reported(retool):
    obs, terminated, info = play(retool, "<code>print('a\x00b' + '\udcff')</code>")
    assert obs == (
        "\n<interpreter>\nError: Your turn contained 2 invalid character(s) (control characters or text "
        "that was not valid UTF-8); they were replaced with U+FFFD.\na\ufffdb\ufffd\n</interpreter>\n"
    )
    assert not terminated and info["num_parse_errors"] == 0  # a note, not a parse error
    obs, *_ = play(retool, b"<code>print('\xff')</code>")  # raw bytes that are not UTF-8
    assert "1 invalid character(s)" in obs and "\ufffd\n</interpreter>" in obs


def test_control_characters_in_tool_output_are_escaped_visibly(retool):
    obs, *_ = play(retool, "<code>print('\\x1b[31mred\\x1b[0m\\x07 done\\r')</code>")
    # ANSI color codes are dropped; other control characters are shown as escapes.
    assert obs == "\n<interpreter>\nred\\x07 done\n</interpreter>\n"


def test_closing_tag_without_opening_tag(retool):
    obs, terminated, info = play(retool, "print(6 * 7)\n</code>")
    assert obs.startswith("\n<interpreter>\nError: Found </code> without <code>")
    assert not terminated and info["num_tool_calls"] == 0


def test_code_that_raises_is_an_observation(retool):
    obs, terminated, _ = play(retool, "<code>1 / 0</code>")
    assert "ZeroDivisionError" in obs and not terminated


def test_broken_json_tool_call(hermes):
    obs, terminated, info = play(
        hermes, '<tool_call>{"name": "code_interpreter", "arguments": {"code": </tool_call>'
    )
    assert obs.startswith("Error: Tool call 1 is not valid JSON (Expecting value at char 51)")
    assert not terminated and info["num_parse_errors"] == 1


def test_unknown_tool_name_lists_the_available_ones(hermes):
    obs, terminated, _ = play(hermes, '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
    assert obs == "Error: Unknown tool 'python': available tools are ['code_interpreter']."
    assert not terminated


def test_wrong_argument_type_and_missing_argument(hermes):
    call = '<tool_call>{"name": "code_interpreter", "arguments": %s}</tool_call>'
    obs, terminated, info = play(hermes, call % json.dumps({"code": 5}))
    assert obs == "code_interpreter: argument 'code' must be a JSON string, got int." and not terminated
    assert info["tool_calls"][0]["error_type"] == "InvalidArguments"
    obs, *_ = play(hermes, call % "{}")
    assert obs == "code_interpreter: missing required argument(s) ['code']; expected ['code']."


def test_one_bad_call_does_not_stop_the_good_ones(hermes):
    good = '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(42)"}}</tool_call>'
    obs, _, info = play(hermes, "<tool_call>{oops}</tool_call>" + good)
    assert obs.startswith("Error: Tool call 1 is not valid JSON") and obs.endswith(
        "[1] code_interpreter:\n42"
    )
    assert info["num_tool_calls"] == 1


def test_repeated_bad_input_ends_at_max_turns(retool):
    for _ in range(3):
        play(retool, "</code>")
    obs, reward, terminated, truncated, info = retool.step("</code>")
    assert (obs, reward, terminated, truncated, info["num_parse_errors"]) == ("", 0.0, False, True, 4)


def test_text_without_tool_call_or_answer_ends_the_episode(retool):
    obs, reward, terminated, truncated, info = retool.step("\x00\x01 I am done.")
    assert (obs, reward, terminated, truncated, info["answer"]) == ("", 0.0, True, False, None)
