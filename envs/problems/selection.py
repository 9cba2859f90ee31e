"""How a run picks its problems: the training stream and the validation set.

Dataset prompts lose the answer-format instructions that contradict the environment's own
(:data:`ANSWER_FORMAT_WRAPPERS`) and, optionally, repeats (:func:`plain_problems`); training reads a
reproducible, resumable :class:`ProblemStream`; validation reads :func:`eval_problems` (a procedural
family from a held-out seed space).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

from stare_envs.problems.generators import generate_problems, procedural_family
from stare_envs.problems.sources import Problem, ProblemSourceError, load_problems

ANSWER_FORMAT_WRAPPERS = (
    (
        # DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): every prompt asks for "Answer: $Answer",
        # which contradicts the environment's own answer format (<answer>\boxed{}</answer>).
        "Solve the following math problem step by step. The last line of your response should be of "
        "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
        '\n\nRemember to put your answer on its own line after "Answer:".',
    ),
)
"""(prefix, suffix) of known dataset prompts that tell the model how to write its answer. They are
removed, so that the environment's own prompt (its format's instructions) is the only instruction."""


def plain_problems(problems: list[Problem], *, dedupe: bool) -> tuple[list[Problem], dict[str, int]]:
    """The problems without the answer-format instructions of ``ANSWER_FORMAT_WRAPPERS`` and, with
    ``dedupe``, without repeats of a problem text (the first one is kept; the hub copy of
    DAPO-Math-17k holds each problem 100 times).

    Returns:
        (the problems, counts ``rows``, ``unwrapped``, ``duplicates``).
    """
    out: list[Problem] = []
    seen: set[str] = set()
    unwrapped = duplicates = 0
    for p in problems:
        text = p.problem
        for prefix, suffix in ANSWER_FORMAT_WRAPPERS:
            if text.startswith(prefix) and text.endswith(suffix):
                text = text[len(prefix) : len(text) - len(suffix)]
                unwrapped += 1
                break
        key = text.strip()
        if dedupe and key in seen:
            duplicates += 1
            continue
        seen.add(key)
        out.append(p if text == p.problem else dataclasses.replace(p, problem=text))
    return out, {"rows": len(problems), "unwrapped": unwrapped, "duplicates": duplicates}


class ProblemStream:
    """A reproducible, resumable stream of training problems.

    Files are read in a fresh seeded permutation per epoch; a procedural family (``mixed``,
    ``multiplication``, ...) yields problem i from seed ``(seed, i)``. ``position`` is all the
    state there is, so a checkpoint stores it and resumes the stream exactly. Problems of files and
    hub datasets go through :func:`plain_problems` (``counts`` says what it removed).
    """

    def __init__(
        self, source: str | Sequence[Problem], *, seed: int, difficulty: int = 1, dedupe: bool = True
    ) -> None:
        self.source, self.seed, self.difficulty = source, seed, difficulty
        self.position = 0
        self.family = procedural_family(source) if isinstance(source, str) else None
        self.problems: list[Problem] = []
        self.counts: dict[str, int] = {}
        if not self.family:
            loaded = load_problems(source) if isinstance(source, str) else list(source)
            self.problems, self.counts = plain_problems(loaded, dedupe=dedupe)
        if not self.family and not self.problems:
            raise ProblemSourceError(
                f"data.train={source_name(source)} holds no problems: point it at a non-empty problem file"
            )

    def take(self, n: int) -> list[Problem]:
        out = [self._at(self.position + i) for i in range(n)]
        self.position += n
        return out

    def _at(self, i: int) -> Problem:
        if self.family:
            seed = zlib.crc32(f"train/{self.seed}/{i}".encode())
            return generate_problems(self.family, 1, seed=seed, difficulty=self.difficulty)[0]
        epoch, index = divmod(i, len(self.problems))
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))
        return self.problems[int(order[index])]


def eval_problems(
    source: str | Sequence[Problem] | None, *, seed: int, difficulty: int, limit: int | None
) -> list[Problem]:
    """Validation problems: a file/hub source, a list, or a procedural family with a held-out seed.

    Raises:
        ProblemSourceError: no source (``data.eval`` unset and an env registered without problems), or one
            that holds no problems; both before any model loads.
    """
    if source is None:
        raise ProblemSourceError(
            "data.eval is not set: pass --data (or data.eval=...) with a problem file, a built-in set "
            "(aime2024, aime2025, amc23, math500) or a procedural family (e.g. mixed)"
        )
    family = procedural_family(source) if isinstance(source, str) else None
    if family is not None:
        # Held out: the training stream never uses this seed space.
        return generate_problems(
            family, limit or 32, seed=zlib.crc32(f"eval/{seed}".encode()), difficulty=difficulty
        )
    problems = load_problems(source) if isinstance(source, str) else list(source)
    if not problems:
        raise ProblemSourceError(
            f"data.eval={source_name(source)} holds no problems: point it at a non-empty problem file"
        )
    return problems[:limit] if limit else problems


def source_name(source: str | Sequence[Problem]) -> str:
    """A source as messages name it: the string's repr, or ``<N problems>`` for a list."""
    return repr(source) if isinstance(source, str) else f"<{len(source)} problems>"
