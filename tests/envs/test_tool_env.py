"""ToolEnv / CodeInterpreterEnv episodes with scripted policies (no LLM).

Logic is tested against in-process sandboxes behind a real ``SandboxPool`` (fast); the end-to-end
"done when" episodes run on real local kernels and, marked ``docker``, on Docker sandboxes.
"""

from __future__ import annotations

import json

import pytest

from stare_envs import CodeInterpreterEnv, EnvStateError, ToolEnv
from stare_envs.problems import Problem, load_problems
from stare_envs.tools import register_tool, unregister_tool
from stare_sandbox.errors import SandboxUnavailable
from tests.conftest import require, require_module

PROBLEM = Problem("p1", "What is 6 * 7?", "42")


@pytest.fixture
def make_env():
    """Builds envs and closes them after the test, also when it fails (no lease outlives a test)."""
    made = []

    def make(cls=CodeInterpreterEnv, *args, **kwargs):
        made.append(cls(*args, **kwargs))
        return made[-1]

    yield make
    for env in made:
        env.close()


def code(src: str) -> str:
    return f"Let me run it.\n<code>\n```python\n{src}\n```\n</code>"


def hermes_call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_retool_episode_keeps_state_across_turns_and_scores_the_answer(make_env, fake_pool, settled):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool)
    prompt, info = env.reset(seed=0)
    assert prompt == "What is 6 * 7?"
    assert info["problem_id"] == "p1" and info["format"] == "retool" and info["stop_strings"] == ["</code>"]
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    assert info["tools"][0]["function"]["name"] == "code_interpreter"

    obs, reward, terminated, truncated, info = env.step(code("x = 6 * 7"))
    assert (obs, reward, terminated, truncated) == (
        "\n<interpreter>\n(no output: use print() to show values)\n</interpreter>\n",
        0.0,
        False,
        False,
    )
    assert fake_pool.stats().leased == 1
    obs, reward, terminated, truncated, info = env.step(code("print(x)"))
    assert obs == "\n<interpreter>\n42\n</interpreter>\n" and reward == 0.0
    assert info["num_tool_calls"] == 2 and info["turn"] == 2 and info["num_parse_errors"] == 0
    (summary,) = info["tool_calls"]
    assert (
        summary["name"] == "code_interpreter" and summary["timed_out"] is False and summary["duration_s"] >= 0
    )

    obs, reward, terminated, truncated, info = env.step("The answer is <answer>\\boxed{42}</answer>")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert (info["answer"], info["correct"], info["gold"]) == ("42", True, "42")
    # One assistant message holds turns and interpreter output, as ReTool writes it.
    assert [m["role"] for m in env.messages] == ["system", "user", "assistant"]
    assert env.messages[2]["content"] == (
        code("x = 6 * 7")
        + "\n<interpreter>\n(no output: use print() to show values)\n</interpreter>\n"
        + code("print(x)")
        + "\n<interpreter>\n42\n</interpreter>\n"
        + "The answer is <answer>\\boxed{42}</answer>"
    )
    assert settled(fake_pool).leased == 0  # returned at episode end
    with pytest.raises(EnvStateError, match="call reset\\(\\) first"):
        env.step("more")
    env.close()


def test_next_episode_gets_a_fresh_sandbox(make_env, fake_pool, settled):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool)
    env.reset(seed=0)
    env.step(code("secret = 1"))
    env.reset()  # gives the leased sandbox back mid-episode
    assert settled(fake_pool).leased == 0
    obs, *_ = env.step(code("print(secret)"))
    assert "NameError" in obs
    env.close()
    assert settled(fake_pool).leased == 0


def test_a_turn_with_neither_a_tool_call_nor_an_answer_is_a_void_turn(make_env, fake_pool):
    """The tool health counts void turns: a model that stopped calling its tools ends episodes so."""
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool)
    env.reset(seed=0)
    assert env.step("I give up.")[4]["void_turn"] is True
    env.reset(seed=0)
    _, _, _, _, info = env.step("<code>\n```python\nprint(6 * 7)\n```\n</code>")
    assert "void_turn" not in info
    assert "void_turn" not in env.step("<answer>\\boxed{42}</answer>")[4]
    env.reset(seed=0)  # the turn that ended with the model's EOS, outside the turn protocol
    assert env.end_episode("Hmm.")[4]["void_turn"] is True
    env.reset(seed=0)
    assert "void_turn" not in env.end_episode("<code>\n```python\nprint(1)")[4]  # an unclosed code block


