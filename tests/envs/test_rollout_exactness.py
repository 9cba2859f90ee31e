"""Token exactness of rollouts: real chat templates (SmolLM2's, a Qwen2.5-style one with tools), both tool
formats (retool, hermes), the real CodeInterpreterEnv on local sandboxes, scripted model turns.

For every trajectory: decoding prompt + response reproduces the conversation the env recorded, rendered by
the chat template; the mask-1 tokens are exactly the tokens the engine returned, turn by turn, with their
log-probs; inserted tokens carry mask 0 and log-prob 0.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from stare_agent.engines.scripted import ScriptedEngine, ScriptError
from stare_envs.code_interpreter import CodeInterpreterEnv
from stare_envs.engine import ContinuousEngine, Engine, Generation, RolloutError, SamplingParams
from stare_envs.problems import Problem
from stare_envs.rollout import RolloutRunner, render_chat
from stare_envs.trajectory import Trajectory
from tests.helpers_tokenizers import TOKENIZERS

PROBLEMS = [
    Problem(id="mul", problem="What is 6 * 7?", answer="42"),
    Problem(id="sq", problem="What is 12 squared? (Use code.)", answer="144"),
    Problem(id="div", problem="Compute 1/0 and then 2 + 2.", answer="4"),
]


def _retool_code(code: str) -> str:
    return f"<code>\n```python\n{code}\n```\n</code>"


def _hermes_code(code: str) -> str:
    import json

    return (
        "<tool_call>\n"
        + json.dumps({"name": "code_interpreter", "arguments": {"code": code}})
        + "\n</tool_call>"
    )


def scripts_for(fmt: str) -> list[list[str]]:
    """Three episodes: one direct answer, one with two tool calls, one with an error then an answer.

    Text after a stop string is never returned by the engine (a real one would not generate it)."""
    call = _retool_code if fmt == "retool" else _hermes_code
    return [
        ["6 × 7 = 42, so the answer is <answer>\\boxed{42}</answer> ✓"],
        [
            "Let me compute it.\n" + call("x = 12\nprint(x * x)") + "\nTHIS IS NEVER GENERATED",
            "Check again with a loop: " + call("print(sum(12 for _ in range(12)))"),
            "Both agree: <answer>\\boxed{144}</answer>",
        ],
        [
            call("print(1/0)"),
            "Division by zero fails. " + call("print(2 + 2)"),
            "\n\nThe answer is \\boxed{4}.",
        ],
    ]


class RecordingEngine:
    """Keeps every (prompt, generation) pair an inner engine produced."""

    def __init__(self, inner: ScriptedEngine) -> None:
        self.inner = inner
        self.records: list[tuple[list[int], Generation]] = []
        self.batch_sizes: list[int] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        gens = self.inner.generate(prompts, params, stop)
        self.batch_sizes.append(len(prompts))
        self.records.extend(zip(prompts, gens, strict=True))
        return gens

    def update_weights(self, named_tensors: Any) -> None:
        self.inner.update_weights(named_tensors)


class ContinuousRecordingEngine(RecordingEngine):
    """A continuous engine: each submitted turn is replayed at once and handed back from another
    thread after ``delay(prompt)`` seconds; ``events`` logs ``("submit" | "done", prompt length, time)``."""

    def __init__(self, inner: ScriptedEngine, delay=lambda prompt: 0.01) -> None:
        super().__init__(inner)
        self.delay = delay
        self.events: list[tuple[str, int, float]] = []
        self._lock = threading.Lock()

    def submit(self, prompt: list[int], params: SamplingParams, stop: list[str]) -> Future[Generation]:
        assert params.seeds is None or len(params.seeds) == 1
        with self._lock:
            self.events.append(("submit", len(prompt), time.monotonic()))
            generation = self.generate([prompt], params, stop)[0]
        future: Future[Generation] = Future()

        def finish() -> None:
            with self._lock:
                self.events.append(("done", len(prompt), time.monotonic()))
            future.set_result(generation)

        threading.Timer(self.delay(prompt), finish).start()
        return future


@pytest.fixture(scope="module")
def pool():
    """Three local-kernel sandboxes shared by the module's tests (exactness needs no container)."""
    from stare_sandbox.pool import SandboxPool

    with SandboxPool(3, backend="local") as pool:
        yield pool


