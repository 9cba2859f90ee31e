"""Evaluation metrics against scripted episodes whose answers are known; expected numbers by hand."""

from __future__ import annotations

import functools
import json

import pytest

from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.evaluation import EvaluationError, evaluate, majority_correct, pass_at_k
from stare_envs.problems import Problem
from tests.helpers_tokenizers import smollm2_tokenizer

CODE_TURN = "I'll compute it.\n<code>\n```python\nprint(6 * 7)\n```\n</code>"


def test_pass_at_k_by_hand():
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n=5, c=1, k=3: 1 - C(4,3)/C(5,3) = 1 - 4/10
    assert pass_at_k(5, 1, 3) == pytest.approx(0.6)
    assert pass_at_k(3, 0, 3) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_majority_ties_go_to_first_seen_answer():
    assert majority_correct(["1", "2", "2", "1"], [True, False, False, True]) is True
    assert majority_correct([None, None], [False, False]) is False


@pytest.mark.slow  # 18 s, on 2 loaded cores
def test_scripted_evaluation_reproduces_hand_computed_metrics(tmp_path):
    tokenizer = smollm2_tokenizer()
    problems = [Problem("p1", "What is 6 times 7?", "42"), Problem("p2", "What is 3 + 4?", "7")]
    # Episodes run in job order: p1 samples 0..3, then p2 samples 0..3.
    scripts = [
        [CODE_TURN, "<answer>\\boxed{42}</answer>"],  # p1: tool call, correct
        ["<answer>\\boxed{42}</answer>"],  # p1: correct
        ["<answer>\\boxed{41}</answer>"],  # p1: wrong
        ["I do not know."],  # p1: no answer
        ["<answer>\\boxed{8}</answer>"],  # p2: wrong
        ["<answer>\\boxed{8}</answer>"],  # p2: wrong
        ["<answer>\\boxed{7}</answer>"],  # p2: correct
        ["<answer>\\boxed{3}</answer>"],  # p2: wrong
    ]
    report = evaluate(
        problems,
        engine=ScriptedEngine(tokenizer, scripts),
        tokenizer=tokenizer,
        samples=4,
        batch_size=8,
        env_kwargs={"format": "retool", "sandbox_backend": "local"},
        out_dir=tmp_path,
        progress=False,
    )
    m = report.metrics
    # c = 2 of 4 for p1, 1 of 4 for p2.
    assert m["avg@4"] == pytest.approx((2 / 4 + 1 / 4) / 2)  # 0.375
    assert m["pass@1"] == pytest.approx(0.375)
    # p1: 1 - C(2,2)/C(4,2) = 5/6; p2: 1 - C(3,2)/C(4,2) = 1/2
    assert m["pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["pass@4"] == pytest.approx(1.0)
    # p1 majority 42 (right); p2 majority 8 (wrong)
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["tool_calls_per_episode"] == pytest.approx(1 / 8)
    assert m["truncated_fraction"] == 0.0
    assert report.problems[0].answers == ["42", "42", "41", None]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["p1", "p2"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["maj@4"] == pytest.approx(0.5)
    # 95 % intervals over the 2 problems. avg@4's bootstrap draws are means of (0.5 | 0.25, 0.5 | 0.25):
    # 0.25 and 0.5 each have probability 1/4 > 2.5 %, so they are the ends; pass@2 likewise (1/2, 5/6).
    # maj@4 is one 0/1 outcome per problem: Wilson for 1 of 2, center 0.5, half
    # 1.96 / (1 + 3.8415 / 2) * sqrt(0.5 * 0.5 / 2 + 3.8415 / 16) = 0.40546.
    assert report.intervals["avg@4"] == pytest.approx((0.25, 0.5))
    assert report.intervals["pass@2"] == pytest.approx((0.5, 5 / 6))
    assert report.intervals["maj@4"] == pytest.approx((0.5 - 0.40546, 0.5 + 0.40546), abs=1e-4)
    assert summary["ci95"]["avg@4"] == pytest.approx([0.25, 0.5]) and summary["complete"] is True
    assert "avg@4                      0.3750  [0.2500, 0.5000]" in report.table()
    # what produced it: the problems' hash, env, sampling, sandbox, engine and package version
    settings = summary["settings"]
    assert settings["data"]["problems"] == 2 and len(settings["data"]["sha256"]) == 64
    assert settings["env"] == {"id": "stare/CodeInterpreter-v0", "kwargs": {"format": "retool"}}
    assert settings["sampling"]["temperature"] == 1.0 and settings["samples"] == 4
    assert settings["sandbox"]["backend"] == "local" and settings["sandbox"]["limits"]["timeout_s"] == 10.0
    assert settings["engine"]["kind"] == "ScriptedEngine" and settings["packages"]["stare-agent"]
    assert report.table().startswith("data: given problems, 2 problems (sha256 ")
    assert "sampling: 4 per problem, temperature 1.0, top-p 0.7, seed 0" in report.table()


def test_majority_votes_by_answer_equivalence():
    # "070" and "70" are one answer (2 votes) against "71"; \frac12 and 0.5 likewise against 0.25.
    assert majority_correct(["71", "070", "70"], [False, True, True]) is True
    assert majority_correct(["0.25", "\\frac12", "0.5"], [False, True, True]) is True
    assert (
        majority_correct(["0.25", "\\frac12", "0.5", "1/4", "0.25"], [False, True, True, False, False])
        is False
    )


def test_per_sample_results_do_not_depend_on_the_batch_size():
    """Samples 4..7 of a problem are new samples at batch size 4 (not a replay of 0..3), and every
    sample is the same token for token at batch sizes 1, 4 and 16 (one random stream per episode)."""
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model
    from stare_envs.engine import SamplingParams

    model, tokenizer = tiny_model(seed=0)
    problems = [Problem("p1", "What is 6 times 7?", "42"), Problem("p2", "What is 3 + 4?", "7")]

    def responses(batch_size: int) -> list[list[int]]:
        report = evaluate(
            problems,
            engine=TransformersEngine(model, tokenizer),
            tokenizer=tokenizer,
            samples=8,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, seed=3),
            max_response_tokens=12,
            batch_size=batch_size,
            env_kwargs={"format": "retool", "sandbox_backend": "local"},
            progress=False,
            keep_trajectories=True,
        )
        return [list(t.response_ids) for t in report.trajectories]

    by_batch = {b: responses(b) for b in (1, 4, 16)}
    for batch_size, episodes in by_batch.items():
        for problem in range(2):
            samples = {tuple(r) for r in episodes[problem * 8 : (problem + 1) * 8]}
            assert len(samples) == 8, f"two samples of a problem are identical at batch size {batch_size}"
    assert by_batch[1] == by_batch[4] == by_batch[16]


def test_an_episode_lost_to_the_infrastructure_is_left_out_and_counted(monkeypatch):
    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    tokenizer = smollm2_tokenizer()
    problems = [Problem("p1", "What is 6 times 7?", "42"), Problem("p2", "What is 3 + 4?", "7")]
    attempts = []
    step = ToolEnv.step

    def flaky_step(self, action):
        if self.problem.id == "p1" and len(attempts) < 3:  # p1's first episode: 1 try + 2 retries
            attempts.append(action)
            raise EpisodeInfrastructureError("container removed")
        return step(self, action)

    monkeypatch.setattr(ToolEnv, "step", flaky_step)
    answer = {"p1": "<answer>\\boxed{42}</answer>", "p2": "<answer>\\boxed{8}</answer>"}
    report = evaluate(
        problems,
        engine=ScriptedEngine(
            tokenizer, lambda prompt, turn: answer["p1" if "6 times 7" in prompt else "p2"]
        ),
        tokenizer=tokenizer,
        samples=4,
        batch_size=1,
        env_kwargs={"format": "hermes", "sandbox_backend": "local"},  # answers go through env.step
        progress=False,
    )
    m = report.metrics
    assert m["failed_episodes"] == 1 and len(attempts) == 3
    assert report.problems[0].correct == [True] * 3 and report.problems[1].correct == [False] * 4
    assert m["avg@4"] == pytest.approx(0.5)
    assert m["pass@4"] == pytest.approx(0.0)  # only p2 has 4 samples
    assert m["pass@2"] == pytest.approx(0.5) and m["maj@4"] == pytest.approx(0.5)
    # under the table, the tool health the trainer logs: 3 attempts lost (1 try + 2 retries)
    health = report.table().splitlines()[-1]
    assert health.startswith("tool health: 0 calls in 8 episodes")
    assert "3 attempts failed in the sandbox infrastructure (100.0% of attempts)" in health
    assert "0 recovered on a retry, 1 episodes lost (12.5%)" in health


def _tiny_evaluation(tmp_path, monkeypatch=None, stop_at_call=None, resume=False):
    """Three problems x 2 sampled samples of the tiny model, one problem per engine batch; with
    ``stop_at_call``, Ctrl-C arrives during that rollout call (problems before it have finished)."""
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model
    from stare_envs.engine import SamplingParams
    from stare_envs.rollout import RolloutRunner

    model, tokenizer = tiny_model(seed=0)
    calls = []
    if monkeypatch is not None:
        run = RolloutRunner.run

        def counted_run(self, *args, **kwargs):
            calls.append(kwargs["episode_keys"])
            if len(calls) == stop_at_call:
                raise KeyboardInterrupt
            return run(self, *args, **kwargs)

        monkeypatch.setattr(RolloutRunner, "run", counted_run)
    problems = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(1, 4)]
    report = evaluate(
        problems,
        engine=TransformersEngine(model, tokenizer),
        tokenizer=tokenizer,
        samples=2,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, seed=5),
        max_response_tokens=10,
        batch_size=2,
        env_kwargs={"format": "retool", "sandbox_backend": "local"},
        out_dir=tmp_path,
        resume=resume,
        progress=False,
    )
    return report, calls