def test_wrong_answer_and_no_answer_score_zero_or_minus_one(make_env, fake_pool):
    from stare_envs.rewards import RewardConfig

    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool)
    env.reset(seed=0)
    assert env.step("<answer>\\boxed{41}</answer>")[1:4] == (0.0, True, False)
    env.reset()
    _, reward, terminated, _, info = env.step("I give up.")  # stops without a tool call
    assert (reward, terminated, info["answer"], info["correct"]) == (0.0, True, None, False)
    pm = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, reward=RewardConfig(mode="plus_minus"))
    pm.reset(seed=0)
    assert pm.step("\\boxed{41}")[1] == -1.0
    env.close()
    pm.close()


def test_max_turns_truncates_and_scores_as_no_answer(make_env, fake_pool, settled):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, max_turns=2)
    env.reset(seed=0)
    assert env.step(code("print(1)"))[2:4] == (False, False)
    obs, reward, terminated, truncated, info = env.step(code("print(2)"))
    assert (obs, reward, terminated, truncated, info["answer"]) == ("", 0.0, False, True, None)
    assert info["num_tool_calls"] == 2
    assert settled(fake_pool).leased == 0
    env.close()


def test_max_tool_calls_lets_the_model_answer_after_its_last_call(make_env, fake_pool):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, max_tool_calls=1, max_turns=5)
    env.reset(seed=0)
    env.step(code("print(42)"))
    assert env.step("<answer>\\boxed{42}</answer>")[1:4] == (1.0, True, False)
    env.reset()
    env.step(code("print(42)"))
    obs, reward, terminated, truncated, info = env.step(code("print(43)"))  # over the limit: not run
    assert (obs, terminated, truncated, info["num_tool_calls"]) == ("", False, True, 1)
    env.close()


def test_tool_output_is_truncated_with_a_visible_marker(make_env, fake_pool):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, max_output_chars=100)
    env.reset(seed=0)
    obs, *_, info = env.step(code("print('a' * 1000)"))
    body = obs.removeprefix("\n<interpreter>\n").removesuffix("\n</interpreter>\n")
    # 1000 characters (the final newline is dropped) cut to 100: 50 head + 50 tail, 900 cut.
    assert body == "a" * 50 + "\n... [900 characters truncated] ...\n" + "a" * 50
    assert info["tool_calls"][0]["truncated"] is True
    env.close()


def test_tool_output_is_truncated_to_tokens_with_a_real_tokenizer(make_env, fake_pool):
    models = require_module("train", "stare_agent.models", "pip install 'stare-agent[train]'")
    try:
        tokenizer = models.load_tokenizer()
    except models.ModelLoadError as exc:
        require("embedded", f"embedded tokenizer unavailable: {exc}")
        raise
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, tokenizer=tokenizer, max_output_tokens=64)
    env.reset(seed=0)
    obs, *_ = env.step(code("print(' '.join(str(i) for i in range(500)))"))
    body = obs.removeprefix("\n<interpreter>\n").removesuffix("\n</interpreter>\n")
    head, marker_tail = body.split("\n... [", 1)
    cut = int(marker_tail.split(" tokens truncated]")[0])
    full = " ".join(str(i) for i in range(500))
    assert cut == len(tokenizer.encode(full, add_special_tokens=False)) - 64
    assert full.startswith(head) and body.endswith("499")
    env.close()


def test_output_cut_short_by_a_timeout_shows_its_head_the_same_in_every_run(local_pool, settled):
    """A loop that prints until the timeout stops it prints a different amount each run: the env
    shows the head alone (no tail, no count of what was cut), then the timeout's line."""
    models = require_module("train", "stare_agent.models", "pip install 'stare-agent[train]'")
    tokenizer = models.load_tokenizer()
    env = CodeInterpreterEnv(  # the study's limits
        [PROBLEM],
        pool=local_pool,
        timeout_s=1.0,
        tokenizer=tokenizer,
        max_output_chars=1024,
        max_output_tokens=128,
    )
    loop = "i = 0\nwhile True:\n    print(f'line {i}', flush=True)\n    i += 1"
    try:
        shown = []
        for _ in range(2):
            env.reset(seed=0)
            obs, *_, info = env.step(code(loop))
            shown.append(obs)
            assert info["tool_calls"][0]["timed_out"] and info["tool_calls"][0]["truncated"]
    finally:
        env.close()
    assert shown[0] == shown[1]
    body = shown[0].removeprefix("\n<interpreter>\n").removesuffix("\n</interpreter>\n")
    head, marker, note = body.split("\n")[:-2], *body.split("\n")[-2:]
    assert head[:3] == ["line 0", "line 1", "line 2"] and "truncated" not in body
    assert len(tokenizer.encode("\n".join(head), add_special_tokens=False)) <= 128
    assert marker == "... [the output went on until the timeout]"
    assert note.startswith("TimeoutError: the code timed out after 1 s")
    assert settled(local_pool).leased == 0


