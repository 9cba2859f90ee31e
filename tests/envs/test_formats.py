"""ReTool and Hermes parsing/rendering, answer extraction, and text cleaning."""

from __future__ import annotations

import pytest

from stare_envs.formats import (
    CODE_TOOL,
    HermesFormat,
    ReToolFormat,
    clean_model_text,
    find_answer,
    get_format,
    observation_charset,
    printable,
)
from stare_envs.tools import render_exec_result
from stare_sandbox.result import ExecError, ExecResult

retool = ReToolFormat()
hermes = HermesFormat()
FENCED = "Let me compute.\n<code>\n```python\nx = 6 * 7\nprint(x)\n```\n</code>"


def test_retool_fenced_block_is_one_code_interpreter_call():
    turn = retool.parse(FENCED)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [(CODE_TOOL, {"code": "x = 6 * 7\nprint(x)"})]
    assert turn.tool_calls[0].raw == FENCED[FENCED.index("<code>") :]
    assert turn.final_answer is None and turn.errors == [] and not turn.has_answer_tag


@pytest.mark.parametrize(
    "text",
    [
        "<code>\nprint(1)\n</code>",  # no fence
        "<code>\n```python\nprint(1)\n```",  # generator stopped before </code> (stop string stripped)
        "<code>```py\nprint(1)\n```</code>",  # other language tag, same line
        "<code>\n```python\nprint(1)\n</code>",  # fence never closed
        "<CODE>\nprint(1)\n</CODE>",  # tags are case-insensitive
    ],
)
def test_retool_is_lenient_about_fences_and_the_stop_string(text):
    turn = retool.parse(text)
    assert [c.arguments["code"] for c in turn.tool_calls] == ["print(1)"]
    assert turn.errors == []


def test_retool_runs_only_the_first_of_several_blocks_and_says_so():
    turn = retool.parse("<code>print(1)</code> then <code>print(2)</code><code>print(3)</code>")
    assert [c.arguments["code"] for c in turn.tool_calls] == ["print(1)"]
    assert turn.errors == [
        "Only the first code block of a turn is run; 2 later block(s) were ignored. "
        "Write one block, then wait for its output."
    ]


def test_retool_unclosed_block_before_another_is_reported():
    turn = retool.parse("<code>print(1)\n<code>print(2)</code>")
    assert turn.tool_calls[0].arguments["code"] == "print(1)"
    assert any("not closed before the next <code>" in e for e in turn.errors)


def test_retool_empty_code_and_stray_closing_tag_are_errors_without_calls():
    empty = retool.parse("<code>\n```python\n```\n</code>")
    assert empty.tool_calls == [] and "The code block is empty" in empty.errors[0]
    stray = retool.parse("print(1)\n</code>")
    assert stray.tool_calls == [] and stray.errors[0].startswith("Found </code> without <code>")


@pytest.mark.parametrize(
    ("text", "answer", "tag"),
    [
        ("So <answer>The result is \\boxed{204}.</answer>", "204", True),
        ("<answer>\\boxed{1} no, \\boxed{\\frac{1}{2}}</answer> \\boxed{9}", "\\frac{1}{2}", True),
        ("<answer> 42 </answer>", "42", True),  # no box: the tag's text
        ("<answer>\\boxed{7}", "7", True),  # unclosed tag runs to the end
        ("I get \\boxed{3} and finally \\boxed{ 204 }.", "204", False),  # last bare box
        ("no answer here", None, False),
    ],
)
def test_final_answer(text, answer, tag):
    turn = retool.parse(text)
    assert (turn.final_answer, turn.has_answer_tag, turn.tool_calls) == (answer, tag, [])
    assert hermes.parse(text).final_answer == answer


def test_empty_answer_and_stray_answer_close_are_errors():
    assert find_answer("<answer>  </answer>") == (
        None,
        True,
        ["The <answer> tag is empty: put the final result inside it as \\boxed{...}."],
    )
    assert find_answer("42</answer>")[2] == [
        "Found </answer> without <answer>: write <answer> ... \\boxed{...} </answer>."
    ]


def test_a_turn_with_code_never_gives_the_final_answer():
    turn = retool.parse("<code>print(1)</code>\n<answer>\\boxed{1}</answer>")
    assert turn.final_answer is None and len(turn.tool_calls) == 1
    assert "the answer was ignored" in turn.errors[0]


