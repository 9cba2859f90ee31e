"""Asynchronous rollouts (trainer.max_staleness): policy versions per token, the staleness bound,
whole groups, partial rollouts across a weight update, turns interrupted by a weight sync
(trainer.interrupt_on_sync), closing the producer, and resume; on scripted rollouts whose log-probs
are a model's own (``ScriptedEngine(model=...)``): of the engine's synced copy where the versions
matter, of a frozen copy where an asynchronous run is compared with a synchronous one exactly."""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import Future

import pytest
import torch

from stare_agent.config import ConfigError
from stare_agent.engines import TransformersEngine
from stare_agent.engines.scripted import ScriptedEngine
from stare_agent.models import tiny_model
from stare_agent.train.async_rollouts import (
    RolloutProducer,
    RolloutProducerStillRunning,
    RolloutsStopped,
    VersionedEngine,
    versioned,
)
from stare_agent.train.rollout_engine import resolve_rollout_correction
from stare_agent.train.trainer import Trainer
from stare_envs.engine import Generation, SamplingParams
from stare_envs.tool_env import ToolEnv
from stare_envs.trajectory import Trajectory
from tests.stare_agent.train.scripted_training import scripted_policy
from tests.stare_agent.train.test_trainer import (
    LAUNCHER_VARS,
    PROBLEMS,
    SCRIPT,
    _free_port,
    _records,
    _run,
    make_config,
)