def test_hermes_episode_uses_tool_messages(make_env, fake_pool, settled):
    env = make_env(CodeInterpreterEnv, [PROBLEM], pool=fake_pool, format="hermes")
    _, info = env.reset(seed=0)
    assert "<tools>" in info["messages"][0]["content"] and info["stop_strings"] == ["</tool_call>"]
    obs, reward, terminated, truncated, _ = env.step(hermes_call("code_interpreter", code="print(6 * 7)"))
    assert (obs, reward, terminated, truncated) == ("42", 0.0, False, False)
    env.step("<answer>\\boxed{42}</answer>")
    assert [m["role"] for m in env.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert env.messages[3]["content"] == "42"
    assert settled(fake_pool).leased == 0
    env.close()


def test_custom_function_tool_without_sandbox_holds_no_lease(make_env, monkeypatch):
    # no Docker daemon: an env whose tools run no code is made and played all the same
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match="sandbox backend auto: Docker is not usable here"):
        ToolEnv([PROBLEM])  # code_interpreter, backend auto

    @register_tool("reverse_demo", description="Reverse a string.", model_errors=(ValueError,))
    def reverse(text: str) -> str:
        if not text:
            raise ValueError("text is empty")
        return text[::-1]

    try:
        env = make_env(ToolEnv, [PROBLEM], tools=["reverse_demo"], system_prompt="")
        _, info = env.reset(seed=0)
        assert [m["role"] for m in info["messages"]] == ["user"]
        assert info["tools"][0]["function"]["parameters"]["required"] == ["text"]
        assert env.step(hermes_call("reverse_demo", text="abc"))[0] == "cba"
        assert (
            env.step(hermes_call("reverse_demo", text=""))[0]
            == "reverse_demo error: ValueError: text is empty"
        )
        assert env.step(hermes_call("reverse_demo", txt="abc"))[0] == (
            "reverse_demo: missing required argument(s) ['text']; expected ['text']."
        )
        assert env.pool is None  # no tool needs a sandbox: no pool was ever started
        env.close()
    finally:
        unregister_tool("reverse_demo")


def test_seeding_makes_problem_choice_reproducible(make_env, shared_data):
    aime = load_problems(shared_data / "aime2024.jsonl")
    env = make_env(CodeInterpreterEnv, aime, sandbox_backend="local")
    firsts = [env.reset(seed=7)[1]["problem_id"] for _ in range(2)]
    seq_a = [env.reset(seed=3)[1]["problem_id"]] + [env.reset()[1]["problem_id"] for _ in range(4)]
    seq_b = [env.reset(seed=3)[1]["problem_id"]] + [env.reset()[1]["problem_id"] for _ in range(4)]
    assert firsts[0] == firsts[1] and seq_a == seq_b and len(set(seq_a)) > 1
    assert env.reset(options={"problem_index": 0})[1]["problem_id"] == "aime2024-I-01"
    generated = make_env(CodeInterpreterEnv, "modpow", sandbox_backend="local")
    assert generated.reset(seed=1)[0] == generated.reset(seed=1)[0] != generated.reset(seed=2)[0]
    env.close()
    generated.close()


def test_invalid_configuration_fails_with_the_fix():
    with pytest.raises(ValueError, match="use format='hermes' for other tools"):
        ToolEnv([PROBLEM], tools=[], format="retool")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        CodeInterpreterEnv([PROBLEM], max_turns=0)
    with pytest.raises(ValueError, match="problems must be a non-empty list"):
        CodeInterpreterEnv([])
    with pytest.raises(TypeError, match="use ToolEnv\\(tools=...\\)"):
        CodeInterpreterEnv([PROBLEM], tools=["x"])


