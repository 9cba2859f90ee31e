"""Asynchronous rollouts with a staleness bound (``trainer.max_staleness``).

With ``max_staleness = k > 0`` a :class:`RolloutProducer` thread plays the episodes of the next
steps while the learner trains the current one, as AReaL and verl's partial rollouts do:

    policy version   v = the step whose update produced the engine's weights (0: the initial policy)
    step s trains    on groups played for step s; its proximal policy pi_old is version s - 1
    staleness        of a model token sampled at version v and trained at step s: (s - 1) - v
    the bound        the producer starts step s only once the engine holds version >= s - 1 - k, so
                     every token of step s was sampled at a version >= s - 1 - k: staleness <= k
    k = 0            step s is played after update s - 1, on the trainer's own thread: the
                     synchronous trainer, unchanged

A weight update does not wait for episodes: :class:`VersionedEngine` ends the engine calls in
flight (one turn each), loads the weights, and the episodes go on under them; each turn keeps the
version that sampled it (``Generation.weight_version`` -> ``Trajectory.turn_versions``) and the
engine's log-probs, which the loss uses as the behaviour policy (decoupled PPO with
``algorithm.rollout_correction``). Groups are played whole within one step's production, so an
advantage is only ever taken over one group's samples.

Interrupting a turn (``trainer.interrupt_on_sync``, engines with ``interrupt()``: transformers, vLLM,
SGLang and the scripted engine's latency model), as AReaL, slime and verl's fully-async trainer do:
an update does not wait for the turns in flight (minutes for a batch at a 16K budget) but asks
the engine to end them at their next token (``finish_reason == "abort"``, the tokens so far), loads
the weights, and continues each cut turn from its prompt plus those tokens under the new weights
(prefilled again, so no KV entry of the old weights is reused). The turn's tokens keep their
samplers: ``Generation.version_switches`` -> ``Trajectory.version_switches`` (per segment),
``Trajectory.token_versions`` per token, with each token's log-prob from the weights that sampled
it. Without ``interrupt()`` (or with the switch off) an update waits for the calls in flight.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from stare_agent.errors import StareError
from stare_envs.engine import (
    ContinuousEngine,
    FinishReason,
    Generation,
    RolloutError,
    SamplingParams,
    stream_seed,
)

T = TypeVar("T")

# Extra tokens decoded beyond the longest stop string, for tokens that decode to no full character.
_STOP_WINDOW_MARGIN = 8


class RolloutsStopped(StareError, RuntimeError):
    """The engine calls were stopped (:meth:`VersionedEngine.stop`, by :meth:`RolloutProducer.close`)."""


class RolloutProducerStillRunning(StareError, RuntimeError):
    """:meth:`RolloutProducer.close` passed its deadline with the producer's thread still running."""


class _Turn:
    """One prompt's continuation over the engine calls that sampled it: the tokens so far, their
    log-probs and the version of each segment."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        self.prompt = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.segments: list[tuple[int, int]] = []  # (first token index, version), one per engine call
        self.finish: FinishReason | None = None

    def add(self, generation: Generation, version: int) -> bool:
        """Append one engine call's tokens; True when the turn is over (not cut short, or full)."""
        room = self.max_new_tokens - len(self.tokens)
        ids, logprobs = generation.token_ids[:room], generation.logprobs[:room]
        self.segments.append((len(self.tokens), version))
        self.tokens += ids
        self.logprobs += logprobs
        reason = generation.finish_reason
        if len(generation.token_ids) > room or (
            reason == "abort" and len(self.tokens) >= self.max_new_tokens
        ):
            reason = "length"
        if reason != "abort":
            self.finish = reason
        return self.finish is not None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def generation(self, stop: Sequence[str], tokenizer: Any) -> Generation:
        """The whole turn as one generation, its version switches where a call resumed it under
        another version; a stop string completed across a resume ends it there."""
        finish = self.finish or "length"
        if len(self.segments) > 1 and tokenizer is not None and finish != "eos":
            cut = _stop_across(self.tokens, [b for b, _ in self.segments[1:]], stop, tokenizer)
            if cut is not None and cut < len(self.tokens):
                del self.tokens[cut:], self.logprobs[cut:]
                finish = "stop"
        # the version of each segment with tokens (of a segment's start: the last call that began there)
        starts = {b: v for b, v in self.segments if b < len(self.tokens)}
        labels = sorted(starts.items()) or self.segments[:1]
        switches: list[tuple[int, int]] = []
        current = labels[0][1]
        for index, version in labels[1:]:
            if version != current and index > 0:
                switches.append((index, version))
                current = version
        return Generation(
            self.tokens,
            self.logprobs,
            finish,
            weight_version=labels[0][1],
            version_switches=tuple(switches),
        )