@pytest.fixture
def problem_file(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


# ---------------------------------------------------------------------- the engine wrapper


class _SlowEngine:
    """generate blocks until ``release`` is set; update_weights records its calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.updates = 0

    def generate(self, prompts, params, stop):
        self.entered.set()
        assert self.release.wait(10)
        return [Generation([1], [-0.5], "eos") for _ in prompts]

    def update_weights(self, named_tensors):
        list(named_tensors)
        self.updates += 1


def test_an_update_waits_for_the_engine_call_in_flight_and_labels_later_calls():
    inner = _SlowEngine()
    engine = VersionedEngine(inner, version=3)
    out: list[list[Generation]] = []
    call = threading.Thread(target=lambda: out.append(engine.generate([[0]], SamplingParams(), [])))
    call.start()
    assert inner.entered.wait(10)
    update = threading.Thread(target=lambda: engine.update_weights([("w", None)], version=4))
    update.start()
    time.sleep(0.2)
    assert inner.updates == 0 and update.is_alive()  # the turn in flight finishes under version 3
    inner.release.set()
    call.join(10)
    update.join(10)
    assert inner.updates == 1 and engine.version == 4
    assert [g.weight_version for g in out[0]] == [3]
    assert [g.weight_version for g in engine.generate([[0], [1]], SamplingParams(), [])] == [4, 4]
    assert engine.busy_s() >= 0.2


class _SubmitEngine(_SlowEngine):
    def submit(self, prompt, params, stop):
        future: Future[Generation] = Future()
        threading.Thread(target=lambda: future.set_result(self.generate([prompt], params, stop)[0])).start()
        return future


def test_a_continuous_engine_keeps_the_version_of_submission_across_an_update():
    inner = _SubmitEngine()
    engine = versioned(inner, 0)
    assert hasattr(engine, "submit") and not hasattr(versioned(_SlowEngine(), 0), "submit")
    future = engine.submit([0], SamplingParams(), [])
    assert inner.entered.wait(10)
    update = threading.Thread(target=lambda: engine.update_weights([], version=1))
    update.start()
    time.sleep(0.2)
    assert update.is_alive()  # waits for the submitted turn, not for its episode
    inner.release.set()
    assert future.result(10).weight_version == 0
    update.join(10)
    assert engine.version == 1 and engine.submit([0], SamplingParams(), []).result(10).weight_version == 1


def test_the_producer_starts_a_step_only_within_the_staleness_bound_and_passes_errors_on():
    engine = VersionedEngine(_SlowEngine(), version=0)
    started: dict[int, int] = {}

    def produce(step):
        started[step] = engine.version
        if step == 5:
            raise ValueError("broken step")
        return step

    producer = RolloutProducer(produce, engine, first=1, last=5, max_staleness=1, lock=threading.Lock())
    try:
        assert producer.take(1) == 1
        time.sleep(0.3)
        assert sorted(started) == [1, 2]  # step 3 needs version 1
        for step in (2, 3, 4):
            engine.set_version(step - 1)  # step - 1 trained
            assert producer.take(step) == step
        engine.set_version(4)
        with pytest.raises(ValueError, match="broken step"):
            producer.take(5)
    finally:
        producer.close()
    assert all(version >= step - 2 for step, version in started.items())


def test_auto_rollout_correction_is_token_tis_for_asynchronous_rollouts():
    _, tokenizer = tiny_model()
    scripted = ScriptedEngine(tokenizer, [["x"]])
    assert resolve_rollout_correction("auto", scripted) == "none"
    assert resolve_rollout_correction("auto", scripted, max_staleness=1) == "token_tis"
    assert resolve_rollout_correction("seq_mis", scripted, max_staleness=1) == "seq_mis"


def test_max_staleness_must_not_be_negative(tmp_path, problem_file):
    with pytest.raises(ConfigError, match="max_staleness=-1 must be >= 0"):
        make_config(tmp_path, problem_file, "trainer.max_staleness=-1")


def _sampled(generations):
    return [(g.token_ids, g.logprobs) for g in generations]


def test_synchronously_the_transformers_engine_samples_from_the_learners_own_module(tmp_path, problem_file):
    model, tokenizer = tiny_model()
    engine = TransformersEngine(model, tokenizer)
    trainer = Trainer(make_config(tmp_path, problem_file), model=model, tokenizer=tokenizer, engine=engine)
    assert trainer.engine is engine and engine.model is trainer.learner.module  # no copy
    assert trainer.learner.tokenizer is tokenizer


def test_asynchronously_the_transformers_engine_samples_from_a_synced_copy(tmp_path, problem_file):
    """The optimizer changes the learner's module in place while the producer samples: with
    max_staleness > 0 the in-process engine samples from a copy of the weights, which a sync (with
    trainer.interrupt_on_sync=false) loads once the engine call in flight has returned; that call
    reads the old weights to its last token and is labelled with the old version, the next one the
    new weights and version."""
    model, tokenizer = tiny_model()
    config = make_config(tmp_path, problem_file, "trainer.max_staleness=1", "trainer.interrupt_on_sync=false")
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=TransformersEngine(model, tokenizer))
    own = trainer.engine
    assert isinstance(own, TransformersEngine) and own.model is not trainer.learner.module
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seeds=[7])
    prompt = [[1, 2, 3]]
    old = _sampled(TransformersEngine(model, tokenizer).generate(prompt, params))
    assert _sampled(own.generate(prompt, params)) == old  # the copy is the policy, exactly
    with torch.no_grad():  # an update, in place, as the optimizer makes it
        noise = torch.Generator().manual_seed(0)
        for p in trainer.learner.module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=noise))
    new = _sampled(TransformersEngine(model, tokenizer).generate(prompt, params))
    assert new != old
    assert _sampled(own.generate(prompt, params)) == old  # the update did not reach the copy

    entered, release, forwards = threading.Event(), threading.Event(), itertools.count()

    def pause_at_the_second_token(module, args, output):
        if next(forwards) == 1:
            entered.set()
            assert release.wait(30)

    hook = own.model.register_forward_hook(pause_at_the_second_token)
    in_flight: list = []
    engine = trainer.rollout_engine.versioned
    call = threading.Thread(target=lambda: in_flight.extend(engine.generate(prompt, params, [])))
    call.start()
    assert entered.wait(30)
    trainer.step = 1
    sync = threading.Thread(target=trainer.rollout_engine.sync, args=(trainer.step,))
    sync.start()
    time.sleep(0.3)
    assert sync.is_alive()  # the sync waits for the call in flight ...
    copied = dict(own.model.named_parameters())
    assert any(not torch.equal(copied[n], p) for n, p in trainer.learner.module.named_parameters())
    release.set()
    call.join(30)
    sync.join(30)
    hook.remove()
    # ... that read the old weights to its last token
    assert _sampled(in_flight) == old and [g.weight_version for g in in_flight] == [0]
    assert all(torch.equal(copied[n], p) for n, p in trainer.learner.module.named_parameters())
    later = trainer.rollout_engine.versioned.generate(prompt, params, [])
    assert _sampled(later) == new and [g.weight_version for g in later] == [1]


def _logprobs_under(model, prompt, tokens, temperature=1.0):
    """``model``'s log-probs of ``tokens`` after ``prompt`` at ``temperature``."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float() / temperature
    rows = logits[len(prompt) - 1 : -1].log_softmax(-1)
    return rows.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


class _SlowForwards:
    """A forward hook that sleeps ``delay`` s per forward pass and says when ``after`` passes ran."""

    def __init__(self, model, delay, after):
        self.count, self.after, self.delay = itertools.count(), after, delay
        self.reached = threading.Event()
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if next(self.count) == self.after:
            self.reached.set()
        time.sleep(self.delay)


def test_a_sync_interrupts_the_turn_in_flight_and_each_token_keeps_the_weights_that_sampled_it(
    tmp_path, problem_file
):
    """With trainer.interrupt_on_sync a sync does not wait for the engine call in flight
    (here 200 tokens): it ends the turn at its next token, loads the weights, and the turn goes on
    from its tokens so far under them. The tokens before the switch are those the old weights sample
    and carry the old weights' log-probs; the tokens after it carry the new weights' log-probs (of
    no other version), and the generation says where the version changed."""
    model, tokenizer = tiny_model()
    trainer = Trainer(
        make_config(tmp_path, problem_file, "trainer.max_staleness=1", "trainer.interrupt_on_sync=true"),
        model=model,
        tokenizer=tokenizer,
        engine=TransformersEngine(model, tokenizer),
    )
    own, engine = trainer.engine, trainer.rollout_engine.versioned
    assert engine.interrupts
    old_model = copy.deepcopy(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=200, seeds=[7])
    prompt = [1, 2, 3]
    whole_old = own.generate([prompt], params)[0]  # what the old weights sample, uninterrupted
    assert len(whole_old.token_ids) == 200
    with torch.no_grad():  # an update, in place, as the optimizer makes it
        noise = torch.Generator().manual_seed(0)
        for p in trainer.learner.module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=noise))
    slow = _SlowForwards(own.model, delay=0.05, after=20)  # 200 tokens: 10 s
    out: list[Generation] = []
    call = threading.Thread(target=lambda: out.extend(engine.generate([prompt], params, [])))
    call.start()
    assert slow.reached.wait(60)
    t0 = time.monotonic()
    trainer.rollout_engine.sync(1)
    sync_s = time.monotonic() - t0
    call.join(60)
    slow.handle.remove()
    assert not call.is_alive()
    assert sync_s < 3.0  # not the ~9 s the rest of the turn takes
    (g,) = out
    assert len(g.token_ids) == 200 and g.finish_reason == "length"
    assert g.weight_version == 0 and len(g.version_switches) == 1
    k, version = g.version_switches[0]
    assert version == 1 and 20 <= k < 200
    assert g.token_ids[:k] == whole_old.token_ids[:k]  # the old weights' own tokens, to the switch
    saved = torch.tensor(g.logprobs)
    v0 = _logprobs_under(old_model, prompt, g.token_ids)
    v1 = _logprobs_under(trainer.learner.module, prompt, g.token_ids)
    assert torch.allclose(saved[:k], v0[:k], atol=1e-4) and not torch.allclose(saved[:k], v1[:k], atol=1e-2)
    assert torch.allclose(saved[k:], v1[k:], atol=1e-4) and not torch.allclose(saved[k:], v0[k:], atol=1e-2)
    assert engine.interrupted_calls == 1


