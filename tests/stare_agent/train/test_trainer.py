"""The RL loop end to end on CPU: tiny random model, real DeepSpeed, real sandboxes, scripted rollouts
whose rewards are known, so that every group has reward variance."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from stare_agent.algorithms.stare import stare_weights
from stare_agent.config import load_config
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.checkpoints import latest_checkpoint
from stare_agent.train.trainer import Trainer
from stare_envs.problems import ProblemStream
from tests.stare_agent.train.scripted_training import overrides, scripted_policy

SCRIPT = Path(__file__).with_name("scripted_training.py")

PROBLEMS = [
    {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
    for a, b in [(2, 3), (10, 7), (40, 2), (6, 6), (9, 1), (8, 5)]
]


@pytest.fixture
def problem_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def make_config(tmp_path, problem_file, *extra):
    return load_config(None, overrides(str(tmp_path / "run"), str(problem_file), 2) + list(extra))


def test_a_callers_sandbox_pool_serves_the_episodes_and_stays_open(tmp_path, problem_file):
    """``Trainer(pool=...)``: the episodes lease from the caller's pool (the quickstart shares one with
    its evaluations) and the trainer leaves it open; without one it opens and closes its own."""
    from stare_sandbox import open_pool

    config = make_config(tmp_path, problem_file, "trainer.steps=1")
    model, tokenizer = tiny_model()
    pool = open_pool(2, "local", config.sandbox.limits)
    closed: list[bool] = []
    close = pool.close
    pool.close = lambda: closed.append(True) or close()  # type: ignore[method-assign]
    try:
        trainer = Trainer(
            config,
            model=model,
            tokenizer=tokenizer,
            engine=ScriptedEngine(tokenizer, scripted_policy()),
            pool=pool,
        )
        assert trainer.rollouts.pool() is pool
        assert trainer.fit()["steps"] == 1
        assert not closed
        with pool.lease() as sandbox:  # still serves
            assert sandbox.run("print(6 * 7)").stdout.strip() == "42"
    finally:
        close()


def test_problem_stream_is_reproducible_and_resumable(problem_file):
    a = ProblemStream(str(problem_file), seed=3)
    first = [p.id for p in a.take(9)]
    b = ProblemStream(str(problem_file), seed=3)
    b.position = 4
    assert [p.id for p in b.take(5)] == first[4:]
    assert sorted(first[:6]) == sorted(p["id"] for p in PROBLEMS)  # one epoch is a permutation
    fam = ProblemStream("multiplication", seed=0)
    assert [p.id for p in fam.take(3)] == [p.id for p in ProblemStream("multiplication", seed=0).take(3)]


def test_two_stare_steps_update_weights_log_and_checkpoint(tmp_path, problem_file):
    config = make_config(tmp_path, problem_file)
    model, tokenizer = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    summary = trainer.fit()
    assert summary["steps"] == 2
    after = trainer.learner.module.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the script is right on every other episode: each group of 2 has rewards {0, 1}
        assert r["reward_mean"] == pytest.approx(0.5)
        assert r["tool_calls_per_episode"] == pytest.approx(1.0)
        assert r["kept_groups"] == 2 and r["gate_on"] == 1 and r["skipped"] == 0
        # P = 0.1 of the T+ tokens get W: a positive, small fraction of all model tokens
        assert 0 < r["frac_reweighted"] < 0.2
    last = latest_checkpoint(tmp_path / "run")
    assert last is not None and last.name == "step-000002"
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data_position"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(last / "hf")
    assert torch.equal(reloaded.state_dict()["lm_head.weight"], after["lm_head.weight"])
    assert (tmp_path / "run" / "config.yaml").is_file()
    # what produced the run, beside its config: the backend the pool resolved (named: local), the engine
    [record] = json.loads((tmp_path / "run" / "run.json").read_text())["runs"]
    assert record["sandbox_backend"] == "local" and record["engine"]["kind"] == "ScriptedEngine"
    assert record["versions"]["stare-agent"] and record["started_utc"].endswith("+00:00")


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _run(*args: str) -> subprocess.Popen:
    # A fresh process world: this process's own world-of-one rendezvous must not leak into it.
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 52 s: a killed training run and its resume, on 2 loaded cores
def test_sigkill_then_resume_loses_and_repeats_no_step(tmp_path, problem_file):
    """Kill a run after its second checkpoint, resume it, and compare with an uninterrupted run."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    p = _run(str(whole), str(problem_file), "4")
    assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]

    p = _run(str(broken), str(problem_file), "4")
    deadline = time.monotonic() + 600
    while not (broken / "checkpoints" / "step-000002").is_dir():
        assert p.poll() is None, p.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "no second checkpoint within 10 minutes"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done = latest_checkpoint(broken)
    assert done is not None and done.name in ("step-000002", "step-000003")
    assert not (broken / "checkpoints" / "step-000004").exists()

    p = _run(str(broken), str(problem_file), "4", "--resume")
    assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]

    a, b = _records(whole), _records(broken)
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # none lost, none repeated
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "entropy", "stare/L_plus"):
            assert ra[key] == rb[key], (ra["step"], key)
    wa = AutoModelForCausalLM.from_pretrained(whole / "checkpoints" / "step-000004" / "hf").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(broken / "checkpoints" / "step-000004" / "hf").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow  # 33 s: two-rank and one-process training runs, on 2 loaded cores
