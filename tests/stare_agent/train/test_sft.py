"""Cold-start SFT: trace readers, RL-exact masks (real SmolLM2 tokenizer), real sandbox traces, training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stare_agent.config import load_config
from stare_agent.models import load_tokenizer, tiny_model
from stare_agent.train.learner import Learner
from stare_agent.train.sft import load_sft_traces, sft
from stare_agent.train.sft_data import (
    SFTDataError,
    openai_trace,
    procedural_trace,
    read_traces,
    render_prompt,
    retool_trace,
    split_retool_response,
    trace_to_trajectory,
    write_retool_jsonl,
)
from stare_envs.problems import generate_problems
from stare_sandbox import make_sandbox

RETOOL_USER = (
    "Solve the following problem step by step. ... wrapped with `<code>`.\n<answer>\n\\boxed{...}\n</answer>\n\n"
    "*user question:*\nWhat is 6 * 7?"
)
PART1 = "Let me compute.\n<code>\n```python\nprint(6 * 7)\n```\n</code>"
OUTPUT = "\n<interpreter>\n42\n</interpreter>\n"
PART2 = "So it is 42.\n<answer>\\boxed{42}</answer>"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_retool_masks_cover_exactly_the_interpreter_output(tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": RETOOL_USER},
            {"role": "assistant", "content": PART1 + OUTPUT + PART2},
        ]
    }
    trace = retool_trace(row)
    assert trace.problem == "What is 6 * 7?"  # after the marker, <answer> tags of the template dropped
    assert trace.steps == [("model", PART1), ("tool", OUTPUT), ("model", PART2)]
    t = trace_to_trajectory(trace, tokenizer)
    n1 = len(tokenizer.encode(PART1, add_special_tokens=False))
    n0 = len(tokenizer.encode(OUTPUT, add_special_tokens=False))
    n2 = len(tokenizer.encode(PART2, add_special_tokens=False))
    assert t.loss_mask == [1] * n1 + [0] * n0 + [1] * (n2 + 1)
    masked = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
    trained = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 1]
    assert _decode(tokenizer, masked) == "\n<interpreter>\n42\n</interpreter>\n"
    assert _decode(tokenizer, trained) == PART1 + PART2 + "<|im_end|>"
    prompt = _decode(tokenizer, t.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nSolve the problem step by step.")
    assert prompt.endswith("<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt == render_prompt(tokenizer, "What is 6 * 7?")
    assert t.turn_spans == [(0, n1), (n1 + n0, n1 + n0 + n2 + 1)]


def test_split_keeps_every_character_and_handles_two_blocks():
    text = "a<code>x</code>\n<interpreter>\n1\n</interpreter>\nb<code>y</code>  <interpreter>2</interpreter>c"
    steps = split_retool_response(text)
    assert "".join(s for _, s in steps) == text
    assert [k for k, _ in steps] == ["model", "tool", "model", "tool", "model"]
    assert steps[3] == ("tool", "  <interpreter>2</interpreter>")


def test_openai_tool_calls_become_hermes_with_masked_glue(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "ignored: the env's own system prompt is used"},
            {"role": "user", "content": "What is 6 * 7?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "code_interpreter", "arguments": '{"code": "print(6*7)"}'},
                    }
                ],
            },
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"},
        ]
    }
    trace = openai_trace(row)
    call = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    assert trace.format == "hermes"
    assert trace.steps == [
        ("model", "Let me check.\n" + call),
        ("tool", "42"),
        ("model", "<answer>\\boxed{42}</answer>"),
    ]
    t = trace_to_trajectory(trace, tokenizer)
    masked = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
    trained = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 1]
    assert _decode(tokenizer, masked) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert _decode(tokenizer, trained) == "Let me check.\n" + call + "<answer>\\boxed{42}</answer><|im_end|>"
    assert "<tools>" in _decode(tokenizer, t.prompt_ids)  # the hermes env's system prompt lists the tools


def test_tora_sample_parses_into_retool(shared_data, tokenizer):
    path = shared_data / "tora_examples.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    traces = read_traces(path)
    assert len(traces) == len(rows) == 30
    for row, trace in zip(rows, traces, strict=True):
        assistant = row["messages"][1]["content"]
        outputs = assistant.count("```output")
        tools = [text for kind, text in trace.steps if kind == "tool"]
        assert trace.format == "retool" and len(tools) == outputs
        assert all(
            text.startswith("\n<interpreter>\n") and text.endswith("\n</interpreter>\n") for text in tools
        )
        assert "```output" not in "".join(text for _, text in trace.steps)
        model_text = "".join(text for kind, text in trace.steps if kind == "model")
        assert model_text.count("<code>") == model_text.count("</code>") == assistant.count("```python")
        assert trace.answer == row["gt"]
    first = traces[0]
    assert [k for k, _ in first.steps] == ["model", "tool", "model"]
    assert first.steps[1][1] == "\n<interpreter>\n2\n</interpreter>\n"  # the row's ```output block held "2"
    t = trace_to_trajectory(first, tokenizer)
    masked = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
    assert _decode(tokenizer, masked) == "\n<interpreter>\n2\n</interpreter>\n"


@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_procedural_traces_hold_real_sandbox_output(backend, tmp_path, request):
    if backend == "docker":
        request.getfixturevalue("docker_ready")
    problems = generate_problems("mixed", 4, seed=5)
    with make_sandbox(backend) as sandbox:
        traces = [procedural_trace(p, sandbox) for p in problems]
        broken = problems[0].__class__(
            problems[0].id,
            problems[0].problem,
            "-1",
            meta={"solution_code": problems[0].meta["solution_code"]},
        )
        assert procedural_trace(broken, sandbox) is None  # real output != gold: rejected
    assert all(t is not None for t in traces)
    for problem, trace in zip(problems, traces, strict=True):
        kinds = [k for k, _ in trace.steps]
        assert kinds == ["model", "tool", "model"]
        assert trace.steps[1][1] == f"\n<interpreter>\n{problem.answer}\n</interpreter>\n"
        assert trace.steps[2][1] == f"<answer>\\boxed{{{problem.answer}}}</answer>"
        assert problem.meta["solution_code"].strip() in trace.steps[0][1]
    path = write_retool_jsonl(traces, tmp_path / "traces.jsonl")
    again = read_traces(path)
    assert [(t.problem, t.steps) for t in again] == [(t.problem, t.steps) for t in traces]


@pytest.mark.slow  # 24 s: stare-agent sft processes, on 2 loaded cores
def test_bad_sft_input_gives_one_line(tmp_path):
    with pytest.raises(SFTDataError) as missing:
        read_traces(tmp_path / "nope.jsonl")
    assert str(missing.value) == (
        f"{tmp_path / 'nope.jsonl'}: no such file: check the path (relative paths start at "
        f"{Path.cwd()}) or pass a Hugging Face dataset name such as 'owner/name'"
    )
    with pytest.raises(
        SFTDataError, match=r"JoeYing/ReTool-SFT.*(pip install 'stare-agent\[hub\]'|check the name)"
    ) as hub:
        read_traces("JoeYing/ReTool-SFT")
    assert "\n" not in str(hub.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no messages"}\n')
    with pytest.raises(
        SFTDataError, match=r"bad.jsonl:1: no 'messages' list .*: give each row a 'messages' field"
    ):
        read_traces(bad)


def test_sft_steps_reduce_the_loss_on_a_fixed_batch(tokenizer):
    model, _ = tiny_model(tokenizer, seed=1)
    cfg = load_config(None, ["optim.lr=3e-3", "optim.grad_clip=1.0", "deepspeed.micro_batch_tokens=2048"])
    learner = Learner(model, tokenizer, cfg.deepspeed, cfg.optim, total_steps=10)
    rows = []
    for a, b in ((6, 7), (12, 13)):
        text = f"<code>\n```python\nprint({a} * {b})\n```\n</code>{OUTPUT.replace('42', str(a * b))}"
        text += f"<answer>\\boxed{{{a * b}}}</answer>"
        rows.append(
            {"messages": [{"role": "user", "content": f"{a} * {b}?"}, {"role": "assistant", "content": text}]}
        )
    batch = [trace_to_trajectory(retool_trace(row), tokenizer, system_prompt="") for row in rows]
    before = learner.sft_loss(batch)
    losses = [learner.sft_step(batch)["loss"] for _ in range(4)]
    after = learner.sft_loss(batch)
    assert losses[0] == pytest.approx(before, rel=1e-5)
    assert after < 0.9 * before
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))


def test_sft_run_writes_log_config_and_loadable_model(shared_data, tmp_path):
    model, tokenizer = tiny_model(seed=2)
    cfg = load_config(
        None,
        [
            f"sft.data={shared_data / 'tora_examples.jsonl'}",
            "sft.limit=4",
            "sft.batch_size=2",
            "sft.epochs=1",
            "sft.max_tokens=400",
            "deepspeed.micro_batch_tokens=2048",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    summary = sft(cfg, model=model, tokenizer=tokenizer)
    assert summary["traces"] == 4 and summary["trained_traces"] + summary["dropped_too_long"] == 4
    assert summary["steps"] == summary["trained_traces"] // 2 and summary["skipped_steps"] == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "sft_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines[:-1]] == list(range(1, summary["steps"] + 1))
    assert lines[-1]["summary"]["output_dir"] == str(tmp_path / "run" / "sft_model")
    assert any((tmp_path / "run" / "tensorboard" / "sft").iterdir())  # the one step logger, as RL's
    assert load_config(tmp_path / "run" / "sft_config.yaml") == cfg  # config.yaml is an RL run's
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "sft_model")
    assert torch.equal(reloaded.model.embed_tokens.weight, model.model.embed_tokens.weight.detach())


def test_procedural_sft_data_from_config():
    cfg = load_config(None, ["sft.data=procedural:modpow", "sft.procedural_rows=3", "sandbox.backend=local"])
    traces, counts = load_sft_traces(cfg)
    assert len(traces) == 3 and counts == {"rejected": 0}
    assert all(
        t.id.startswith("modpow-") and t.steps[1][1] == f"\n<interpreter>\n{t.answer}\n</interpreter>\n"
        for t in traces
    )


def test_model_too_large_for_memory_gives_one_line(tmp_path):
    from transformers import LlamaConfig

    from stare_agent.models import ModelTooLargeError

    LlamaConfig(
        hidden_size=16384, intermediate_size=65536, num_hidden_layers=400, vocab_size=32000
    ).save_pretrained(tmp_path / "huge")
    cfg = load_config(
        None, [f"model.name_or_path={tmp_path / 'huge'}", f"trainer.run_dir={tmp_path / 'run'}"]
    )
    with pytest.raises(ModelTooLargeError) as info:
        sft(cfg)
    assert "pick a smaller model, a smaller dtype, or a device with more memory" in str(info.value)
    assert "\n" not in str(info.value)


EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def unit_converter(monkeypatch):
    """examples/unit_converter.py's tool, family and env, imported as `module:id` imports them."""
    import gymnasium

    from stare_envs.tools import unregister_tool

    monkeypatch.chdir(EXAMPLES)
    yield "unit_converter:newcomer/UnitConvert-v0"
    unregister_tool("convert")
    gymnasium.registry.pop("newcomer/UnitConvert-v0", None)
    sys.modules.pop("unit_converter", None)  # the next test imports it, and registers, again