class _Blocking:
    """An engine call that blocks in the model until ``release`` (the forward hook), on an engine
    without ``interrupt()`` unless ``interruptible``."""

    def __init__(self, interruptible):
        model, tokenizer = tiny_model()
        self.inner = TransformersEngine(model, tokenizer)
        self.release, self.entered = threading.Event(), threading.Event()
        self.passes = itertools.count()
        model.register_forward_hook(self._hook)
        if interruptible:
            self.interrupt = self.inner.interrupt

    def _hook(self, module, args, output):
        if next(self.passes) == 3:
            self.entered.set()
        if not self.release.is_set():
            time.sleep(0.05)

    def generate(self, prompts, params, stop):
        return self.inner.generate(prompts, params, stop)

    def update_weights(self, named_tensors):
        self.inner.update_weights(named_tensors)


def _producing(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=4000, seeds=[1])
    return RolloutProducer(
        lambda step: engine.generate([[1, 2, 3]], params, []),
        engine,
        first=1,
        last=2,
        max_staleness=1,
        lock=threading.Lock(),
    )


def test_close_returns_only_once_the_producer_thread_has_ended():
    """close ends the engine call in flight (4000 tokens: minutes) and returns once the thread has
    ended, so that the trainer closes the engine and the sandbox pool after it, not under it."""
    blocking = _Blocking(interruptible=True)
    engine = VersionedEngine(blocking, version=0)
    producer = _producing(engine)
    assert blocking.entered.wait(60)
    t0 = time.monotonic()
    producer.close(timeout=20)
    assert not producer._thread.is_alive() and time.monotonic() - t0 < 20
    with pytest.raises(RolloutsStopped):
        producer.take(1)
    blocking.release.set()
    # the engine takes calls again once the producer is gone (a new producer, an evaluation)
    short = SamplingParams(temperature=1.0, max_new_tokens=3, seeds=[1])
    assert len(engine.generate([[1, 2]], short, [])[0].token_ids) == 3


