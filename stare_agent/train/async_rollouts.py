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

A weight update does not wait for episodes: :class:`VersionedEngine` lets the engine calls in
flight (one turn each) finish, loads the weights, and the episodes go on under them; each turn
keeps the version that sampled it (``Generation.weight_version`` -> ``Trajectory.turn_versions``)
and the engine's log-probs, which the loss uses as the behaviour policy (decoupled PPO with
``algorithm.rollout_correction``). Groups are played whole within one step's production, so an
advantage is only ever taken over one group's samples.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from stare_envs.engine import ContinuousEngine, Generation, SamplingParams

T = TypeVar("T")


class VersionedEngine:
    """An engine whose generations carry the policy version that sampled them.

    Weight updates and engine calls exclude each other: :meth:`update_weights` waits for the calls
    in flight to return (not for their episodes to end), holds new calls back while it loads, and
    sets the version with the weights. It also measures the engine's busy time (some call in
    flight) for the idle fractions. Attributes other than the protocol's are the wrapped engine's.
    """

    def __init__(self, engine: Any, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        self._cond = threading.Condition()
        self._in_flight = 0
        self._updating = False
        self._busy_s = 0.0
        self._busy_since = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)

    # ------------------------------------------------------------------ calls and updates

    def _enter(self) -> int:
        with self._cond:
            while self._updating:
                self._cond.wait()
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
            return self.version

    def _leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += time.perf_counter() - self._busy_since
            self._cond.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        """The wrapped engine's ``generate``, each generation labelled with the current version."""
        version = self._enter()
        try:
            generations = self.engine.generate(prompts, params, stop)
        finally:
            self._leave()
        return [dataclasses.replace(g, weight_version=version) for g in generations]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int | None = None) -> None:
        """Load new weights once the calls in flight have returned, and label later calls ``version``
        (None: the next version)."""
        with self._cond:
            while self._updating:
                self._cond.wait()
            self._updating = True
            while self._in_flight:
                self._cond.wait()
        try:
            self.engine.update_weights(named_tensors)
        finally:
            with self._cond:
                self.version = self.version + 1 if version is None else version
                self._updating = False
                self._cond.notify_all()

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

    def busy_s(self) -> float:
        """Seconds with at least one engine call in flight, since this wrapper was made."""
        with self._cond:
            now = time.perf_counter()
            return self._busy_s + (now - self._busy_since if self._in_flight else 0.0)


class VersionedContinuousEngine(VersionedEngine):
    """:class:`VersionedEngine` for a continuous-batching engine: a submitted turn is in flight until
    its future completes, so an update waits for the turns running in the engine (not for episodes)."""

    def submit(self, prompt: list[int], params: SamplingParams, stop: list[str]) -> Future[Generation]:
        """The wrapped engine's ``submit``; its generation is labelled with the version at submission."""
        version = self._enter()
        outer: Future[Generation] = Future()
        try:
            inner = self.engine.submit(prompt, params, stop)
        except BaseException:
            self._leave()
            raise

        def done(future: Future[Generation]) -> None:
            try:
                outer.set_result(dataclasses.replace(future.result(), weight_version=version))
            except BaseException as exc:  # the turn's own error, passed on to the runner
                outer.set_exception(exc)
            finally:
                self._leave()

        inner.add_done_callback(done)
        return outer


def versioned(engine: Any, version: int) -> VersionedEngine:
    """The wrapper that fits ``engine``: continuous when it can ``submit``."""
    cls = VersionedContinuousEngine if isinstance(engine, ContinuousEngine) else VersionedEngine
    return cls(engine, version)


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
        """Stop after the step in progress (its rollouts are dropped: a resume plays them again)."""
        self._stop.set()
        self._engine.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn(
                f"the rollout producer did not finish its step within {timeout:.0f} s of close; left running "
                "as a daemon thread",
                stacklevel=2,
            )