def test_two_ranks_on_cpu_agree_with_each_other_and_with_one_process(tmp_path, problem_file):
    """torchrun, 2 ranks, gloo: groups split across ranks, global STARE scope and gate over both."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = [str(problem_file), "2", "--dump-weights", "algorithm.scope=global"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        str(SCRIPT),
        str(two),
        *args,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    p = _run(str(one), *args)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]

    w0 = torch.load(two / "weights-rank0.pt")
    w1 = torch.load(two / "weights-rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks diverged"
    a, b = _records(two), _records(one)
    for ra, rb in zip(a, b, strict=True):
        # same episodes, same kept groups, same global gate and L+ selection as one process
        for key in ("reward_mean", "kept_groups", "gate_on", "stare/L_plus", "stare/frac_T_plus"):
            assert ra[key] == rb[key], (ra["step"], key)
        assert ra["entropy"] == pytest.approx(rb["entropy"], rel=1e-5)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-7)


def test_rl_with_nucleus_sampling_warns_that_rollouts_are_off_policy(tmp_path, problem_file):
    model, tokenizer = tiny_model()
    engine = ScriptedEngine(tokenizer, scripted_policy())
    with pytest.warns(UserWarning, match=r"env.top_p=0.7: rollouts sample from the nucleus-truncated"):
        trainer = Trainer(
            make_config(tmp_path, problem_file, "env.top_p=0.7"),
            model=model,
            tokenizer=tokenizer,
            engine=engine,
        )
    trainer.close()


def test_open_loop_gate_reweights_above_target_and_greedy_eval_is_logged(tmp_path, problem_file):
    """algorithm.gate=always_on (the paper's open-loop ablation) reweights although the entropy of a
    random model (~10.8 nats) is far above H_tgt; data.eval_greedy adds a greedy evaluation."""
    extra = ["algorithm.H_tgt=0.3", f"data.eval={problem_file}", "data.eval_limit=2", "data.eval_samples=2"]
    extra += ["trainer.steps=1", "trainer.eval_every=1", "data.eval_greedy=true"]
    records = {}
    for gate in ("entropy", "always_on"):
        model, tokenizer = tiny_model()
        config = make_config(tmp_path / gate, problem_file, *extra, f"algorithm.gate={gate}")
        Trainer(
            config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
        ).fit()
        records[gate] = _records(tmp_path / gate / "run")[0]
    closed, open_loop = records["entropy"], records["always_on"]
    assert closed["entropy"] > 5 and closed["gate_on"] == 0 and closed["frac_reweighted"] == 0
    assert open_loop["gate_on"] == 1 and 0 < open_loop["frac_reweighted"] < 0.2
    # the research floor's mechanism metrics are not the product's: no hook, none computed
    assert not [
        k for k in open_loop if k.startswith("stare/") and ("dH" in k or "mass" in k or "raising" in k)
    ]
    # the scripted policy is right on every other episode: sampled avg@2 over 2 problems is 0.5;
    # greedy evaluation plays one episode per problem
    assert open_loop["eval/avg@2"] == pytest.approx(0.5)
    assert "eval_greedy/avg@1" in open_loop and "eval_greedy/avg@2" not in open_loop


def test_save_rollouts_writes_every_drawn_and_evaluated_episode(tmp_path, problem_file, capsys):
    extra = [f"data.eval={problem_file}", "data.eval_limit=2", "data.eval_samples=2", "trainer.steps=1"]
    extra += ["trainer.eval_every=1", "data.eval_greedy=true", "trainer.save_rollouts=true"]
    model, tokenizer = tiny_model()
    config = make_config(tmp_path, problem_file, *extra)
    Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    ).fit()
    said = capsys.readouterr().out  # the in-training evaluation says that it runs, and what it found
    assert "[eval] step 1: evaluating on data.eval ..." in said
    assert "[eval] step 1: avg@2 0.500, maj@2 " in said and "(2 problems, " in said
    out = tmp_path / "run" / "rollouts"
    assert sorted(p.name for p in out.iterdir()) == [
        "eval_00001.jsonl",
        "eval_greedy_00001.jsonl",
        "step_00001.jsonl",
    ]
    read = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines()]  # noqa: E731
    step = read("step_00001.jsonl")
    # one draw of 2 prompts x 2 episodes; the script is right on every other episode, so both groups
    # have reward variance and both train
    assert [(r["group"], r["trained"], r["reward"]) for r in step] == [
        (0, True, 1.0),
        (0, True, 0.0),
        (1, True, 1.0),
        (1, True, 0.0),
    ]
    first = step[0]
    assert first["problem_id"] in {p["id"] for p in PROBLEMS}
    assert "<code>" in first["response"] and "<interpreter>" in first["response"]  # model + tool
    assert tokenizer.decode(first["response_ids"]) == first["response"]
    assert first["info"]["num_tool_calls"] == 1
    assert len(read("eval_00001.jsonl")) == 4 and len(read("eval_greedy_00001.jsonl")) == 2


def test_stare_metrics_count_l_plus_tokens_more_surprising_than_the_batch_entropy():
    # 1 sequence, 6 model tokens (the last is padding); surprisals 0.1, 2.0, 0.5, 3.0, 1.0
    s = torch.tensor([[0.1, 2.0, 0.5, 3.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    A_tok = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0, 1.0]]) * mask
    # P = 0.75: L+ = the top ceil(0.75 * 4) = 3 of T+ by surprisal (3.0, 2.0, 0.5); the padded 9.0 never counts
    _, L_plus, _, metrics = stare_weights(A_tok, -s, mask, gate_on=True, variant="C2", P=0.75, Hbar=1.5)
    assert L_plus.tolist() == [[False, True, True, True, False, False]]
    # L+ inside the mask: surprisals 2.0, 0.5, 3.0; two of three exceed Hbar = 1.5
    assert metrics["stare/L_plus_s_above_Hbar"] == pytest.approx(2 / 3)
    assert (metrics["stare/T_plus"], metrics["stare/T_minus"], metrics["stare/L_plus"]) == (4.0, 1.0, 3.0)


@pytest.mark.parametrize("overlong_filter", [False, True])
def test_overlong_filter_masks_budget_cut_episodes_out_of_the_loss(tmp_path, problem_file, overlong_filter):
    """Odd episodes run past the 256-token budget: scored 0 (binary) either way, so each group of 2
    has reward variance; with DAPO's overlong filtering they are out of the loss."""
    episodes = iter(range(1000))

    def policy(prompt_text: str, turn: int) -> str:
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
        return f"<answer>\\boxed{{{a + b}}}</answer>" if next(episodes) % 2 == 0 else "and so on " * 200

    model, tokenizer = tiny_model()
    config = make_config(
        tmp_path, problem_file, f"algorithm.overlong_filter={overlong_filter}", "trainer.steps=1"
    )
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, policy))
    seen = []
    update = trainer.learner.update
    trainer.learner.update = lambda trajectories, *args, **kw: (
        seen.extend(trajectories) or update(trajectories, *args, **kw)
    )
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    cut = [t for t in seen if t.info["finish_reason"] == "budget"]
    assert len(cut) == len(seen) // 2 == 2 and all(t.reward == 0.0 for t in cut)
    assert all(sum(t.loss_mask) > 0 for t in seen if t not in cut)
    assert all((sum(t.loss_mask) == 0) == overlong_filter for t in cut)
    assert metrics["overlong_filtered"] == (2 if overlong_filter else 0)