def _stop_across(tokens: list[int], boundaries: list[int], stop: Sequence[str], tokenizer: Any) -> int | None:
    """The smallest k such that the text of ``tokens[:k]`` completes a stop string in a window that
    spans a resume boundary (which no single engine call saw whole), or None."""
    stop = [s for s in stop if s]
    if not stop:
        return None
    window = max(len(s) for s in stop) + _STOP_WINDOW_MARGIN
    for boundary in boundaries:
        for k in range(boundary + 1, min(len(tokens), boundary + window) + 1):
            text = tokenizer.decode(tokens[max(0, k - window) : k], skip_special_tokens=False)
            if any(s in text for s in stop):
                return k
    return None


def _resumed_params(
    params: SamplingParams, turns: list[_Turn], indices: list[int], call: int
) -> SamplingParams:
    """The sampling parameters that continue ``turns`` (prompts ``indices`` of the first call): the
    largest remaining budget, and per prompt a stream of its own seed and length so far."""
    seeds = None
    if params.seeds is not None:
        seeds = tuple(
            stream_seed(params.seeds[i], "resume", len(t.tokens)) for i, t in zip(indices, turns, strict=True)
        )
    return dataclasses.replace(
        params,
        max_new_tokens=max(t.max_new_tokens - len(t.tokens) for t in turns),
        seed=None if params.seed is None else stream_seed(params.seed, "resume", call),
        seeds=seeds,
    )