def test_an_interrupted_evaluation_keeps_its_finished_problems_and_resumes_to_the_same_summary(
    tmp_path, monkeypatch, capsys
):
    straight, _ = _tiny_evaluation(tmp_path / "straight")
    out = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        _tiny_evaluation(out, monkeypatch, stop_at_call=2)  # during p2: p1 is finished
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["problem_id"] for r in rows] == ["p1"]
    partial = json.loads((out / "summary.json").read_text())
    assert partial["complete"] is False and partial["problems_evaluated"] == 1
    assert partial["response_tokens_mean"] == pytest.approx(sum(rows[0]["response_tokens"]) / 2)
    assert "1 of 3 problems finished" in capsys.readouterr().err
    monkeypatch.undo()
    resumed, calls = _tiny_evaluation(out, monkeypatch, resume=True)
    assert calls == [["p2/0", "p2/1"], ["p3/0", "p3/1"]]  # p1 is not played again
    assert resumed.metrics == straight.metrics and resumed.intervals == straight.intervals
    for name in ("results.jsonl", "summary.json"):
        assert (out / name).read_text() == (tmp_path / "straight" / name).read_text()


def test_resume_refuses_an_evaluation_with_other_settings(tmp_path):
    tokenizer = smollm2_tokenizer()
    problems = [Problem("p1", "What is 6 times 7?", "42")]

    def run(samples, resume):
        return evaluate(
            problems,
            engine=ScriptedEngine(tokenizer, lambda prompt, turn: "<answer>\\boxed{42}</answer>"),
            tokenizer=tokenizer,
            samples=samples,
            env_kwargs={"format": "retool", "sandbox_backend": "local"},
            out_dir=tmp_path,
            resume=resume,
            progress=False,
        )

    run(2, resume=False)
    assert run(2, resume=True).metrics["avg@2"] == 1.0  # nothing left to play
    with pytest.raises(EvaluationError, match=r"other settings \(samples differ"):
        run(1, resume=True)