def test_an_episode_lost_to_the_infrastructure_is_left_out_and_the_step_goes_on(
    tmp_path, problem_file, monkeypatch
):
    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    broken: list[tuple[ToolEnv, str]] = []
    step = ToolEnv.step

    def flaky_step(self, action):
        if not broken:
            broken.append((self, self.problem.id))
        if (self, self.problem.id) == broken[0]:  # every attempt of the first episode loses its sandbox
            self._end_episode(broken=True)
            raise EpisodeInfrastructureError("container removed")
        return step(self, action)

    monkeypatch.setattr(ToolEnv, "step", flaky_step)
    model, tokenizer = tiny_model()
    config = make_config(tmp_path, problem_file, "trainer.steps=1")
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["failed_episodes"] == 1
    assert metrics["skipped"] == 0 and metrics["kept_groups"] >= 1 and math.isfinite(metrics["loss"])


@pytest.mark.parametrize("mode", ["drop_group", "drop_episode"])
def test_a_group_with_a_failed_episode_is_dropped_whole_by_default(
    tmp_path, problem_file, monkeypatch, capsys, mode
):
    """An episode that still fails after its retries: ``drop_group`` leaves its whole group out (a
    group short of an episode biases GRPO's advantages), ``drop_episode`` trains the rest of it."""
    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    broken: list[tuple[ToolEnv, str]] = []
    step = ToolEnv.step

    def flaky_step(self, action):
        if not broken:
            broken.append((self, self.problem.id))
        if (self, self.problem.id) == broken[0]:  # every attempt of the first episode loses its sandbox
            self._end_episode(broken=True)
            raise EpisodeInfrastructureError("host lost")
        return step(self, action)

    monkeypatch.setattr(ToolEnv, "step", flaky_step)
    model, tokenizer = tiny_model()
    extra = ["trainer.steps=1", "data.dynamic_sampling=false", f"data.on_failed_episode={mode}"]
    config = make_config(tmp_path, problem_file, *extra)
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    assert metrics["failed_episodes"] == 1
    assert metrics["dropped_groups"] == (1 if mode == "drop_group" else 0)
    assert metrics["kept_groups"] == (1 if mode == "drop_group" else 2)
    out = capsys.readouterr().out
    assert (
        "1 episodes failed in the sandbox infrastructure" in out and f"data.on_failed_episode={mode}" in out
    )