def test_close_past_its_deadline_says_so_and_does_not_return_as_if_stopped():
    """An engine call that cannot be interrupted outlives close's deadline: close raises (one line)
    instead of returning, so that the caller does not tear the engine down under the thread."""
    blocking = _Blocking(interruptible=False)
    engine = VersionedEngine(blocking, version=0)
    producer = _producing(engine)
    assert blocking.entered.wait(60)
    with pytest.raises(RolloutProducerStillRunning, match=r"still runs 1 s after close") as info:
        producer.close(timeout=1)
    assert "\n" not in str(info.value) and producer._thread.is_alive()
    blocking.release.set()
    producer._thread.join(120)
    assert not producer._thread.is_alive()
    assert len(producer.take(1)[0].token_ids) == 4000  # its call ran whole; no step after it started
    with pytest.raises(RuntimeError, match="stopped before step 2"):
        producer.take(2)


def test_a_generation_is_labelled_with_the_version_at_the_start_of_its_engine_call():
    """The label is read when the engine call starts: a version published while the call runs (a
    step that changed nothing) labels later calls, not the one in flight."""
    blocking = _Blocking(interruptible=True)
    engine = VersionedEngine(blocking, version=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seeds=[1])
    out: list[Generation] = []
    call = threading.Thread(target=lambda: out.extend(engine.generate([[1, 2, 3]], params, [])))
    call.start()
    assert blocking.entered.wait(60)
    engine.set_version(5)
    blocking.release.set()
    call.join(60)
    assert [(g.weight_version, g.version_switches) for g in out] == [(4, ())]
    assert engine.generate([[1, 2, 3]], params, [])[0].weight_version == 5


# ---------------------------------------------------------------------- scripted runs


def _scripted(tokenizer, cls=ScriptedEngine, **kwargs):
    """A scripted engine whose log-probs are those of its own copy of the policy (the tiny model's
    initial weights, synced at each update): importance weights near 1, not the e^-10 that stand-ins
    (-0.001 to -1 against the tiny model's -10) would give against the learner's log-probs."""
    return cls(tokenizer, scripted_policy(), model=tiny_model()[0], **kwargs)