@pytest.mark.parametrize("fmt", ["hermes", "qwen3"])
def test_a_custom_tools_cold_start_traces_are_the_episodes_rl_would_play(unit_converter, fmt, tokenizer):
    """A family whose solution is a call of its env's tool: `stare-agent sft` plays it through the env
    and keeps the real tool output; tokenized, each trace is token for token (ids and mask) the episode
    the rollout runner makes when a policy writes the same turns (qwen3: the calling turn's EOS trained)."""
    from stare_agent.engines.scripted import ScriptedEngine
    from stare_envs.registry import make_tool_env
    from stare_envs.rollout import RolloutRunner

    config = load_config(
        None,
        [
            f"env.id={unit_converter}",
            f"env.format={fmt}",
            "sft.data=procedural:unit_conversion",
            "sft.procedural_rows=4",
        ],
    )
    traces, counts = load_sft_traces(config)
    assert len(traces) == 4 and counts == {"rejected": 0}
    for trace in traces:
        assert trace.format == fmt and [kind for kind, _ in trace.steps] == ["model", "tool", "model"]
        assert trace.tools[0]["function"]["name"] == "convert"
        sft_ids = trace_to_trajectory(trace, tokenizer)
        env = make_tool_env(config.env.id, format=fmt)
        turns = [text for kind, text in trace.steps if kind == "model"]
        runner = RolloutRunner(tokenizer, ScriptedEngine(tokenizer, [turns]), max_response_tokens=512)
        (played,) = runner.run([env], options=[{"problem": _problem_of(trace)}])
        assert played.reward == 1.0
        assert (played.prompt_ids, played.response_ids, played.loss_mask) == (
            sft_ids.prompt_ids,
            sft_ids.response_ids,
            sft_ids.loss_mask,
        )


def _problem_of(trace):
    from stare_envs.problems import Problem

    return Problem(id=trace.id, problem=trace.problem, answer=trace.answer)