def test_a_run_whose_tools_fail_in_the_infrastructure_stops_in_one_line(tmp_path, problem_file, monkeypatch):
    """Every tool call loses its sandbox: the steps log it (``tools/...``) and, once the window holds
    enough calls, the run stops naming the rate, the cause and the fix, instead of training on."""
    from stare_agent.metrics import ToolHealthError, read_metrics
    from stare_envs.tool_env import EpisodeInfrastructureError, ToolEnv

    def lost(self, action):
        self._end_episode(broken=True)
        raise EpisodeInfrastructureError("the sandbox's host was lost")

    monkeypatch.setattr(ToolEnv, "step", lost)
    model, tokenizer = tiny_model()
    config = make_config(tmp_path, problem_file, "trainer.steps=5")
    trainer = Trainer(
        config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
    )
    # 2 draws (dynamic sampling finds no group to keep) of 2 prompts x 2 samples, each episode lost on its
    # try and its 2 retries: 8 of 8 episodes lost (P(X >= 8 | 8, 0.05) = 0.05^8, far below 0.001)
    with pytest.raises(ToolHealthError) as stop:
        trainer.fit()
    message = str(stop.value)
    assert message.startswith(
        "step 1: 8 of 8 episodes over the last 1 steps (100.0%) were lost to the sandbox infrastructure "
        "(every attempt failed; 0 other failed attempts recovered on a retry)"
    )
    assert "trainer.max_infra_error_rate=0.05 beyond chance (last: the sandbox's host was lost" in message
    records = read_metrics(tmp_path / "run")
    assert [r["tools/infra_error_fraction"] for r in records] == [1.0]  # logged before the stop
    assert [
        (r["tools/infra_lost"], r["tools/infra_recovered"], r["tools/infra_failures"]) for r in records
    ] == [(8, 0, 24)]
    assert [r["failed_episodes"] for r in records] == [8] and "\n" not in message