class FrozenScriptedEngine(ScriptedEngine):
    """A scripted engine whose log-probs are the initial policy's whatever the updates: tokens and
    log-probs that do not depend on which version it holds when."""

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass
        self.weight_version += 1


class RecordingEngine(ScriptedEngine):
    """A scripted engine that records, for every turn it returns, its own weight version (the number
    of updates it received) by the context it continued."""

    def __init__(self, tokenizer, scripts, **kwargs):
        super().__init__(tokenizer, scripts, **kwargs)
        self.seen: dict[tuple[int, ...], set[int]] = defaultdict(set)

    def generate(self, prompts, params, stop):
        version = self.weight_version
        out = super().generate(prompts, params, stop)
        for prompt in prompts:
            self.seen[tuple(prompt)].add(version)
        return out


class SeedRecordingEngine(FrozenScriptedEngine):
    """A frozen scripted engine that records the sampling seeds of every call."""

    def __init__(self, tokenizer, scripts, **kwargs):
        super().__init__(tokenizer, scripts, **kwargs)
        self.seeds: list[tuple[int, ...] | None] = []

    def generate(self, prompts, params, stop):
        self.seeds.append(params.seeds)
        return super().generate(prompts, params, stop)


def _train(tmp_path, problem_file, name, *extra, steps=3, engine=None, resume=False):
    model, tokenizer = tiny_model()
    config = make_config(
        tmp_path / name, problem_file, f"trainer.steps={steps}", "trainer.save_rollouts=true", *extra
    )
    engine = engine or _scripted(tokenizer)
    trainer = Trainer(config, model=model, tokenizer=tokenizer, engine=engine, resume=resume)
    trainer.fit()
    return trainer, tmp_path / name / "run"


def _step_rollouts(run_dir, step):
    path = run_dir / "rollouts" / f"step_{step:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # scripted training runs, 20-60 s on 2 loaded cores
def test_an_update_mid_episode_splits_its_versions_and_every_token_keeps_its_samplers(
    tmp_path, problem_file, monkeypatch
):
    """Step 2's episodes are played while step 1 trains; their tool call waits for step 1's update,
    so their first turn is sampled by policy 0 and their second by policy 1 (a partial rollout)."""
    _, tokenizer = tiny_model()
    engine = _scripted(tokenizer, RecordingEngine)
    calls = itertools.count(1)
    step = ToolEnv.step

    def tool_call_waiting_for_an_update(self, action):
        if "print(" in action and 5 <= next(calls) <= 8:  # step 2's four code calls (step 1 made four)
            deadline = time.monotonic() + 300
            while engine.weight_version < 1:
                assert time.monotonic() < deadline, "no weight update while the episode was in its tool call"
                time.sleep(0.01)
        return step(self, action)

    monkeypatch.setattr(ToolEnv, "step", tool_call_waiting_for_an_update)
    # one wave of four sandboxes: all four episodes of a step are in flight together
    _, run_dir = _train(
        tmp_path, problem_file, "async", "trainer.max_staleness=1", "sandbox.pool_size=4", engine=engine
    )

    records = _records(run_dir)
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert records[1]["async/staleness_mean"] < 1.0  # turn 1 of step 2 is fresh
    problems_by_step = {}
    for s in (1, 2, 3):
        episodes = _step_rollouts(run_dir, s)
        for e in episodes:
            # every turn's label is the version of the engine call that sampled it
            for (start, _), v in zip(e["turn_spans"], e["turn_versions"], strict=True):
                assert engine.seen[tuple(e["prompt_ids"] + e["response_ids"][:start])] == {v}
            assert max(s - 1 - v for v in e["turn_versions"]) <= 1  # the bound
            if s == 2:
                assert e["turn_versions"] == [0, 1]  # the update landed between its two turns
        # groups whole: each group's two episodes in one step, of one problem
        by_group = defaultdict(list)
        for e in episodes:
            by_group[e["group"]].append(e["problem_id"])
        assert all(len(ids) == 2 and len(set(ids)) == 1 for ids in by_group.values())
        problems_by_step[s] = {ids[0] for ids in by_group.values()}
    assert len(set().union(*problems_by_step.values())) == 6  # no group split over two steps


