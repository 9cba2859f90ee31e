"""A scripted engine: replays given turn texts token-exactly, for tests and benchmarks without a model.

It implements :class:`stare_envs.engine.Engine` the way a real engine behaves at the token level: each
scripted turn is tokenized, then generation stops at the first stop string (the returned tokens run up
to and including the token that completes it, which may reach past the stop string), at an EOS token
written in the text, or at ``max_new_tokens``. A turn that contains no stop string ends with the EOS
token appended, like a model that finished its message. Log-probs are deterministic stand-ins, or, given a
``model``, that model's own log-probs of the scripted tokens (``log_softmax(logits / temperature)``), with
:meth:`ScriptedEngine.update_weights` loading new weights into it: log-probs that depend on the weights as
a real engine's do, so that an importance weight against the learner's policy is a meaningful number.

With a ``latency`` model a call takes ``call_s + token_s x`` its longest continuation (sleeping, so the
GIL is free as while a GPU decodes), and :meth:`ScriptedEngine.interrupt` ends it early: each unfinished
turn comes back with the tokens "decoded" so far (``"abort"``), and a prompt that continues them gets the
rest of the turn.

Episodes are told apart by their token context: a prompt that extends the context of an episode seen
before (its last prompt plus the tokens returned for it) continues that episode; any other prompt
starts a new one and takes the next script, in the order prompts first appear (so a list of scripts
serves one :meth:`RolloutRunner.run`; a callable serves any number).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from stare_agent.errors import StareError
from stare_envs.engine import FinishReason, Generation, SamplingParams, Tokenizer

Script = Sequence[str] | Callable[[str, int], str]


class ScriptError(StareError, RuntimeError):
    """The environment asked for a turn the script does not have."""


@dataclass
class _Replay:
    script: Script
    index: int
    turn: int = 0
    context: tuple[int, ...] = ()
    rest: Generation | None = None  # the part of an interrupted turn not yet returned


class ScriptedEngine:
    """Replays scripts turn by turn.

    Args:
        tokenizer: The tokenizer the runner uses (turn texts are tokenized with it).
        scripts: Either one script per episode (matched to episodes in the order their first prompts
            arrive), each a list of turn texts or a callable ``(prompt_text, turn_index) -> turn text``;
            or a single callable used for every episode.
        eos_token_id: The end-of-sequence token; default ``tokenizer.eos_token_id``.
        model: A causal LM of the engine's own whose log-probs the turns get (at ``temperature``;
            1 when greedy) and into which :meth:`update_weights` loads; None: stand-ins.
        latency: ``(call_s, token_s)``: a generate call takes ``call_s + token_s x`` its longest
            continuation (see the module docstring); None: no time.

    Only ``max_new_tokens`` (and, with a model, ``temperature``) of :class:`SamplingParams` applies; a
    replay has nothing to sample. ``weight_version`` counts :meth:`update_weights` calls.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        scripts: Sequence[Script] | Callable[[str, int], str],
        *,
        eos_token_id: int | None = None,
        model: Any = None,
        latency: tuple[float, float] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._scripts = scripts
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos_token_id: pass eos_token_id= to ScriptedEngine")
        self.eos_token_id: int = eos
        self._replays: list[_Replay] = []
        self.weight_version = 0
        self.calls: list[int] = []  # batch size of each generate call
        self.model = model
        self.latency = latency
        self._calls_lock = threading.Lock()
        self._calls: set[threading.Event] = set()  # one per generate call in flight (interrupt())

    # ------------------------------------------------------------------ the protocol

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        """Replay the next turn of each prompt's episode (see the module docstring)."""
        interrupted = threading.Event()
        with self._calls_lock:
            self._calls.add(interrupted)
        try:
            self.calls.append(len(prompts))
            claimed: set[int] = set()
            played: list[tuple[_Replay, Generation]] = []
            for prompt in prompts:
                replay = self._match(prompt, claimed)
                claimed.add(replay.index)
                if replay.rest is not None:  # the rest of an interrupted turn
                    gen, replay.rest = _cut(replay.rest, params.max_new_tokens), None
                else:
                    gen = self._emulate(self._turn_text(replay, prompt), params.max_new_tokens, stop)
                    replay.turn += 1
                played.append((replay, gen))
            decoded = self._decode_time(max((len(g.token_ids) for _, g in played), default=0), interrupted)
            out = []
            for prompt, (replay, gen) in zip(prompts, played, strict=True):
                if decoded is not None and len(gen.token_ids) > decoded:  # interrupted mid-turn
                    replay.rest = Generation(
                        gen.token_ids[decoded:], gen.logprobs[decoded:], gen.finish_reason
                    )
                    gen = Generation(gen.token_ids[:decoded], gen.logprobs[:decoded], "abort")
                replay.context = tuple(prompt) + tuple(gen.token_ids)
                out.append(self._with_model_logprobs(prompt, gen, params) if self.model is not None else gen)
            return out
        finally:
            with self._calls_lock:
                self._calls.discard(interrupted)

    def interrupt(self) -> None:
        """End the calls in flight (with a ``latency`` model; others take no time): their unfinished
        turns come back with the tokens so far and finish reason ``"abort"``."""
        with self._calls_lock:
            for event in self._calls:
                event.set()

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load the weights into ``model`` (without one, consume them: a replay has none to change) and
        bump ``weight_version``."""
        if self.model is None:
            for _ in named_tensors:
                pass
        else:
            import torch

            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in named_tensors:
                    own[name].copy_(tensor)
        self.weight_version += 1

    # ------------------------------------------------------------------ latency and log-probs

    def _decode_time(self, longest: int, interrupted: threading.Event) -> int | None:
        """Spend the latency model's time on a call whose longest continuation has ``longest`` tokens;
        None when it ran whole, else the tokens decoded when :meth:`interrupt` ended it."""
        if self.latency is None:
            return None
        call_s, token_s = self.latency
        start = time.perf_counter()
        if not interrupted.wait(call_s + token_s * longest):
            return None
        elapsed = time.perf_counter() - start
        return max(0, math.floor((elapsed - call_s) / token_s)) if token_s > 0 else 0

    def _with_model_logprobs(self, prompt: list[int], gen: Generation, params: SamplingParams) -> Generation:
        """``gen`` with the model's log-probs of its tokens after ``prompt``."""
        if not gen.token_ids:
            return gen
        import torch

        temperature = params.temperature if params.temperature > 0 else 1.0
        ids = torch.tensor([list(prompt) + list(gen.token_ids)])
        with torch.inference_mode():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(gen.token_ids)[:, None])[:, 0]
        return Generation(gen.token_ids, [float(x) for x in logprobs], gen.finish_reason)

    # ------------------------------------------------------------------ episodes

    def _match(self, prompt: list[int], claimed: set[int]) -> _Replay:
        """The episode ``prompt`` continues (longest matching context), or a new one."""
        best: _Replay | None = None
        for replay in self._replays:
            n = len(replay.context)
            if replay.index in claimed or n == 0 or n > len(prompt):
                continue
            if (best is None or n > len(best.context)) and tuple(prompt[:n]) == replay.context:
                best = replay
        if best is not None:
            return best
        index = len(self._replays)
        if callable(self._scripts):
            script: Script = self._scripts
        elif index < len(self._scripts):
            script = self._scripts[index]
        else:
            raise ScriptError(
                f"a new episode started but only {len(self._scripts)} scripts were given: pass one script per "
                "episode, or one callable for all"
            )
        replay = _Replay(script=script, index=index)
        self._replays.append(replay)
        return replay

    def _turn_text(self, replay: _Replay, prompt: list[int]) -> str:
        if callable(replay.script):
            return replay.script(self._decode(prompt), replay.turn)
        if replay.turn >= len(replay.script):
            raise ScriptError(
                f"episode {replay.index} asked for turn {replay.turn} but its script has {len(replay.script)} "
                "turns: add turns, or end the last one without a tool call so the episode terminates"
            )
        return replay.script[replay.turn]

    # ------------------------------------------------------------------ token-level stopping

    def _emulate(self, text: str, max_new_tokens: int, stop: Sequence[str]) -> Generation:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        reason: FinishReason = "eos"
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id) + 1]
        else:
            ids.append(self.eos_token_id)
        cut = self._stop_cut(ids[:-1], stop) if stop else None
        if cut is not None:
            ids, reason = ids[:cut], "stop"
        if len(ids) > max_new_tokens:
            ids, reason = ids[:max_new_tokens], "length"
        return Generation(ids, [self._logprob(i, t) for i, t in enumerate(ids)], reason)

    def _stop_cut(self, ids: list[int], stop: Sequence[str]) -> int | None:
        """The smallest k such that the first k tokens' text contains a stop string (binary search)."""

        def has_stop(k: int) -> bool:
            text = self._decode(ids[:k])
            return any(s in text for s in stop)

        if not ids or not has_stop(len(ids)):
            return None
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if has_stop(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @staticmethod
    def _logprob(position: int, token_id: int) -> float:
        """A deterministic stand-in in [-1.0, -0.001]."""
        return -((token_id * 31 + position * 7) % 1000 + 1) / 1000.0


def _cut(gen: Generation, max_new_tokens: int) -> Generation:
    """``gen`` cut to ``max_new_tokens`` (then ``"length"``)."""
    if len(gen.token_ids) <= max_new_tokens:
        return gen
    return Generation(gen.token_ids[:max_new_tokens], gen.logprobs[:max_new_tokens], "length")