@pytest.fixture
def make_envs(pool):
    """``make_envs(fmt, tokenizer, n, **kwargs)``: CodeInterpreterEnvs on the shared pool, closed after the
    test (an episode cut by the budget keeps its sandbox until its env is reset or closed)."""
    made: list[CodeInterpreterEnv] = []

    def make(fmt: str, tokenizer, n: int = 3, problems=PROBLEMS, **kwargs) -> list[CodeInterpreterEnv]:
        envs = [
            CodeInterpreterEnv(problems, format=fmt, pool=pool, tokenizer=tokenizer, timeout_s=10, **kwargs)
            for _ in range(n)
        ]
        made.extend(envs)
        return envs

    yield make
    for env in made:
        env.close()


@pytest.fixture(params=["batch", "continuous"])
def play(make_envs, request):
    """``play(fmt, tokenizer, scripts, budget=4096, **env_kwargs)`` -> trajectories, envs, engine, runner,
    with a batch engine (lockstep turns) and with a continuous one (each turn submitted on its own)."""

    def run(fmt: str, tokenizer, scripts, budget: int = 4096, **env_kwargs):
        envs = make_envs(fmt, tokenizer, n=len(scripts), **env_kwargs)
        scripted = ScriptedEngine(tokenizer, scripts)
        engine = (
            RecordingEngine(scripted) if request.param == "batch" else ContinuousRecordingEngine(scripted)
        )
        runner = RolloutRunner(tokenizer, engine, max_response_tokens=budget, continuous=True)
        trajectories = runner.run(envs, options=[{"problem_index": i} for i in range(len(scripts))])
        return trajectories, envs, engine, runner

    return run