def test_saved_episodes_hold_each_turn_with_its_tool_call_and_output(tmp_path):
    tokenizer = smollm2_tokenizer()
    evaluate(
        [Problem("p1", "What is 6 times 7?", "42")],
        engine=ScriptedEngine(tokenizer, [[CODE_TURN, "<answer>\\boxed{42}</answer>"]]),
        tokenizer=tokenizer,
        samples=1,
        env_kwargs={"format": "retool", "sandbox_backend": "local"},
        out_dir=tmp_path,
        save_episodes=True,
        progress=False,
    )
    (episode,) = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert (episode["problem_id"], episode["sample"], episode["correct"], episode["answer"]) == (
        "p1",
        0,
        True,
        "42",
    )
    assert episode["prompt"].endswith("What is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")
    first, last = episode["turns"]
    assert first["model"] == CODE_TURN
    assert first["tool_calls"] == [{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}]
    assert first["tool_output"] == "\n<interpreter>\n42\n</interpreter>\n"
    assert last == {"model": "<answer>\\boxed{42}</answer><|im_end|>", "tool_calls": []}


def test_resume_plays_again_a_problem_whose_line_a_kill_cut_short(tmp_path):
    tokenizer = smollm2_tokenizer()
    problems = [Problem("p1", "What is 6 times 7?", "42"), Problem("p2", "What is 3 + 4?", "7")]
    prompts = []

    def answer(prompt, turn):
        prompts.append(prompt)
        return "<answer>\\boxed{42}</answer>"

    def run(resume):
        return evaluate(
            problems,
            engine=ScriptedEngine(tokenizer, answer),
            tokenizer=tokenizer,
            samples=1,
            env_kwargs={"format": "retool", "sandbox_backend": "local"},
            out_dir=tmp_path,
            resume=resume,
            progress=False,
        )

    first = run(resume=False)
    results = tmp_path / "results.jsonl"
    whole = results.read_text()
    results.write_text(whole[: len(whole) - 20])  # SIGKILL while p2's line was being written
    prompts.clear()
    assert run(resume=True).metrics == first.metrics
    assert len(prompts) == 1 and "3 + 4" in prompts[0]  # only p2 was played again
    assert results.read_text() == whole


