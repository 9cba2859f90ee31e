"""The engine contract: what the rollout runner asks of an inference engine, and what it gets back.

As Gymnasium's ``core.py`` holds ``Env``, this module holds :class:`Engine` (batch turns),
:class:`ContinuousEngine` (vLLM's continuous batching), :class:`SamplingParams`, :class:`Generation`,
the per-episode seed streams (:func:`stream_seed`) and the :class:`Tokenizer` slice the runner uses.
The runner (``stare_envs.rollout``) and every engine (``stare_agent.engines``) import it; it imports no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from stare_envs.errors import EnvError

FinishReason = Literal["stop", "length", "eos", "abort"]


class RolloutError(EnvError, RuntimeError):
    """The runner cannot continue: an engine broke the protocol or a chat template cannot be diffed."""


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples one turn.

    Attributes:
        temperature: Softmax temperature; 0 means greedy.
        top_p: Nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: Keep the k most likely tokens; None disables it.
        max_new_tokens: Most tokens one generate call may return per prompt.
        seed: Base seed for reproducible sampling. :class:`RolloutRunner` derives from it one random
            stream per episode and turn (see ``seeds``) and passes ``seed + turn`` here for engines
            that only know one stream per call. None: unseeded.
        seeds: One seed per prompt of a ``generate`` call (set by the runner, from
            :func:`stream_seed`): prompt i is sampled from its own random stream seeded with
            ``seeds[i]``, whatever the other prompts of the batch are, so an episode's tokens do not
            depend on the batch size or on its batch companions. Engines that honour it ignore
            ``seed``. None: one stream per call from ``seed``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 1024
    seed: int | None = None
    seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: use a value >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: use a value in (0, 1] (1 disables nucleus sampling)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k = {self.top_k}: use a positive integer, or None to disable top-k")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: use a positive integer")
        if self.seeds is not None:
            object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))


def stream_seed(base: int, *key: object) -> int:
    """A 31-bit seed for one random stream, derived from ``base`` and ``key`` by hashing.

    Distinct keys give unrelated streams (unlike ``base + i``, where prompt i + 1 at turn t and prompt
    i at turn t + 1 share one); 31 bits fit every engine's seed type.

    >>> stream_seed(0, "p1/0", 0) == stream_seed(0, "p1/0", 0) != stream_seed(0, "p1/1", 0)
    True
    """
    text = "/".join(str(part) for part in (base, *key))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Generation:
    """One prompt's continuation as the engine sampled it.

    Attributes:
        token_ids: The sampled tokens, in order. When generation stopped on a stop string they run up to
            and including the token that completed it (which may end past the stop string, or leave it
            mid-token); on EOS the EOS token is the last one.
        logprobs: The sampling log-prob of each token (under the distribution actually sampled from).
        finish_reason: ``"stop"`` (a stop string), ``"eos"`` (an end-of-sequence token) or ``"length"``
            (``max_new_tokens`` reached); ``"abort"`` for a call ended early by the engine's
            ``interrupt()`` (the tokens sampled so far; a weight update's wrapper,
            ``stare_agent.train.async_rollouts.VersionedEngine``, resumes it under the new weights,
            and the runner refuses one).
        weight_version: The policy version that sampled these tokens (the first of them, when
            ``version_switches`` is set), as whoever hands the engine its weights counts them (the
            trainer: the step whose update produced them, 0 for the initial policy); None: not
            tracked. The runner records it per model turn (``Trajectory.turn_versions``).
        version_switches: ``(token index, version)`` pairs, in increasing index order: from that token
            on the tokens were sampled by ``version`` (a turn interrupted by a weight update and
            resumed under the new weights). Empty: all tokens by ``weight_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None = None
    version_switches: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise RolloutError(
                f"engine returned {len(self.token_ids)} tokens but {len(self.logprobs)} log-probs: "
                "an Engine must return one log-prob per sampled token"
            )
        if self.finish_reason not in ("stop", "length", "eos", "abort"):
            raise RolloutError(
                f"finish_reason {self.finish_reason!r}: an Engine returns 'stop', 'length', 'eos' or 'abort'"
            )
        if self.version_switches:
            object.__setattr__(
                self, "version_switches", tuple((int(i), int(v)) for i, v in self.version_switches)
            )
            starts = [i for i, _ in self.version_switches]
            if (
                self.weight_version is None
                or starts != sorted(set(starts))
                or not 0 < starts[0] <= starts[-1] < len(self.token_ids)
            ):
                raise RolloutError(
                    f"version_switches {self.version_switches} for {len(self.token_ids)} tokens of version "
                    f"{self.weight_version}: give increasing token indices inside the generation, after its first"
                )


@runtime_checkable
class Engine(Protocol):
    """What the runner needs from an inference engine (transformers, SGLang, a scripted replay)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        """Continue each token-id prompt until a stop string, EOS or ``params.max_new_tokens``.

        Returns one :class:`Generation` per prompt, in order.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new policy weights (``(parameter name, tensor)`` pairs) before the next generate."""
        ...


@runtime_checkable
class ContinuousEngine(Engine, Protocol):
    """An engine that batches continuously (vLLM): a prompt submitted while others are in flight joins
    their batch at the next decoding step."""

    def submit(self, prompt: list[int], params: SamplingParams, stop: list[str]) -> Future[Generation]:
        """Start one prompt's continuation now; ``params.seeds``, when set, holds its one seed.

        Returns a future of its :class:`Generation` (or of the error that ended it).
        """
        ...


class Tokenizer(Protocol):
    """The slice of the Hugging Face tokenizer interface the runner uses."""

    eos_token_id: int | None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    # Hugging Face types the result str | list[str] (batched input); for one sequence it is a str.
    def decode(self, token_ids: list[int], **kwargs: Any) -> Any: ...