@pytest.fixture(params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _check_engine_tokens(t: Trajectory, engine: RecordingEngine) -> None:
    """Each turn span is exactly what the engine returned for the context before it."""
    by_prompt = {tuple(p): g for p, g in engine.records}
    for start, end in t.turn_spans:
        gen = by_prompt[tuple(t.prompt_ids + t.response_ids[:start])]
        assert t.response_ids[start:end] == gen.token_ids[: end - start]
        assert t.logprobs[start:end] == gen.logprobs[: end - start]
    for m, lp in zip(t.loss_mask, t.logprobs, strict=True):
        assert m == 1 or lp == 0.0


def _expected_text(tokenizer, env: CodeInterpreterEnv, tools) -> str:
    """The conversation as the env recorded it, rendered by the chat template; the last assistant
    message is open (generation prompt + content) and closed by the EOS the model sampled."""
    messages = env.messages
    assert messages[-1]["role"] == "assistant"
    head = render_chat(tokenizer, messages[:-1], tools=tools, add_generation_prompt=True)
    return head + messages[-1]["content"] + tokenizer.eos_token


@pytest.mark.parametrize("fmt", ["retool", "hermes"])
def test_decoded_trajectory_reproduces_the_conversation(fmt, tokenizer, play):
    trajectories, envs, engine, _ = play(fmt, tokenizer, scripts_for(fmt))

    # A batch engine: all live episodes advance together, one engine call per turn. A continuous one:
    # one call per episode turn.
    continuous = isinstance(engine, ContinuousEngine)
    assert engine.batch_sizes == ([1] * 7 if continuous else [3, 2, 2])
    for t, env in zip(trajectories, envs, strict=True):
        assert _decode(tokenizer, t.input_ids) == _expected_text(tokenizer, env, tools=None)
        _check_engine_tokens(t, engine)
        assert t.info["finish_reason"] == "terminated"
        assert t.response_ids[-1] == tokenizer.eos_token_id and t.loss_mask[-1] == 1
    assert [t.info["correct"] for t in trajectories] == [True, True, True]
    assert [t.reward for t in trajectories] == [1.0, 1.0, 1.0]
    assert [t.info["num_tool_calls"] for t in trajectories] == [0, 2, 2]
    assert [len(t.turn_spans) for t in trajectories] == [1, 3, 3]
    # The text after the stop string was never generated, and the tool output is in the sequence.
    assert "NEVER" not in _decode(tokenizer, trajectories[1].input_ids)
    assert "144" in _decode(
        tokenizer,
        [i for i, m in zip(trajectories[1].response_ids, trajectories[1].loss_mask, strict=True) if m == 0],
    )
    assert "ZeroDivisionError" in _decode(tokenizer, trajectories[2].response_ids)


@pytest.mark.parametrize("fmt", ["retool", "hermes"])
def test_stop_string_ending_inside_a_token_is_kept_as_sampled(fmt, tokenizer, play):
    # In SmolLM2's vocabulary ">." is one token: the token completing the stop string reaches past it.
    call = _retool_code if fmt == "retool" else _hermes_code
    stop = "</code>" if fmt == "retool" else "</tool_call>"
    scripts = [[call("print(7 * 6)") + ". And more text", "So \\boxed{42}"]]
    trajectories, envs, engine, _ = play(fmt, tokenizer, scripts)
    (t,) = trajectories
    start, end = t.turn_spans[0]
    first_turn = _decode(tokenizer, t.response_ids[start:end])
    assert first_turn.endswith(stop + ".")
    assert envs[0].messages[2]["content"].startswith(first_turn)
    assert _decode(tokenizer, t.input_ids) == _expected_text(tokenizer, envs[0], tools=None)
    _check_engine_tokens(t, engine)
    assert t.info["correct"] is True and t.info["num_tool_calls"] == 1


def test_hermes_turn_ended_by_eos_is_not_closed_twice(tokenizer, play):
    # An unclosed tool call ends with EOS (no stop string) yet runs; the glue must not repeat <|im_end|>.
    unclosed = _hermes_code("print(40 + 2)").removesuffix("\n</tool_call>")
    trajectories, envs, engine, _ = play("hermes", tokenizer, [[unclosed, "It printed 42: \\boxed{42}"]])
    (t,) = trajectories
    first_end = t.turn_spans[0][1]
    assert t.response_ids[first_end - 1] == tokenizer.eos_token_id
    assert t.response_ids[first_end] != tokenizer.eos_token_id
    assert _decode(tokenizer, t.input_ids) == _expected_text(tokenizer, envs[0], tools=None)
    _check_engine_tokens(t, engine)
    assert t.info["num_tool_calls"] == 1 and t.info["correct"] is True


def test_qwen_template_renders_tools_when_there_is_no_format_system_prompt(play):
    tokenizer = TOKENIZERS["qwen25"]()
    scripts = scripts_for("hermes")
    trajectories, envs, engine, _ = play("hermes", tokenizer, scripts, system_prompt="")
    for t, env in zip(trajectories, envs, strict=True):
        assert env.messages[0]["role"] == "user"
        text = _decode(tokenizer, t.input_ids)
        assert text == _expected_text(tokenizer, env, tools=env.tool_schemas())
        assert '"name": "code_interpreter"' in _decode(tokenizer, t.prompt_ids)  # from the template
        _check_engine_tokens(t, engine)
    assert [t.info["correct"] for t in trajectories] == [True, True, True]


def test_sampled_tokens_are_never_reencoded(make_envs):
    # An engine that samples a non-canonical tokenization (one token per character): the trajectory
    # keeps those tokens, although encoding the decoded text would give different ones.
    tokenizer = TOKENIZERS["smollm2"]()

    class CharEngine:
        def generate(self, prompts, params, stop):
            text = "The product is \\boxed{42}"
            ids = [tokenizer.convert_tokens_to_ids(c if c != " " else "Ġ") for c in text]
            ids.append(tokenizer.eos_token_id)
            return [Generation(ids, [-0.5] * len(ids), "eos") for _ in prompts]

        def update_weights(self, named_tensors):
            pass

    envs = make_envs("retool", tokenizer, n=2)
    t, _ = RolloutRunner(tokenizer, CharEngine(), max_response_tokens=64).run(
        envs, options=[{"problem_index": 0}] * 2
    )
    expected = CharEngine().generate([[0]], SamplingParams(), [])[0].token_ids
    assert t.response_ids == expected and t.loss_mask == [1] * len(expected)
    assert tokenizer.encode("The product is \\boxed{42}", add_special_tokens=False) != expected[:-1]
    assert t.info["correct"] is True


@pytest.mark.parametrize("fmt", ["retool", "hermes"])
def test_budget_cuts_tool_output_and_ends_the_episode(fmt, play):
    tokenizer = TOKENIZERS["qwen25"]() if fmt == "hermes" else TOKENIZERS["smollm2"]()
    call = _retool_code if fmt == "retool" else _hermes_code
    scripts = [[call("print('ab ' * 200)"), "\\boxed{1}"], ["\\boxed{42}"]]
    full, _, _, _ = play(fmt, tokenizer, scripts)
    first_turn = full[0].turn_spans[0][1]
    budget = first_turn + 30  # the tool output (~200 tokens) does not fit
    cut, envs, engine, runner = play(fmt, tokenizer, scripts, budget=budget)

    t = cut[0]
    assert len(t.response_ids) == budget
    assert t.loss_mask == [1] * first_turn + [0] * 30
    assert t.input_ids == full[0].input_ids[: len(t.input_ids)]  # a prefix of the uncut episode
    assert t.info["finish_reason"] == "budget" and t.info["truncated"] is True
    assert t.reward == 0.0 and len(t.turn_spans) == 1
    # The other episode is unaffected, and the engine was asked for at most the remaining budget.
    assert cut[1].input_ids == full[1].input_ids and cut[1].info["finish_reason"] == "terminated"
    assert runner.last_stats.engine_calls == (2 if isinstance(engine, ContinuousEngine) else 1)


def test_budget_cuts_a_model_turn_without_stepping_the_env(make_envs):
    tokenizer = TOKENIZERS["smollm2"]()
    long_turn = "Let me think step by step about this. " * 10 + "\\boxed{42}"
    short_turn = "\\boxed{42}"

    seen: list[int] = []

    class Limits(RecordingEngine):
        def generate(self, prompts, params, stop):
            seen.append(params.max_new_tokens)
            return super().generate(prompts, params, stop)

    envs = make_envs("retool", tokenizer, n=2)
    engine = Limits(ScriptedEngine(tokenizer, [[long_turn], [short_turn]]))
    runner = RolloutRunner(tokenizer, engine, max_response_tokens=20)
    cut, done = runner.run(envs, options=[{"problem_index": 0}] * 2)

    assert seen == [20]
    assert len(cut.response_ids) == 20 and cut.loss_mask == [1] * 20 and cut.turn_spans == [(0, 20)]
    assert cut.response_ids == tokenizer.encode(long_turn, add_special_tokens=False)[:20]
    assert cut.info["finish_reason"] == "budget" and cut.reward == 0.0
    assert [m["role"] for m in envs[0].messages] == ["system", "user"]  # the env never saw the cut turn
    assert done.info["finish_reason"] == "terminated" and done.reward == 1.0


def test_env_steps_of_a_turn_run_in_parallel(play):
    tokenizer = TOKENIZERS["smollm2"]()
    sleep = _retool_code("import time\ntime.sleep(1.0)\nprint(42)")
    trajectories, _, _, runner = play("retool", tokenizer, [[sleep, "\\boxed{42}"]] * 3)
    assert [t.info["num_tool_calls"] for t in trajectories] == [1, 1, 1]
    assert runner.last_stats.env_s < 2.5  # three 1-second calls, run side by side


def test_continuous_engine_turns_do_not_wait_for_the_slowest_episode(make_envs):
    """An episode whose tool call came back asks for its next turn while another episode's (slow)
    first turn is still being generated; a batch engine would wait for it."""
    tokenizer = TOKENIZERS["smollm2"]()
    envs = make_envs("retool", tokenizer, n=2)
    scripts = [[_retool_code("print(6 * 7)"), "\\boxed{42}"], ["Thinking long... \\boxed{144}"]]
    first_prompts: list[int] = []

    def delay(prompt: list[int]) -> float:  # the second episode's first turn takes 3 s
        first_prompts.append(len(prompt))
        return 3.0 if len(first_prompts) == 2 else 0.05

    engine = ContinuousRecordingEngine(ScriptedEngine(tokenizer, scripts), delay=delay)
    runner = RolloutRunner(tokenizer, engine, max_response_tokens=512, continuous=True)
    trajectories = runner.run(envs, options=[{"problem_index": 0}, {"problem_index": 1}])

    assert [t.info["correct"] for t in trajectories] == [True, True]
    assert [len(t.turn_spans) for t in trajectories] == [2, 1]
    submits = [at for kind, _, at in engine.events if kind == "submit"]
    slow_done = max(at for kind, _, at in engine.events if kind == "done")
    assert (
        len(submits) == 3 and submits[2] < slow_done - 1.0
    )  # episode 1's turn 2 went out while episode 2 ran
    assert runner.last_stats.engine_calls == 3 and runner.last_stats.turns == 3
    assert runner.last_stats.engine_s >= 2.5  # waiting on the slow turn counts as engine time


def test_continuous_engine_plays_lockstep_turns_unless_the_runner_is_asked(make_envs):
    tokenizer = TOKENIZERS["smollm2"]()
    envs = make_envs("retool", tokenizer, n=2)
    scripts = [[_retool_code("print(6 * 7)"), "\\boxed{42}"], ["\\boxed{144}"]]
    engine = ContinuousRecordingEngine(ScriptedEngine(tokenizer, scripts))
    runner = RolloutRunner(
        tokenizer, engine, max_response_tokens=512
    )  # continuous=False: reproducible batches
    runner.run(envs, options=[{"problem_index": 0}, {"problem_index": 1}])
    assert engine.events == [] and engine.batch_sizes == [2, 1]


def test_continuous_engine_gets_one_seed_per_turn_as_the_batch_path_derives_it(make_envs):
    from stare_envs.engine import stream_seed

    tokenizer = TOKENIZERS["smollm2"]()
    seen: list[tuple[int | None, tuple[int, ...] | None, int]] = []

    class Seeds(ContinuousRecordingEngine):
        def submit(self, prompt, params, stop):
            seen.append((params.seed, params.seeds, params.max_new_tokens))
            return super().submit(prompt, params, stop)

    envs = make_envs("retool", tokenizer, n=2, problems="multiplication")
    engine = Seeds(ScriptedEngine(tokenizer, [[_retool_code("print(1)"), "\\boxed{1}"], ["\\boxed{1}"]]))
    runner = RolloutRunner(
        tokenizer, engine, max_response_tokens=256, sampling=SamplingParams(seed=100), continuous=True
    )
    trajectories = runner.run(envs, seeds=7, episode_keys=["a", "b"])
    assert sorted(seen[:2]) == sorted(
        [(100, (stream_seed(100, "a", 0),), 256), (100, (stream_seed(100, "b", 0),), 256)]
    )
    # Turn 2 of episode "a": its own stream for turn 1, and its own remaining budget.
    assert seen[2] == (101, (stream_seed(100, "a", 1),), 256 - trajectories[0].turn_spans[1][0])


# ----------------------------------------------------------------------------- the scripted engine


def test_scripted_engine_stops_like_a_real_engine():
    tokenizer = TOKENIZERS["smollm2"]()
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    engine = ScriptedEngine(
        tokenizer, [["a <code>x</code>. tail", "final"], ["b<|im_end|>ignored"], ["long " * 50]]
    )
    params = SamplingParams(max_new_tokens=20)
    stop_gen, eos_gen, length_gen = engine.generate([[1], [2], [3]], params, ["</code>"])
    # the stop string is completed by the token ">." which reaches past it; the tail is never returned
    assert stop_gen.finish_reason == "stop"
    assert stop_gen.token_ids == enc("a <code>x</code>. tail")[: len(stop_gen.token_ids)]
    assert _decode(tokenizer, stop_gen.token_ids) == "a <code>x</code>."
    # an EOS written in the text ends the turn there
    assert eos_gen.finish_reason == "eos" and eos_gen.token_ids == enc("b") + [tokenizer.eos_token_id]
    # max_new_tokens cuts the turn
    assert length_gen.finish_reason == "length" and length_gen.token_ids == enc("long " * 50)[:20]
    # the next call continues each episode by context, whatever the order of the prompts
    (final,) = engine.generate([[1, *stop_gen.token_ids, 99]], params, ["</code>"])
    assert final.finish_reason == "eos" and final.token_ids == enc("final") + [tokenizer.eos_token_id]
    # log-probs are deterministic, one per token, in [-1, 0)
    again = ScriptedEngine(tokenizer, [["a <code>x</code>. tail"]]).generate([[1]], params, ["</code>"])[0]
    assert again.logprobs == stop_gen.logprobs and all(-1.0 <= lp < 0 for lp in stop_gen.logprobs)


def test_scripted_engine_callable_scripts_and_errors():
    tokenizer = TOKENIZERS["smollm2"]()
    seen = []

    def script(prompt_text: str, turn: int) -> str:
        seen.append((prompt_text, turn))
        return f"turn {turn}"

    engine = ScriptedEngine(tokenizer, script)
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    first, other = engine.generate([prompt, prompt], SamplingParams(), [])  # two episodes, same prompt
    engine.generate([prompt + first.token_ids], SamplingParams(), [])
    assert [turn for _, turn in seen] == [0, 0, 1]
    assert seen[2][0] == "hello" + "turn 0" + tokenizer.eos_token

    listed = ScriptedEngine(tokenizer, [["only turn"]])
    (gen,) = listed.generate([[5]], SamplingParams(), [])
    with pytest.raises(ScriptError, match="asked for turn 1 but its script has 1 turns"):
        listed.generate([[5, *gen.token_ids]], SamplingParams(), [])
    with pytest.raises(ScriptError, match="only 1 scripts were given"):
        listed.generate([[6]], SamplingParams(), [])
    listed.update_weights([("w", object())])
    assert listed.weight_version == 1


def test_runner_rejects_an_engine_that_breaks_the_protocol(make_envs):
    tokenizer = TOKENIZERS["smollm2"]()

    class Short:
        def generate(self, prompts, params, stop):
            return []

        def update_weights(self, named_tensors):
            pass

    envs = make_envs("retool", tokenizer, n=1)
    with pytest.raises(RolloutError, match="one Generation per prompt"):
        RolloutRunner(tokenizer, Short(), max_response_tokens=8).run(envs)
    with pytest.raises(RolloutError, match="one log-prob per sampled token"):
        Generation([1, 2], [-0.1], "stop")
    with pytest.raises(ValueError, match="pass one per env"):
        RolloutRunner(tokenizer, Short(), max_response_tokens=8).run(envs, seeds=[1, 2])
    assert isinstance(ScriptedEngine(tokenizer, []), Engine)


def test_runner_passes_seeds_and_per_turn_sampling_seeds(make_envs):
    tokenizer = TOKENIZERS["smollm2"]()
    seeds_seen = []

    class Seeds(RecordingEngine):
        def generate(self, prompts, params, stop):
            seeds_seen.append(params.seed)
            return super().generate(prompts, params, stop)

    envs = make_envs("retool", tokenizer, n=2, problems="multiplication")
    engine = Seeds(ScriptedEngine(tokenizer, [[_retool_code("print(1)"), "\\boxed{1}"], ["\\boxed{1}"]]))
    runner = RolloutRunner(tokenizer, engine, max_response_tokens=256, sampling=SamplingParams(seed=100))
    first = runner.run(envs, seeds=7)
    assert seeds_seen == [100, 101]
    # reset seeds 7 and 8 draw the same problems again
    engine = ScriptedEngine(tokenizer, [[_retool_code("print(1)"), "\\boxed{1}"], ["\\boxed{1}"]])
    again = RolloutRunner(tokenizer, engine, max_response_tokens=256).run(envs, seeds=[7, 8])
    assert [t.prompt_ids for t in first] == [t.prompt_ids for t in again]
    assert [t.info["problem_id"] for t in first] == [t.info["problem_id"] for t in again]