class VersionedEngine:
    """An engine whose generations carry the policy version that sampled them.

    Weight updates and engine calls exclude each other: :meth:`update_weights` ends the calls in
    flight (``interrupt``: at their next token, and resumes them under the new weights once loaded)
    or waits for them to return (an engine without ``interrupt()``, or ``interrupt=False``), holds
    new calls back while it loads, and sets the version with the weights. Each generation's version
    is read when its engine call starts. It also measures the engine's busy time (some call in
    flight) for the idle fractions. Attributes other than the protocol's are the wrapped engine's.

    Args:
        engine: The engine.
        version: The version of the weights it holds.
        interrupt: End the calls in flight at a weight update (``trainer.interrupt_on_sync``), when
            the engine can (``interrupt()``).
        tokenizer: Decodes the tokens around a resume, where a stop string may be completed across
            two engine calls; default the engine's ``tokenizer`` (None: not checked).
    """

    def __init__(
        self, engine: Any, version: int = 0, *, interrupt: bool = True, tokenizer: Any = None
    ) -> None:
        self.engine = engine
        self.version = version
        self.interrupts = interrupt and callable(getattr(engine, "interrupt", None))
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.interrupted_calls = 0  # engine calls an update (or stop) ended early
        self._cond = threading.Condition()
        self._in_flight = 0
        self._updating = False
        self._stopped = False
        self._parked: list[
            Callable[[int], None]
        ] = []  # cut turns of a continuous engine, resumed after the update
        self._busy_s = 0.0
        self._busy_since = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    # ------------------------------------------------------------------ calls and updates

    def _enter(self) -> int:
        with self._cond:
            while self._updating and not self._stopped:
                self._cond.wait()
            if self._stopped:
                raise RolloutsStopped("the rollouts were stopped (RolloutProducer.close): no new engine call")
            return self._count_in()

    def _count_in(self) -> int:
        """One more call in flight (the lock held); the version it samples with."""
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        return self.version

    def _leave(self, interrupted: bool = False) -> None:
        with self._cond:
            self._in_flight -= 1
            self.interrupted_calls += int(interrupted)
            if self._in_flight == 0:
                self._busy_s += time.perf_counter() - self._busy_since
            self._cond.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        """The wrapped engine's ``generate``, each generation labelled with the version at the start of
        the call that sampled it; a turn an update cut short is continued under the new weights."""
        turns = [_Turn(p, params.max_new_tokens) for p in prompts]
        todo = list(range(len(prompts)))
        call = 0
        while todo:
            version = self._enter()
            cut = False
            try:
                sub = [turns[i] for i in todo]
                call_params = params if call == 0 else _resumed_params(params, sub, todo, call)
                generations = self.engine.generate([t.context for t in sub], call_params, stop)
                if len(generations) != len(sub):
                    raise RolloutError(
                        f"engine returned {len(generations)} generations for {len(sub)} prompts: "
                        "Engine.generate must return one Generation per prompt, in order"
                    )
                todo = [i for i, g in zip(todo, generations, strict=True) if not turns[i].add(g, version)]
                cut = any(g.finish_reason == "abort" for g in generations)
            finally:
                self._leave(interrupted=cut)
            call += 1
            if todo and self._stopped:
                raise RolloutsStopped(
                    "the rollouts were stopped (RolloutProducer.close) during an engine call"
                )
        return [t.generation(stop, self.tokenizer) for t in turns]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Load new weights once the calls in flight have ended (cut short with ``interrupt``, else
        returned), and label later calls ``version`` (None: the next version)."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._updating = True
        while True:
            with self._cond:
                if not self._in_flight:
                    break
            if self.interrupts:  # again while waiting: a call may have started just before the first
                self.engine.interrupt()
            with self._cond:
                if self._in_flight:
                    self._cond.wait(timeout=0.2)
        parked: list[Callable[[int], None]] = []
        try:
            self.engine.update_weights(named_tensors)
        finally:
            with self._cond:
                self.version = self.version + 1 if version is None else version
                parked, self._parked = self._parked, []
                for _ in parked:
                    self._count_in()
                self._updating = False
                self._cond.notify_all()
        for resume in parked:
            resume(self.version)

    def set_version(self, version: int) -> None:
        """Label later calls ``version`` without loading weights: a step that did not change the
        policy, or an engine that samples from the learner's own module."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def wait_for_version(self, version: int, stop: threading.Event) -> bool:
        """Block until the engine holds ``version`` or a later one (True) or ``stop`` is set (False)."""
        with self._cond:
            while self.version < version and not stop.is_set():
                self._cond.wait(timeout=0.5)
            return not stop.is_set()

    def wake(self) -> None:
        """Wake every waiter (to see a stop flag)."""
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        """End the calls in flight (at their next token, when the engine can ``interrupt()``) and refuse
        new ones with :class:`RolloutsStopped`, until :meth:`reopen`."""
        with self._cond:
            self._stopped = True
            parked, self._parked = self._parked, []
            self._cond.notify_all()
        for resume in parked:
            resume(-1)  # fails the turn's future
        if callable(getattr(self.engine, "interrupt", None)):
            self.engine.interrupt()

    def reopen(self) -> None:
        """Take calls again after :meth:`stop`."""
        with self._cond:
            self._stopped = False
            self._cond.notify_all()

    def busy_s(self) -> float:
        """Seconds with at least one engine call in flight, since this wrapper was made."""
        with self._cond:
            now = time.perf_counter()
            return self._busy_s + (now - self._busy_since if self._in_flight else 0.0)


class VersionedContinuousEngine(VersionedEngine):
    """:class:`VersionedEngine` for a continuous-batching engine: a submitted turn is in flight until
    its future completes, so an update ends (or waits for) the turns running in the engine, not
    episodes; a turn cut short is submitted again once the weights are loaded."""

    def submit(self, prompt: list[int], params: SamplingParams, stop: list[str]) -> Future[Generation]:
        """The wrapped engine's ``submit``; its generation is labelled with the version at submission
        (and, past a resume, with its version switches)."""
        version = self._enter()
        outer: Future[Generation] = Future()
        turn = _Turn(prompt, params.max_new_tokens)
        try:
            self._submit(turn, params, stop, outer, version, 0)
        except BaseException:
            self._leave()
            raise
        return outer

    def _submit(
        self,
        turn: _Turn,
        params: SamplingParams,
        stop: list[str],
        outer: Future[Generation],
        version: int,
        call: int,
    ) -> None:
        """One engine call of ``turn`` (counted in flight by the caller), sampled by ``version``."""
        call_params = params if call == 0 else _resumed_params(params, [turn], [0], call)
        inner = self.engine.submit(turn.context, call_params, stop)

        def resume(new_version: int) -> None:  # after the update (counted in flight), or -1: stopped
            if new_version < 0:
                outer.set_exception(RolloutsStopped("the rollouts were stopped (RolloutProducer.close)"))
                return
            try:
                self._submit(turn, params, stop, outer, new_version, call + 1)
            except BaseException as exc:  # noqa: BLE001 - the turn's own error, passed on to the runner
                self._leave()
                outer.set_exception(exc)

        def done(future: Future[Generation]) -> None:
            try:
                generation = future.result()
                over = turn.add(generation, version)
            except BaseException as exc:  # the turn's own error, passed on to the runner
                self._leave()
                outer.set_exception(exc)
                return
            if over:
                self._leave()
                outer.set_result(turn.generation(stop, self.tokenizer))
                return
            with self._cond:  # cut short: resumed after the update (or now, if none is under way)
                stopped, updating = self._stopped, self._updating
                if updating and not stopped:
                    self._parked.append(resume)
            self._leave(interrupted=True)
            if stopped:
                resume(-1)
            elif not updating:
                with self._cond:
                    v = self._count_in()
                resume(v)

        inner.add_done_callback(done)


def versioned(engine: Any, version: int, *, interrupt: bool = True, tokenizer: Any = None) -> VersionedEngine:
    """The wrapper that fits ``engine``: continuous when it can ``submit``."""
    cls = VersionedContinuousEngine if isinstance(engine, ContinuousEngine) else VersionedEngine
    return cls(engine, version, interrupt=interrupt, tokenizer=tokenizer)


class RolloutProducer(Generic[T]):
    """Plays steps ``first..last`` in order on a thread of its own: ``produce(step)`` once the engine
    holds a version >= ``step - 1 - max_staleness`` (the staleness bound), under ``lock`` (which the
    trainer takes to evaluate between steps). :meth:`take` hands a step's result to the learner."""

    def __init__(
        self,
        produce: Callable[[int], T],
        engine: VersionedEngine,
        *,
        first: int,
        last: int,
        max_staleness: int,
        lock: threading.Lock,
    ) -> None:
        self._produce = produce
        self._engine = engine
        self._max_staleness = max_staleness
        self._lock = lock
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._results: dict[int, T] = {}
        self._error: BaseException | None = None
        self.first, self.last = first, last
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for step in range(self.first, self.last + 1):
                if not self._engine.wait_for_version(step - 1 - self._max_staleness, self._stop):
                    return
                with self._lock:
                    if self._stop.is_set():
                        return
                    result = self._produce(step)
                with self._cond:
                    self._results[step] = result
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the learner's thread by take()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def take(self, step: int) -> T:
        """Block until step ``step`` is played and return it; re-raise the producer's error."""
        if not self.first <= step <= self.last:
            raise ValueError(f"step {step} is outside the producer's steps {self.first}..{self.last}")
        with self._cond:
            while step not in self._results:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before step {step}")
                self._cond.wait(timeout=0.5)
            return self._results.pop(step)

    def close(self, timeout: float = 60.0) -> None:
        """Stop, and return only once the producer's thread has ended: the step in progress is cut
        short (its engine calls ended at their next token where the engine can ``interrupt()``, later
        ones refused; its rollouts dropped: a resume plays them again).

        Raises:
            RolloutProducerStillRunning: the thread still runs ``timeout`` s later (an engine call that
                cannot be interrupted, a tool call, a collective), so the caller must not close the
                engine or the sandbox pool under it.
        """
        self._stop.set()
        self._engine.stop()
        self._engine.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RolloutProducerStillRunning(
                f"the rollout producer still runs {timeout:g} s after close (an engine, tool or collective call "
                "did not return): its engine and sandbox pool are left open under it"
            )
        self._engine.reopen()


def staleness(kept: Sequence[Any], step: int, max_staleness: int) -> dict[str, float]:
    """``async/staleness_mean`` (token mean) and ``_max`` of the kept groups' model tokens at ``step``:
    how many updates older than the proximal policy (version ``step - 1``) each token's sampler was;
    a token past ``max_staleness`` (or from a future policy) is a bug of the producer, raised."""
    proximal = step - 1
    lags = [
        proximal - v
        for g in kept
        for t in g.trajectories
        for v in t.token_versions()  # per token: a sync may interrupt a turn
        if v is not None
    ]
    if not lags:
        return {}
    if max(lags) > max_staleness or min(lags) < 0:
        raise RuntimeError(
            f"step {step} got tokens {max(lags)} updates stale (bound trainer.max_staleness="
            f"{max_staleness}) or from a future policy ({min(lags)}): a bug in the rollout producer"
        )
    return {"async/staleness_mean": sum(lags) / len(lags), "async/staleness_max": float(max(lags))}