def test_evaluate_is_seeded_by_default_like_the_cli(tmp_path):
    """The README's ``evaluate(...)`` (no sampling given) gives the same tokens twice, seeded like
    ``stare-agent eval`` (trainer.seed, default 0), and the seed is recorded in the report."""
    from stare_agent.engines import TransformersEngine
    from stare_agent.models import tiny_model

    model, tokenizer = tiny_model(seed=0)
    problems = [Problem("p1", "What is 6 times 7?", "42")]

    def run(out):
        return evaluate(
            problems,
            engine=TransformersEngine(model, tokenizer),
            tokenizer=tokenizer,
            samples=2,
            max_response_tokens=12,
            env_kwargs={"format": "retool", "sandbox_backend": "local"},
            out_dir=out,
            progress=False,
            keep_trajectories=True,
        )

    first, second = run(tmp_path / "a"), run(tmp_path / "b")
    assert [t.response_ids for t in first.trajectories] == [t.response_ids for t in second.trajectories]
    assert first.settings["sampling"]["seed"] == 0
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["settings"]["sampling"]["seed"] == 0


def test_an_env_whose_tools_run_no_code_is_evaluated_without_docker(monkeypatch):
    """Neither evaluate nor evaluate_config opens a sandbox pool (nor asks for Docker) for an env whose
    tools need no sandbox; the settings say it has no sandbox backend."""
    from stare_agent.config import load_config
    from stare_agent.evaluation import evaluate_config
    from stare_envs.registry import register_tool_env
    from stare_envs.tools import register_tool, unregister_tool

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    register_tool("double_demo", lambda n: str(2 * int(n)), description="Double an integer.")
    register_tool_env("test/NoCode-v0", tools=["double_demo"], format="hermes")
    try:
        tokenizer = smollm2_tokenizer()
        problems = [Problem("p1", "What is 21 doubled?", "42")]
        call = '<tool_call>\n{"name": "double_demo", "arguments": {"n": 21}}\n</tool_call>'
        answers = [[call, "\\boxed{42}"]]
        report = evaluate(
            problems,
            engine=ScriptedEngine(tokenizer, answers),
            tokenizer=tokenizer,
            samples=1,
            env_id="test/NoCode-v0",
            progress=False,
        )
        assert report.metrics["avg@1"] == 1.0
        assert report.settings["sandbox"]["backend"] is None
        config = load_config(None, ["env.id=test/NoCode-v0", "data.eval_samples=1"])
        report = evaluate_config(
            config,
            engine=ScriptedEngine(tokenizer, answers),
            tokenizer=tokenizer,
            batch_size=1,
            problems=problems,
            progress=False,
        )
        assert report.metrics["avg@1"] == 1.0
    finally:
        import gymnasium

        gymnasium.registry.pop("test/NoCode-v0", None)
        unregister_tool("double_demo")


def test_progress_shows_turns_tokens_and_a_bound_on_the_time_left(capsys, tmp_path):
    """The bar moves with every turn, not only when an episode ends (0/120 for 18 minutes on a CPU);
    ``run.json`` records what produced the evaluation, apart from the summary a resume reproduces."""
    tokenizer = smollm2_tokenizer()
    report = evaluate(
        [Problem("p1", "What is 6 times 7?", "42"), Problem("p2", "What is 6 times 7?", "42")],
        engine=ScriptedEngine(tokenizer, [[CODE_TURN, "<answer>\\boxed{42}</answer>"]] * 4),
        tokenizer=tokenizer,
        samples=2,
        batch_size=2,
        env_kwargs={"format": "retool", "sandbox_backend": "local"},
        progress=True,
        out_dir=tmp_path,
    )
    err = capsys.readouterr().err
    assert "turns=" in err and "tokens=" in err and "tok/s=" in err and "at most left=" in err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("eval episodes: 100%") and "at most left" not in final, final  # nothing is left
    run = report.run  # what produced it, apart from the settings a resume must match
    assert set(run) >= {"command", "started_utc", "versions", "git_commit", "wall_s"} and run["wall_s"] > 0
    assert "run" not in report.settings
    (written,) = json.loads((tmp_path / "run.json").read_text())["runs"]
    assert written == {**json.loads(json.dumps(run)), "complete": True}
    assert "run" not in json.loads((tmp_path / "summary.json").read_text())