class InterruptedOnce(ScriptedEngine):
    """A scripted engine (log-probs of its synced copy of the policy) whose third generate call, step
    2's first turns, runs until a weight sync interrupts it, having decoded 5 tokens of each turn."""

    def _decode_time(self, longest, interrupted):
        if len(self.calls) == 3:
            assert interrupted.wait(300), "no weight sync during step 2's first turns"
            return 5
        return None


@pytest.mark.slow  # a scripted training run, 20-60 s on 2 loaded cores
def test_saved_logprobs_are_those_of_the_version_each_token_is_labelled_with(tmp_path, problem_file):
    """An engine whose log-probs depend on the weights: every saved model token's log-prob is that of
    the policy version its label names (version v: the checkpoint of step v, 0 the initial policy),
    and not that of another version, also across a turn that step 1's sync interrupted after 5
    tokens (resumed under version 1: a version switch inside the turn, per-token staleness)."""
    from transformers import AutoModelForCausalLM

    _, tokenizer = tiny_model()
    engine = _scripted(tokenizer, InterruptedOnce)
    _, run_dir = _train(
        tmp_path,
        problem_file,
        "async",
        "trainer.max_staleness=1",
        "trainer.interrupt_on_sync=true",
        "sandbox.pool_size=4",
        "optim.lr=0.05",
        engine=engine,
    )
    ckpt = run_dir / "checkpoints"
    policies = {0: tiny_model()[0]} | {
        v: AutoModelForCausalLM.from_pretrained(ckpt / f"step-{v:06d}" / "hf") for v in (1, 2)
    }
    switched = 0
    for s in (1, 2, 3):
        for e in _step_rollouts(run_dir, s):
            t = Trajectory.from_dict(e)
            switched += bool(t.version_switches)
            versions = t.token_versions()
            P = t.prompt_ids
            under = {v: _logprobs_under(m, P, t.response_ids) for v, m in policies.items()}
            for j, (m, v) in enumerate(zip(t.loss_mask, versions, strict=True)):
                if not m:
                    continue
                assert v is not None and max(0, s - 2) <= v <= s - 1
                assert t.logprobs[j] == pytest.approx(float(under[v][j]), abs=1e-4), (s, j, v)
            sampled = [j for j, m in enumerate(t.loss_mask) if m]
            for v in under:  # no other version gives the saved log-probs
                own = [j for j in sampled if versions[j] == v]
                others = [j for j in sampled if versions[j] != v]
                if others:
                    gap = max(abs(t.logprobs[j] - float(under[v][j])) for j in others)
                    assert gap > 1e-3, (s, v)
                assert own or v not in versions
    assert switched == 4  # step 2's four episodes, each cut in its first turn
    step2 = [Trajectory.from_dict(e) for e in _step_rollouts(run_dir, 2)]
    assert all(t.version_switches and t.turn_versions[0] == 0 for t in step2)
    assert all(t.version_switches[0][0] == t.turn_spans[0][0] + 5 for t in step2)
    records = _records(run_dir)
    assert 0.0 < records[1]["async/staleness_mean"] < 1.0  # per token: 5 tokens of each turn at version 0


@pytest.mark.slow  # scripted training runs, 20-60 s on 2 loaded cores
def test_synchronous_steps_sample_every_token_from_the_previous_update(tmp_path, problem_file):
    _, run_dir = _train(tmp_path, problem_file, "sync", steps=2)
    assert [r["async/staleness_max"] for r in _records(run_dir)] == [0.0, 0.0]
    for s in (1, 2):
        assert all(e["turn_versions"] == [s - 1, s - 1] for e in _step_rollouts(run_dir, s))


COMPARED = ("reward_mean", "loss", "grad_norm", "entropy", "stare/L_plus", "kept_groups")


