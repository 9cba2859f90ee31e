"""Token-exact, masked, interleaved trajectories: what one episode leaves for the learner.

A trajectory is the prompt's token ids followed by the response: the model's sampled turns interleaved
with tool output and chat-template glue. The loss mask says which response tokens the model sampled
(1) and which we inserted (0); ``logprobs`` holds the sampling log-probability of every mask-1 token.
Everything is a plain Python list, so trajectories serialize to JSON and need no torch (collation into
tensors lives in ``stare_agent.train.batch``).

The mask is built in exactly one place, :meth:`TrajectoryBuilder.append`, while the episode is played;
it is never reconstructed afterwards from text or token patterns.

Example:
    >>> b = TrajectoryBuilder(prompt_ids=[1, 2, 3])
    >>> b.append([10, 11], mask=1, logprobs=[-0.5, -0.25])  # a model turn
    >>> b.append([20], mask=0)  # tool output
    >>> b.append([12], mask=1, logprobs=[-1.0])  # the final turn
    >>> t = b.build(reward=1.0, info={"problem_id": "p0"})
    >>> t.loss_mask, t.logprobs, t.turn_spans
    ([1, 1, 0, 1], [-0.5, -0.25, 0.0, -1.0], [(0, 2), (3, 4)])
    >>> Trajectory.from_json(t.to_json()) == t
    True
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stare_envs.errors import EnvError


class TrajectoryError(EnvError, ValueError):
    """A trajectory whose fields disagree (lengths, mask values, spans)."""


@dataclass(frozen=True)
class Trajectory:
    """One episode as token ids, a loss mask, sampling log-probs and the episode's outcome.

    Attributes:
        prompt_ids: The rendered prompt (chat template with the generation prompt), never trained on.
        response_ids: Everything after the prompt: model turns, tool output, template glue.
        loss_mask: Same length as ``response_ids``; 1 = sampled by the model, 0 = inserted by us.
        logprobs: Same length as ``response_ids``; the sampling log-prob for mask-1 tokens, 0.0 for mask-0.
        turn_spans: ``[start, end)`` indices into ``response_ids`` of each model turn, in order; together
            they cover exactly the mask-1 tokens.
        reward: The episode's reward as its environment scored it (0.0 for an episode given up after an
            infrastructure failure, ``info["finish_reason"] == "failed"``).
        info: Episode information (problem id, number of tool calls, answer, correct, finish reason, ...);
            must be JSON-serializable for :meth:`to_json`.
        turn_versions: One entry per turn span: the policy version that sampled that turn
            (``Generation.weight_version``); empty when not tracked. With asynchronous rollouts a
            weight update can land between two turns of an episode, so its turns may differ. With
            ``version_switches`` a turn's entry is the version of its first token.
        version_switches: ``(response index, version)`` pairs, in increasing index order, each inside a
            turn span after its first token: from that token on, within its turn, the tokens were
            sampled by ``version`` (a turn interrupted by a weight update and resumed under the new
            weights, ``trainer.interrupt_on_sync``). Empty when no turn was; needs ``turn_versions``.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    turn_versions: list[int] = field(default_factory=list)
    version_switches: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if self.version_switches:
            indices = [i for i, _ in self.version_switches]
            inside = all(any(s < i < e for s, e in self.turn_spans) for i in indices)
            if not self.turn_versions or indices != sorted(set(indices)) or not inside:
                raise TrajectoryError(
                    f"version switches at {indices}: give increasing response indices, each inside a turn span "
                    "after its first token, with turn_versions"
                )
        if self.turn_versions and len(self.turn_versions) != len(self.turn_spans):
            raise TrajectoryError(
                f"{len(self.turn_versions)} turn versions for {len(self.turn_spans)} turn spans: give one "
                "policy version per model turn, or none"
            )
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise TrajectoryError(
                f"response_ids, loss_mask and logprobs must have one entry per response token, got lengths "
                f"{n}, {len(self.loss_mask)}, {len(self.logprobs)}: build trajectories with TrajectoryBuilder"
            )
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.logprobs, strict=True)):
            if m not in (0, 1):
                raise TrajectoryError(f"loss_mask[{i}] = {m!r}: mask values must be 0 or 1")
            if m == 0 and lp != 0.0:
                raise TrajectoryError(f"logprobs[{i}] = {lp} on a mask-0 token: inserted tokens carry 0.0")
            if m == 1 and not (lp <= 0.0 and math.isfinite(lp)):
                raise TrajectoryError(
                    f"logprobs[{i}] = {lp}: a sampled token's log-prob must be finite and <= 0"
                )
        covered, prev_end = 0, 0
        for start, end in self.turn_spans:
            if not (prev_end <= start <= end <= n):
                raise TrajectoryError(
                    f"turn span ({start}, {end}) is out of order or outside the response of {n} tokens"
                )
            if any(m != 1 for m in self.loss_mask[start:end]):
                raise TrajectoryError(
                    f"turn span ({start}, {end}) covers mask-0 tokens: a model turn is mask 1"
                )
            covered += end - start
            prev_end = end
        if covered != sum(self.loss_mask):
            raise TrajectoryError(
                f"turn spans cover {covered} tokens but {sum(self.loss_mask)} are mask 1: "
                "every sampled token belongs to exactly one model turn"
            )

    @property
    def input_ids(self) -> list[int]:
        """Prompt and response ids, concatenated (the sequence a learner feeds to the model)."""
        return self.prompt_ids + self.response_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length."""
        return len(self.prompt_ids) + len(self.response_ids)

    def token_versions(self) -> list[int | None]:
        """The policy version of every response token: its turn's for mask-1 tokens, None for inserted
        ones (and for all when versions are not tracked)."""
        versions: list[int | None] = [None] * len(self.response_ids)
        for (start, end), v in zip(self.turn_spans, self.turn_versions, strict=False):
            versions[start:end] = [v] * (end - start)
        for index, v in self.version_switches:
            end = next(e for s, e in self.turn_spans if s < index < e)
            versions[index:end] = [v] * (end - index)
        return versions

    @property
    def num_sampled_tokens(self) -> int:
        """Number of mask-1 (model-sampled) tokens."""
        return sum(self.loss_mask)

    @property
    def void_turn(self) -> bool:
        """The episode ended on a model turn with neither a tool call nor an answer (``info["void_turn"]``,
        set by the environment's ``step``): what the tool-health metrics count and SimpleTIR's void-turn
        filter (``algorithm.void_turn_filter``) leaves out of the loss."""
        return bool(self.info.get("void_turn"))

    def to_dict(self) -> dict[str, Any]:
        """Plain-types dictionary (turn spans as two-element lists)."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "turn_spans": [[s, e] for s, e in self.turn_spans],
            "reward": self.reward,
            "info": dict(self.info),
            "turn_versions": list(self.turn_versions),
            **(
                {"version_switches": [[i, v] for i, v in self.version_switches]}
                if self.version_switches
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Inverse of :meth:`to_dict`; validates like the constructor."""
        return cls(
            prompt_ids=[int(x) for x in data["prompt_ids"]],
            response_ids=[int(x) for x in data["response_ids"]],
            loss_mask=[int(x) for x in data["loss_mask"]],
            logprobs=[float(x) for x in data["logprobs"]],
            turn_spans=[(int(s), int(e)) for s, e in data.get("turn_spans", [])],
            reward=float(data.get("reward", 0.0)),
            info=dict(data.get("info", {})),
            turn_versions=[int(v) for v in data.get("turn_versions", [])],
            version_switches=[(int(i), int(v)) for i, v in data.get("version_switches", [])],
        )

    def to_json(self) -> str:
        """One line of JSON (for JSONL files)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(line))


class TrajectoryBuilder:
    """Accumulates a response segment by segment; the only place loss masks are made.

    Call :meth:`append` once per model turn (mask 1, with its log-probs) and once per inserted segment
    (mask 0: tool output, template glue), then :meth:`build`.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.turn_spans: list[tuple[int, int]] = []
        self.turn_versions: list[int | None] = []
        self.version_switches: list[tuple[int, int]] = []

    def __len__(self) -> int:
        """Number of response tokens so far."""
        return len(self.response_ids)

    @property
    def context_ids(self) -> list[int]:
        """Prompt plus response so far: what the engine continues from."""
        return self.prompt_ids + self.response_ids

    def append(
        self,
        ids: Sequence[int],
        mask: int,
        logprobs: Sequence[float] | None = None,
        *,
        version: int | None = None,
        version_switches: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Append one segment with one mask value.

        Args:
            ids: The segment's token ids.
            mask: 1 for a model turn (``ids`` exactly as sampled; recorded as one turn span), 0 for tokens
                we inserted (tool output, chat-template glue).
            logprobs: Sampling log-probs, one per id; required for mask 1, must be None for mask 0.
            version: For mask 1, the policy version that sampled the turn (None: not tracked); of its
                first token when ``version_switches`` is given.
            version_switches: For mask 1, ``(index into ids, version)`` where a later version took
                over within the turn (``Generation.version_switches``).
        """
        ids = list(ids)
        if mask == 1:
            if logprobs is None or len(logprobs) != len(ids):
                raise TrajectoryError(
                    f"a model turn of {len(ids)} tokens needs one log-prob per token, got "
                    f"{None if logprobs is None else len(logprobs)}: pass the engine's logprobs"
                )
            start = len(self.response_ids)
            self.turn_spans.append((start, start + len(ids)))
            self.turn_versions.append(version)
            self.version_switches += [(start + int(i), int(v)) for i, v in version_switches]
            self.logprobs.extend(float(x) for x in logprobs)
        elif mask == 0:
            if logprobs is not None:
                raise TrajectoryError("inserted (mask-0) segments carry no log-probs: pass logprobs=None")
            self.logprobs.extend([0.0] * len(ids))
        else:
            raise TrajectoryError(f"mask = {mask!r}: use 1 for sampled tokens and 0 for inserted ones")
        self.response_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))

    def build(self, reward: float = 0.0, info: dict[str, Any] | None = None) -> Trajectory:
        """Freeze into a validated :class:`Trajectory` (copies the lists)."""
        tracked = (
            [v for v in self.turn_versions if v is not None]
            if all(v is not None for v in self.turn_versions)
            else []
        )
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            turn_spans=list(self.turn_spans),
            reward=float(reward),
            info=dict(info or {}),
            turn_versions=tracked,
            version_switches=list(self.version_switches) if tracked else [],
        )