def test_retool_renders_interpreter_block_with_errors_first():
    call = retool.parse(FENCED).tool_calls[0]
    assert retool.render_observation([(call, "42")]) == "\n<interpreter>\n42\n</interpreter>\n"
    assert retool.render_observation([], ["bad"]) == "\n<interpreter>\nError: bad\n</interpreter>\n"
    assert retool.stop_strings == ["</code>"] and retool.observation_role == "assistant"


def test_hermes_parses_every_call_in_order():
    text = (
        'Try both.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2+2\\"}"}</tool_call>'
    )
    turn = hermes.parse(text)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("code_interpreter", {"code": "print(1)"}),
        ("calc", {"expression": "2+2"}),  # arguments given as a JSON string are decoded
    ]
    assert turn.errors == [] and turn.final_answer is None


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            '{"name": "code_interpreter", "arguments": {"code": "x"}',
            "Tool call 1 is not valid JSON (Expecting ',' delimiter",
        ),
        ('{"arguments": {}}', 'Tool call 1 has no "name" string'),
        ('["code_interpreter"]', 'Tool call 1 has no "name" string'),
        ('{"name": "f", "arguments": [1]}', 'Tool call 1: "arguments" must be a JSON object'),
    ],
)
def test_hermes_malformed_calls_are_errors(body, error):
    turn = hermes.parse(f"<tool_call>{body}</tool_call>")
    assert turn.tool_calls == [] and turn.errors[0].startswith(error)


def test_hermes_unclosed_call_runs_to_end_and_stray_close_is_error():
    turn = hermes.parse('<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in turn.tool_calls] == ["f"]
    assert hermes.parse("oops</tool_call>").errors[0].startswith("Found </tool_call> without <tool_call>")


def test_hermes_render_and_system_prompt_lists_tools():
    call = hermes.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>').tool_calls[0]
    assert hermes.render_observation([(call, "out")]) == "out"
    assert hermes.render_observation([(call, "a"), (call, "b")], ["e"]) == "Error: e\n[1] f:\na\n[2] f:\nb"
    schema = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}
    assert '{"type": "function", "function": {"name": "f"' in hermes.system_prompt([schema])
    assert hermes.observation_role == "tool" and hermes.stop_strings == ["</tool_call>"]


def test_get_format_by_name_and_error_lists_valid_names():
    assert isinstance(get_format("retool"), ReToolFormat) and get_format(hermes) is hermes
    with pytest.raises(
        KeyError,
        match=r"Unknown tool format 'xml': use one of \['deepseek_v3', 'hermes', 'llama3_json', 'qwen3', 'retool'\]",
    ):
        get_format("xml")


def test_clean_model_text_replaces_controls_surrogates_and_bad_bytes():
    assert clean_model_text("a\x00b\udcffc\r\nd\te") == ("a\ufffdb\ufffdc\nd\te", 2)
    assert clean_model_text(b"ok \xff\xfe!") == ("ok \ufffd\ufffd!", 2)


def test_printable_maps_everything_into_the_charset():
    text = printable("a\x1b[31mred\x1b[0m\u00a0b\r\nc\rd\u200b\udc80")
    assert text == "a\\x1b[31mred\\x1b[0m b\nc\nd\\u200b\\udc80"
    charset = observation_charset()
    assert all(ch in charset for ch in text)
    assert "\n" in charset and "\t" in charset and "é" in charset and "\x00" not in charset


@pytest.mark.parametrize(
    ("message", "lost", "line"),
    [
        (
            "the code timed out after 5 s of CPU time; it was interrupted and variables are kept",
            False,
            "TimeoutError: the code timed out after 5 s of CPU time (output so far is shown above). "
            "The interpreter was interrupted; variables defined before this call are kept.",
        ),
        (
            "the code timed out after 2 s; the kernel was restarted and all state is lost",
            True,
            "TimeoutError: the code timed out after 2 s (output so far is shown above). "
            "The interpreter was restarted: all variables and imports are lost.",
        ),
    ],
)
def test_a_timeout_is_one_line_naming_the_limit_the_sandbox_applied(message, lost, line):
    result = ExecResult(
        stdout="started\n", error=ExecError("TimeoutError", message), timed_out=True, state_lost=lost
    )
    assert render_exec_result(result) == f"started\n{line}"
