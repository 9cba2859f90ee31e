"""The rollout engine as a training run holds it (step 9 of a step, and what steps 1-3 sample with).

Started from ``env.engine`` (or given), moved to a copy of the weights under asynchronous rollouts,
its generations labelled with the policy version that sampled them, handed the new weights after
each update, and started again (with the current policy) when a closed one is needed.
"""

from __future__ import annotations

import time
from typing import Any

from stare_agent.config import RunConfig
from stare_agent.train.async_rollouts import VersionedEngine, versioned


class RolloutEngine:
    """A run's rollout engine and the policy version it samples from.

    Args:
        config: The run's config (``env``, ``model``, ``trainer.max_staleness``, ``trainer.seed``).
        learner: The learner whose module and weights the engine samples from.
        tokenizer: The tokenizer the engine is started with.
        engine: An engine to use instead of the one ``env.engine`` names (e.g. a scripted engine); it
            is not closed by :meth:`close`.
        rank: This process's rank (rank 0 says which engine started).
    """

    def __init__(
        self, config: RunConfig, learner: Any, tokenizer: Any, *, engine: Any = None, rank: int = 0
    ) -> None:
        self.config, self.learner, self.tokenizer, self.rank = config, learner, tokenizer, rank
        self.max_staleness = config.trainer.max_staleness
        self.version = 0  # the step whose update produced the weights the engine samples from
        self.sync_s = 0.0  # seconds spent handing weights to the engine (time/sync_s per step)
        self._owned = engine is None  # an engine started here (a vLLM worker) is closed here
        self._engine: Any = self._own_weights(engine) if engine is not None else self._start()
        self._versioned: VersionedEngine | None = None

    @property
    def engine(self) -> Any:
        """The engine; one started here that :meth:`close` stopped is started again (and given the
        current policy) when next needed."""
        if self._engine is None:
            self._engine = self._start()
            self.sync(self.version)
        if self._asleep:
            self._asleep = False
            self._engine.wake_up()
        return self._engine

    _asleep = False

    def sleep(self) -> None:
        """Free a colocated engine's GPU memory for the learner's update
        (``env.placement.sleep_between_steps``); the next use of :attr:`engine` (the weight sync, a
        skipped step's publish, the next rollouts) wakes it."""
        if getattr(getattr(self._engine, "placement", None), "sleep", False) and not self._asleep:
            self._engine.sleep()
            self._asleep = True

    @property
    def versioned(self) -> VersionedEngine:
        """The engine as rollouts use it: its generations labelled with the policy version; a sync
        ends its calls in flight and resumes them (``trainer.interrupt_on_sync``)."""
        if self._versioned is None or self._versioned.engine is not self.engine:
            self._versioned = versioned(
                self.engine,
                self.version,
                interrupt=self.config.trainer.interrupt_on_sync,
                tokenizer=self.tokenizer,
            )
        return self._versioned

    def sync(self, version: int) -> None:
        """Hand the policy's weights to the engine (merged ones under LoRA), as ``version``. An engine
        that samples from the learner's own module (the in-process transformers engine, with
        max_staleness 0) is always in sync."""
        self.version = version
        if getattr(self.engine, "model", None) is self.learner.module:
            self.versioned.set_version(version)
            return
        start = time.perf_counter()
        self.versioned.update_weights(self.learner.named_weights(), version=version)
        self.sync_s += time.perf_counter() - start

    def publish(self, version: int) -> None:
        """After step ``version`` (synced, or skipped: the same weights), label later engine calls with
        it; a producer waiting for it to respect the staleness bound goes on."""
        self.version = version
        self.versioned.set_version(version)

    def correction_mode(self) -> str:
        """``algorithm.rollout_correction.mode`` for this engine (:func:`resolve_rollout_correction`)."""
        return resolve_rollout_correction(
            self.config.algorithm.rollout_correction.mode, self.engine, max_staleness=self.max_staleness
        )

    def close(self) -> None:
        """Stop an engine started here (a vLLM worker); a given one is the caller's."""
        if self._owned and hasattr(self._engine, "close"):
            self._engine.close()
            self._engine, self._asleep = None, False

    def _start(self) -> Any:
        from stare_agent.engines import start_engine

        description, engine = start_engine(
            self.config,
            self.learner.module,
            self.tokenizer,
            autocast=self.learner.precision == "bf16-autocast",
        )
        if self.rank == 0:
            auto = " (env.engine=auto)" if self.config.env.engine == "auto" else ""
            print(f"rollout engine: {description}{auto}")
        return self._own_weights(engine)

    def _own_weights(self, engine: Any) -> Any:
        """``engine``; with ``max_staleness > 0``, an engine that samples from the learner's own module
        (the in-process transformers engine) is moved to a copy of the weights instead
        (``TransformersEngine.with_own_weights``): the producer samples while the optimizer changes
        the module in place, so the copy is synced after each update as any engine's weights are,
        and no rollout sees a half-updated module."""
        if not self.max_staleness or getattr(engine, "model", None) is not self.learner.module:
            return engine
        return engine.with_own_weights(self.learner.named_weights())


def resolve_rollout_correction(mode: str, engine: Any, *, max_staleness: int = 0) -> str:
    """``mode`` with ``auto`` resolved: ``token_tis`` for an engine whose log-probs come from
    kernels of its own (``own_numerics``: vLLM, SGLang, OpenAI-compatible) and for asynchronous
    rollouts (``max_staleness > 0``: the sampler is an older policy than the proximal one), else
    ``none`` (the in-process transformers engine samples from the learner's own module, so the
    ratio is 1; a scripted engine's log-probs are stand-ins)."""
    if mode != "auto":
        return mode
    return "token_tis" if max_staleness > 0 or getattr(engine, "own_numerics", False) else "none"