def _same_run(a, b):
    ra, rb = _records(a), _records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        for key in COMPARED:
            assert x[key] == y[key], (x["step"], key)


@pytest.mark.slow  # scripted training runs, 20-60 s on 2 loaded cores
@pytest.mark.parametrize("draw", [[], ["data.prompts_per_draw=3"]], ids=["draw-per-step", "draw-of-3"])
def test_asynchronous_rollouts_train_like_synchronous_ones_when_the_sampler_ignores_the_weights(
    tmp_path, problem_file, draw
):
    """Scripted tokens and log-probs (the initial policy's) do not depend on the weights: with the same
    correction, a run one step stale trains bit-identically to the synchronous one (same groups,
    problems, seeds), also when a step draws more prompts than it trains (data.prompts_per_draw)."""
    fixed = "algorithm.rollout_correction.mode=token_tis"
    _, tokenizer = tiny_model()
    engines = [_scripted(tokenizer, SeedRecordingEngine) for _ in range(2)]
    sync, _ = _train(tmp_path, problem_file, "sync", fixed, *draw, steps=3, engine=engines[0])
    stale, run_dir = _train(
        tmp_path, problem_file, "async", fixed, "trainer.max_staleness=1", *draw, steps=3, engine=engines[1]
    )
    groups = [{(e["group"], e["trained"]) for e in _step_rollouts(run_dir, s)} for s in (1, 2, 3)]
    assert all(g == {(0, True), (1, True)} | ({(2, False)} if draw else set()) for g in groups)
    _same_run(tmp_path / "sync" / "run", tmp_path / "async" / "run")
    for r in _records(tmp_path / "async" / "run"):  # importance weights that mean something
        assert 0.5 < r["rollout_correction/weight_mean"] <= 2.0, r["step"]
    assert engines[0].seeds == engines[1].seeds  # each step's sampling streams, whichever thread plays it
    a, b = sync.learner.module.state_dict(), stale.learner.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # scripted training runs, 20-60 s on 2 loaded cores