def test_training_rollouts_do_not_depend_on_the_wave_size(tmp_path, problem_file):
    """Each training episode samples from its own stream, keyed by (group, sample): playing the
    groups in waves of 1 or of 4 sandboxes gives the same episodes, and the two samples of a group differ."""
    from stare_agent.engines import TransformersEngine

    problems = ProblemStream(str(problem_file), seed=0).take(2)
    played = {}
    for wave in (1, 4):
        model, tokenizer = tiny_model()
        config = make_config(
            tmp_path / str(wave), problem_file, f"sandbox.pool_size={wave}", "env.max_response_tokens=24"
        )
        trainer = Trainer(
            config, model=model, tokenizer=tokenizer, engine=TransformersEngine(model, tokenizer)
        )
        try:
            trainer.step = 1
            groups = trainer.rollouts.groups(problems, draw=1, step=1)
        finally:
            trainer.close()
        played[wave] = [[t.response_ids for t in g.trajectories] for g in groups]
    assert played[1] == played[4]
    assert all(a != b for a, b in played[4])


def test_grpo_ds_takes_no_log_prob_pass_and_logs_the_entropy_stare_sees(tmp_path, problem_file, monkeypatch):
    """GRPO-ds reads the gate's Hbar from its update's own forward pass: the same number the STARE
    step reads from its pre-update pass, on the same policy and batch, with one forward pass fewer."""
    from stare_agent.train.learner import Learner

    seen: dict[str, float] = {}
    for name in ("stare", "grpo_ds"):
        model, tokenizer = tiny_model()
        config = make_config(tmp_path / name, problem_file, f"algorithm.name={name}", "trainer.steps=1")
        trainer = Trainer(
            config, model=model, tokenizer=tokenizer, engine=ScriptedEngine(tokenizer, scripted_policy())
        )
        if name == "grpo_ds":

            def no_pass(self, trajectories):
                raise AssertionError("GRPO-ds took a pre-update log-prob pass")

            monkeypatch.setattr(Learner, "compute_logprobs_and_entropy", no_pass)
        try:
            trainer.step = 1
            metrics = trainer.train_step()
        finally:
            trainer.close()
        assert metrics["stare/entropy"] == metrics["entropy"] and metrics["gate_on"] == 1
        seen[name] = metrics["entropy"]
    assert seen["grpo_ds"] == pytest.approx(seen["stare"], rel=1e-5)