# ----------------------------------------------------------------------------- done when: AIME end to end


def _aime_episodes(pool, shared_data):
    """Scripted policies on a real AIME 2024 problem: right, wrong, and timing out."""
    problem = load_problems(shared_data / "aime2024.jsonl")[0]
    env = CodeInterpreterEnv([problem], pool=pool, timeout_s=1.0)
    try:
        env.reset(seed=0)
        obs, *_ = env.step(code(f"answer = {problem.answer}\nprint(answer)"))
        assert obs == f"\n<interpreter>\n{problem.answer}\n</interpreter>\n"
        right = env.step(f"<answer>\\boxed{{{problem.answer}}}</answer>")
        env.reset()
        env.step(code("print(123)"))
        wrong = env.step("<answer>\\boxed{123}</answer>")
        env.reset()
        timeout = env.step(code("import time\nprint('started', flush=True)\ntime.sleep(30)"))
    finally:
        env.close()
    return right, wrong, timeout


def _check_aime(right, wrong, timeout):
    assert right[1:4] == (1.0, True, False) and right[4]["correct"] is True
    assert wrong[1:4] == (0.0, True, False) and wrong[4]["correct"] is False
    obs, reward, terminated, truncated, info = timeout
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert "started" in obs and "TimeoutError: the code timed out after 1 s" in obs
    assert ("variables and imports are lost" in obs) or ("variables defined before this call are kept" in obs)
    assert info["tool_calls"][0]["timed_out"] is True and info["tool_calls"][0]["error_type"] == "Timeout"


def test_aime_scripted_policies_on_local_kernels(local_pool, shared_data, settled):
    _check_aime(*_aime_episodes(local_pool, shared_data))
    assert settled(local_pool).leased == 0


@pytest.mark.docker
def test_aime_scripted_policies_in_docker(docker_pool, shared_data, settled):
    _check_aime(*_aime_episodes(docker_pool, shared_data))
    assert settled(docker_pool).leased == 0


def test_infrastructure_failure_raises_and_replaces_the_sandbox(make_env, fake_pool, settled):
    @register_tool("flaky_demo", needs_sandbox=True)
    def flaky(sandbox, n: int) -> str:
        raise RuntimeError("the sandbox backend broke")  # not a model error: it must propagate

    try:
        env = make_env(ToolEnv, [PROBLEM], tools=["flaky_demo"], pool=fake_pool)
        env.reset(seed=0)
        replaced = fake_pool.stats().replaced
        with pytest.raises(RuntimeError, match="the sandbox backend broke"):
            env.step(hermes_call("flaky_demo", n=1))
        stats = settled(fake_pool)
        assert stats.leased == 0 and stats.replaced == replaced + 1
        with pytest.raises(EnvStateError):
            env.step("after the failure")
    finally:
        unregister_tool("flaky_demo")


def test_private_pool_is_started_on_demand_and_closed_with_the_env(make_env):
    env = make_env(CodeInterpreterEnv, [PROBLEM], sandbox_backend="local", render_mode="ansi")
    env.reset(seed=0)
    assert env.pool is None  # reset never starts or leases a sandbox
    obs, *_ = env.step(code("print(6 * 7)"))
    assert obs == "\n<interpreter>\n42\n</interpreter>\n" and env.pool.stats().leased == 1
    assert env.render().endswith("[assistant]\n" + code("print(6 * 7)") + obs)
    pool = env.pool
    env.close()
    assert pool.closed and env.pool is None


def test_an_answer_that_could_not_be_checked_replays_the_episode_never_scores_zero(make_env, fake_pool):
    """The checker could not give a verdict (closed, starved twice, no worker): the episode ends as an
    infrastructure failure, which the rollout runner plays again, not as a wrong answer."""
    from stare_envs.rewards import AnswerChecker
    from stare_envs.tool_env import EpisodeInfrastructureError

    broken = AnswerChecker(num_workers=1)
    broken.close()
    env = make_env(
        CodeInterpreterEnv, [Problem("p2", "Half of one?", r"\frac{1}{2}")], pool=fake_pool, checker=broken
    )
    env.reset(seed=0)
    with pytest.raises(EpisodeInfrastructureError, match="could not be checked .*played again"):
        env.step("So <answer>\\boxed{0.5}</answer>")