def test_a_resumed_asynchronous_run_plays_the_in_flight_steps_again(tmp_path, problem_file, monkeypatch):
    """A run that dies in step 3 (step 3's rollouts and part of step 4's played) resumes from its
    step-2 checkpoint and ends as the uninterrupted run does: the checkpoint's data position is the
    last trained step's, so the lost rollouts are played again with the same problems and seeds (with
    log-probs that do not depend on which version the engine holds when: a frozen scripted engine)."""
    async_ = "trainer.max_staleness=1"
    tokenizer = tiny_model()[1]

    def frozen():
        return _scripted(tokenizer, FrozenScriptedEngine)

    _train(tmp_path, problem_file, "whole", async_, steps=4, engine=frozen())

    learn = Trainer.learn

    def dies_in_step_3(self, drawn, kept):
        if self.step == 3:
            time.sleep(0.5)  # the producer plays on meanwhile
            raise KeyboardInterrupt("killed")
        return learn(self, drawn, kept)

    monkeypatch.setattr(Trainer, "learn", dies_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path, problem_file, "broken", async_, steps=4, engine=frozen())
    run = tmp_path / "broken" / "run"
    state = json.loads((run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["data_position"] == 4  # not the producer's position
    monkeypatch.setattr(Trainer, "learn", learn)
    _train(tmp_path, problem_file, "broken", async_, steps=4, engine=frozen(), resume=True)
    _same_run(tmp_path / "whole" / "run", run)


@pytest.mark.slow  # two-rank and one-process asynchronous runs
def test_two_ranks_with_asynchronous_rollouts_agree_with_one_process(tmp_path, problem_file):
    two, one = tmp_path / "two", tmp_path / "one"
    args = [str(problem_file), "3", "--dump-weights", "trainer.max_staleness=1"]
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
    w0, w1 = torch.load(two / "weights-rank0.pt"), torch.load(two / "weights-rank1.pt")
    assert all(torch.equal(w0[k], w1[k]) for k in w0), "ranks diverged"
    for ra, rb in zip(_records(two), _records(one), strict=True):
        for key in ("reward_mean", "kept_groups", "gate_on"):
            assert ra[key] == rb[key], (ra["step"], key)
        assert ra["async/staleness_max"] <= 1
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.slow  # a scripted training run, 20-60 s on 2 loaded cores
def test_the_producer_and_the_learner_never_use_one_tokenizer_at_once(tmp_path, problem_file, monkeypatch):
    """A fast tokenizer raises "Already borrowed" when one thread changes its Rust state (truncation,
    padding) while another thread is inside it. In an asynchronous run the learner's thread (the
    main one: logged texts, saved rollouts, checkpoints) must never be inside a tokenizer that the
    producer's threads are inside: every call is checked, each held a little so that calls that
    would overlap do. (The rollout side's own threads, the runner's env workers, share one tokenizer
    in the synchronous trainer too, for calls that only read it.)"""
    tokenizer_class = type(tiny_model()[1])
    main = threading.get_ident()
    guard = threading.Lock()
    inside: dict[int, defaultdict[int, int]] = defaultdict(lambda: defaultdict(int))  # id -> thread -> depth
    clashes: list[str] = []

    def checked(name):
        method = getattr(tokenizer_class, name)

        def call(self, *args, **kwargs):
            me = threading.get_ident()
            with guard:
                others = {thread for thread, depth in inside[id(self)].items() if depth and thread != me}
                if others and main in others | {me}:
                    clashes.append(name)
                inside[id(self)][me] += 1
            try:
                time.sleep(0.002)
                return method(self, *args, **kwargs)
            finally:
                with guard:
                    inside[id(self)][me] -= 1

        return call

    for name in ("encode", "decode", "apply_chat_template", "save_pretrained"):
        monkeypatch.setattr(tokenizer_class, name, checked(name))
    _train(tmp_path, problem_file, "async", "trainer.max_staleness=1", "sandbox.pool_size=4")
    assert not clashes
    assert len(inside) == 2  # the producer's tokenizer and the learner's copy


def _entropy_on(model, episodes) -> float:
    """Token mean, over the episodes' model tokens, of the full-vocabulary entropy of ``model``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in episodes:
            ids = torch.tensor([e["prompt_ids"] + e["response_ids"]])
            logits = model(ids).logits[0].float()
            H = -(logits.log_softmax(-1) * logits.softmax(-1)).sum(-1)  # H[j] scores token j + 1
            P = len(e["prompt_ids"])
            for i, m in enumerate(e["loss_mask"]):
                if m:
                    total, count = total + float(H[P + i - 1]), count + 1
    return total / count


@pytest.mark.slow  # scripted training runs, 20-60 s on 2 loaded cores
def test_on_stale_rollouts_the_gate_reads_the_proximal_policy_on_the_kept_batch(tmp_path, problem_file):
    """Step 3 of a one-step-stale run trains on tokens sampled by policies 1 and 2; its gate's Hbar is
    the entropy of policy 2 (the learner before update 3, the proximal policy) on step 3's kept
    episodes, not that of policy 1."""
    from transformers import AutoModelForCausalLM

    _, run_dir = _train(tmp_path, problem_file, "async", "trainer.max_staleness=1", "optim.lr=0.05")
    kept = [e for e in _step_rollouts(run_dir, 3) if e["trained"]]
    assert {v for e in kept for v in e["turn_versions"]} <= {1, 2}
    Hbar = _records(run_dir)[2]["entropy"]
    ckpt = run_dir / "checkpoints"
    proximal = _entropy_on(AutoModelForCausalLM.from_pretrained(ckpt / "step-000002" / "hf"), kept)
    older = _entropy_on(AutoModelForCausalLM.from_pretrained(ckpt / "step-000001" / "hf"), kept)
    assert Hbar == pytest.approx(proximal, rel=1e-5)
    assert Hbar != pytest.approx(older, rel=1e-5)  # the two policies are told apart