@pytest.mark.parametrize(
    "name,key",
    [
        ("grpo", None),
        ("entropy_bonus", None),
        ("kl_cov", "kl_cov/frac_selected"),
        ("clip_cov", "clip_cov/frac_candidates"),
        ("forking_tokens", "forking/frac_selected"),
    ],
)
def test_the_other_entropy_controls_train_a_step_beside_the_void_turn_filter(
    tmp_path, problem_file, name, key
):
    """Odd episodes answer with prose alone, a void turn (neither a tool call nor an answer), scored 0;
    with SimpleTIR's filter they are out of the loss; each method logs its selection."""
    episodes = iter(range(1000))

    def policy(prompt_text: str, turn: int) -> str:
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt_text)[-1])
        return f"<answer>\\boxed{{{a + b}}}</answer>" if next(episodes) % 2 == 0 else "Let me think."

    model, tokenizer = tiny_model()
    extra = [f"algorithm.name={name}", "algorithm.void_turn_filter=true", "trainer.steps=1"]
    trainer = Trainer(
        make_config(tmp_path, problem_file, *extra),
        model=model,
        tokenizer=tokenizer,
        engine=ScriptedEngine(tokenizer, policy),
    )
    seen = []
    update = trainer.learner.update
    trainer.learner.update = lambda trajectories, *args, **kw: (
        seen.extend(trajectories) or update(trajectories, *args, **kw)
    )
    try:
        trainer.step = 1
        metrics = trainer.train_step()
    finally:
        trainer.close()
    void = [t for t in seen if t.void_turn]
    assert len(void) == len(seen) // 2 > 0 and all(t.reward == 0.0 for t in void)
    assert all((sum(t.loss_mask) == 0) == t.void_turn for t in seen)
    assert metrics["skipped"] == 0 and metrics["tools/void_turn_fraction"] == pytest.approx(0.5)
    if key is not None:
        assert 0 <= metrics[key] <= 1 and "entropy_control/dH_first_order" not in metrics  # research's


@pytest.mark.slow  # 64 s: two-rank training runs, on 2 loaded cores
def test_a_global_forking_token_selection_over_two_ranks_is_the_one_process_selection(tmp_path, problem_file):
    """torchrun, 2 ranks, gloo, algorithm.name=forking_tokens with the global scope: one top 20 % over
    the whole batch on both ranks: the same count and entropy threshold as one process."""
    two, one = tmp_path / "two", tmp_path / "one"
    args = [
        str(problem_file),
        "2",
        "--dump-weights",
        "algorithm.scope=global",
        "algorithm.name=forking_tokens",
    ]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    cmd += [f"--master_port={_free_port()}", str(SCRIPT), str(two), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    p = _run(str(one), *args)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-2000:]
    w0, w1 = torch.load(two / "weights-rank0.pt"), torch.load(two / "weights-rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks diverged"
    for ra, rb in zip(_records(two), _records(one), strict=True):
        for key in ("reward_mean", "kept_groups", "forking/frac_selected", "forking/H_selected_min"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6), (ra["step"], key)
    # not the loss: the random tiny model's entropies all lie near log V, within float noise of each
    # other, so which of them make the top 20 % moves with each rank's padding width (the exact
    # two-rank selection on fixed inputs: tests/stare_agent/algorithms/test_entropy_control.py)


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_half_written(tmp_path, problem_file, monkeypatch):
    """A full disk while saving: the error propagates (the CLI makes it one line), the temporary
    directory is removed and no step-N directory appears; the last complete checkpoint stays."""
    import errno

    model, tokenizer = tiny_model()
    trainer = Trainer(
        make_config(tmp_path, problem_file), model=model, tokenizer=tokenizer,
        engine=ScriptedEngine(tokenizer, scripted_policy()),
    )  # fmt: skip
    try:
        trainer.step = 1
        first = trainer.save_checkpoint()

        def full(directory):
            (Path(directory) / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
            (Path(directory) / "model.safetensors").write_bytes(b"cut")
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))

        monkeypatch.setattr(trainer.learner, "export_hf", full)
        trainer.step = 2
        with pytest.raises(OSError, match="No space left on device"):
            trainer.save_checkpoint()
        assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [first.name]
    finally:
        trainer.close()