def test_evaluate_takes_a_family_a_file_or_the_envs_own_problems(monkeypatch, tmp_path):
    """One way for every source: a procedural family (held out, from the sampling seed), a file, or the
    problems the env was registered with; an env registered without problems is one line."""
    from stare_envs.problems import ProblemSourceError, eval_problems
    from stare_envs.registry import register_tool_env
    from stare_envs.tools import register_tool, unregister_tool

    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    register_tool("double_src", lambda n: str(2 * int(n)), description="Double an integer.")
    register_tool_env("test/OwnProblems-v0", tools=["double_src"], format="hermes", problems="multiplication")
    register_tool_env("test/NoProblems-v0", tools=["double_src"], format="hermes")
    tokenizer = smollm2_tokenizer()
    held_out = eval_problems("multiplication", seed=0, difficulty=1, limit=3)
    script = lambda text, turn: f"\\boxed{{{held_out[0].answer}}}"  # noqa: E731
    try:
        run = functools.partial(
            evaluate,
            engine=ScriptedEngine(tokenizer, script),
            tokenizer=tokenizer,
            samples=1,
            limit=3,
            progress=False,
        )
        for source in ("multiplication", None):
            report = run(source, env_id="test/OwnProblems-v0")
            assert [p.problem_id for p in report.problems] == [p.id for p in held_out]
            assert report.problems[0].correct == [True]  # the family's answers are checked
        path = tmp_path / "mine.jsonl"
        path.write_text(json.dumps({"problem": "What is 2 + 2?", "answer": "4"}) + "\n")
        assert len(run(path, env_id="test/OwnProblems-v0").problems) == 1
        with pytest.raises(
            ProblemSourceError, match=r"test/NoProblems-v0 was registered without problems: pass problems="
        ):
            run(None, env_id="test/NoProblems-v0")
    finally:
        import gymnasium

        for env_id in ("test/OwnProblems-v0", "test/NoProblems-v0"):
            gymnasium.registry.pop(env_id, None)
        unregister_tool("double_src")


def test_eval_resume_with_other_settings_is_refused_before_a_model_loads(tmp_path, monkeypatch, capsys):
    """The settings a run config fixes are what evaluate_config records (a resume with the same ones goes
    on); `stare-agent eval --resume` with another one is refused before its engine loads."""
    from stare_agent import cli
    from stare_agent.config import load_config
    from stare_agent.eval_files import check_resume, config_resume_settings
    from stare_agent.evaluation import evaluate_config
    from stare_agent.provenance import model_settings
    from stare_envs.problems import eval_problems

    overrides = [
        "data.eval=multiplication",
        "data.eval_limit=2",
        "data.eval_samples=1",
        "sandbox.backend=local",
    ]
    config = load_config(None, overrides)
    problems = eval_problems("multiplication", seed=0, difficulty=1, limit=2)
    model = model_settings(config.model.name_or_path)
    tokenizer = smollm2_tokenizer()
    evaluate_config(
        config,
        engine=ScriptedEngine(tokenizer, lambda prompt, turn: "<answer>\\boxed{1}</answer>"),
        tokenizer=tokenizer,
        batch_size=2,
        problems=problems,
        out_dir=tmp_path,
        settings={"model": model},
        progress=False,
    )
    check_resume(tmp_path, config_resume_settings(config, problems, model))  # the same: goes on
    other = load_config(None, [*overrides, "data.eval_temperature=0.5"])
    with pytest.raises(EvaluationError, match=r"other settings \(sampling differ"):
        check_resume(tmp_path, config_resume_settings(other, problems, model))

    def no_engine(args, config):
        raise AssertionError("the engine loaded before the settings were checked")

    monkeypatch.setattr(cli, "_eval_engine", no_engine)
    code = cli.main(["eval", "--resume", "--out", str(tmp_path), *overrides, "data.eval_temperature=0.5"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[sandbox]")]
    assert code == 2 and len(err) == 1 and "other settings (sampling differ" in err[0], err
