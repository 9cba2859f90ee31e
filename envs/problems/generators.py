"""Seeded generators of exact-computation problems: the embedded default data.

They ask for exact integers large enough that a small model can only get them right by running code
(``meta["solution_code"]`` holds a reference program that prints the answer, for cold-start traces).

Example:
    >>> [p.id for p in generate_problems("modpow", 2, seed=3, difficulty=2)]
    ['modpow-d2-s3-000000', 'modpow-d2-s3-000001']
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from typing import Any

from stare_envs.definitions import definition
from stare_envs.problems.sources import FAMILY_NAMES, Problem, ProblemSourceError

# --------------------------------------------------------------------------------------------------
# Generated problems
# --------------------------------------------------------------------------------------------------

DIFFICULTIES = (1, 2, 3)
# (problem text, exact answer, solution): the solution is code that prints the answer (the code
# interpreter's families), or the tool calls that compute it, ``[(tool name, arguments), ...]``, for an
# env of other tools: cold-start SFT plays either to make its traces (``stare_agent.train.sft_data``).
Generated = tuple[str, int | str, str | list[tuple[str, dict[str, Any]]]]
Generator = Callable[[random.Random, int], Generated]


class _FamilyRegistry(dict[str, Generator]):
    """A dict that refuses to overwrite a family and lists the valid names on a failed lookup."""

    def __setitem__(self, name: str, generator: Generator) -> None:
        if name in self:
            if definition(self[name]) == definition(generator):  # its module imported a second time
                return
            raise ValueError(f"problem family {name!r} is already registered: choose another name")
        super().__setitem__(name, generator)
        FAMILY_NAMES.add(name)

    def __missing__(self, name: str) -> Generator:
        raise KeyError(
            f"unknown problem family {name!r}: choose one of {', '.join(sorted(self))}, or 'mixed'"
        )


PROBLEM_FAMILIES: _FamilyRegistry = _FamilyRegistry()


def register_family(name: str) -> Callable[[Generator], Generator]:
    """Decorator that adds ``generator(rng, difficulty) -> (text, answer, solution)``: the solution is
    code printing the answer (``meta["solution_code"]``) or the tool calls computing it, ``[(tool name,
    arguments), ...]`` (``meta["solution_calls"]``)."""

    def decorate(generator: Generator) -> Generator:
        PROBLEM_FAMILIES[name] = generator
        return generator

    return decorate


PROCEDURAL_PREFIX = "procedural:"
"""Prefix of a problem source that names a generator family (``procedural:modpow``)."""


def procedural_family(source: str | os.PathLike[str] | None) -> str | None:
    """The generator family a problem source names, or None for a file, built-in set or hub dataset.

    The one parser of problem sources (training data, evaluation data, SFT data, environments):
    ``procedural:<family>`` and a bare family name both name a family, ``procedural:`` and ``mixed``
    name all of them.

    Example:
        >>> procedural_family("procedural:modpow"), procedural_family("procedural:"), procedural_family("mixed")
        ('modpow', 'mixed', 'mixed')
        >>> procedural_family("aime2024") is None
        True

    Raises:
        ProblemSourceError: ``procedural:<family>`` with an unknown family (the message lists them).
    """
    if not isinstance(source, str):
        return None
    if source.startswith(PROCEDURAL_PREFIX):
        family = source[len(PROCEDURAL_PREFIX) :] or "mixed"
        if family != "mixed" and family not in PROBLEM_FAMILIES:
            raise ProblemSourceError(
                f"unknown problem family {family!r} in {source!r}: use procedural:<family> with one of "
                f"{', '.join(sorted(PROBLEM_FAMILIES))}, or procedural:mixed"
            )
        return family
    return source if source == "mixed" or source in PROBLEM_FAMILIES else None


def generate_problems(family: str, n: int, *, seed: int = 0, difficulty: int = 1) -> list[Problem]:
    """``n`` seeded problems of one family (or ``"mixed"``: each problem from a random built-in family,
    ``MIXED_FAMILIES``).

    Problem ``i`` depends only on ``(family, difficulty, seed, i)``: the first ``k`` problems are the
    same whatever ``n`` is. Ids read ``<family>-d<difficulty>-s<seed>-<i:06d>``.

    Raises:
        KeyError: Unknown family (the message lists the valid ones).
        ValueError: ``difficulty`` outside ``DIFFICULTIES`` or ``n < 0``.
    """
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if family != "mixed":
        PROBLEM_FAMILIES[family]  # noqa: B018 - fail early with the list of valid names
    problems = []
    for index in range(n):
        rng = random.Random(f"{family}:{difficulty}:{seed}:{index}")
        chosen = rng.choice(MIXED_FAMILIES) if family == "mixed" else family
        text, answer, solution = PROBLEM_FAMILIES[chosen](rng, difficulty)
        steps = (
            {"solution_code": solution}
            if isinstance(solution, str)
            else {"solution_calls": [[name, dict(arguments)] for name, arguments in solution]}
        )
        problems.append(
            Problem(
                id=f"{family}-d{difficulty}-s{seed}-{index:06d}",
                problem=text,
                answer=str(answer),
                source=f"generated:{chosen}",
                meta={
                    "family": chosen,
                    "difficulty": difficulty,
                    "seed": seed,
                    "index": index,
                    **steps,
                },
            )
        )
    return problems


def _digits(rng: random.Random, count: int) -> int:
    """A random integer with exactly ``count`` decimal digits."""
    return rng.randrange(10 ** (count - 1), 10**count)


@register_family("multiplication")
def _multiplication(rng: random.Random, difficulty: int) -> Generated:
    sizes = {1: (5, 4), 2: (8, 7), 3: (12, 11)}[difficulty]
    a, b = _digits(rng, sizes[0]), _digits(rng, sizes[1])
    return f"Compute the exact value of ${a} \\times {b}$.", a * b, f"print({a} * {b})"


@register_family("modpow")
def _modpow(rng: random.Random, difficulty: int) -> Generated:
    base_digits, exponent_digits, modulus_digits = {1: (3, 3, 4), 2: (5, 6, 7), 3: (9, 12, 10)}[difficulty]
    a, e, m = _digits(rng, base_digits), _digits(rng, exponent_digits), _digits(rng, modulus_digits)
    text = f"What is the remainder when ${a}^{{{e}}}$ is divided by ${m}$?"
    return text, pow(a, e, m), f"print(pow({a}, {e}, {m}))"


@register_family("gcd_lcm")
def _gcd_lcm(rng: random.Random, difficulty: int) -> Generated:
    count, digits = {1: (2, 3), 2: (3, 4), 3: (4, 5)}[difficulty]
    shared = _digits(rng, digits)  # a common factor, so that the gcd is not trivially 1
    numbers = [shared * _digits(rng, digits) for _ in range(count)]
    listed = ", ".join(map(str, numbers))
    if rng.random() < 0.5:
        return (
            f"Find the greatest common divisor of {listed}.",
            math.gcd(*numbers),
            f"import math\nprint(math.gcd({listed}))",
        )
    text = f"Find the least common multiple of {listed}."
    return text, math.lcm(*numbers), f"import math\nprint(math.lcm({listed}))"


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97)


@register_family("divisors")
def _divisors(rng: random.Random, difficulty: int) -> Generated:
    num_primes, max_exponent = {1: (3, 3), 2: (4, 5), 3: (6, 8)}[difficulty]
    primes = rng.sample(_PRIMES, num_primes)
    exponents = [rng.randint(1, max_exponent) for _ in primes]
    n = math.prod(p**e for p, e in zip(primes, exponents, strict=True))
    count = math.prod(e + 1 for e in exponents)
    code = (
        f"n = {n}\ncount, d = 1, 2\nwhile d * d <= n:\n    e = 0\n    while n % d == 0:\n"
        "        n //= d\n        e += 1\n    count *= e + 1\n    d += 1\nif n > 1:\n    count *= 2\nprint(count)"
    )
    return f"How many positive divisors does ${n}$ have?", count, code


def _to_base(n: int, base: int) -> str:
    digits = ""
    while n:
        n, digit = divmod(n, base)
        digits = str(digit) + digits
    return digits or "0"


@register_family("base_conversion")
def _base_conversion(rng: random.Random, difficulty: int) -> Generated:
    digits = {1: 5, 2: 9, 3: 15}[difficulty]
    n = _digits(rng, digits)
    source_base, target_base = rng.sample(range(2, 11), 2)
    written = _to_base(n, source_base)
    text = f"Convert ${written}_{{{source_base}}}$ (a number written in base {source_base}) to base {target_base}."
    code = (
        f"n = int('{written}', {source_base})\ndigits = ''\nwhile n:\n    n, d = divmod(n, {target_base})\n"
        "    digits = str(d) + digits\nprint(digits or '0')"
    )
    return text, _to_base(n, target_base), code


@register_family("sequence_sum")
def _sequence_sum(rng: random.Random, difficulty: int) -> Generated:
    kind = rng.choice(("arithmetic", "geometric", "polynomial"))
    if kind == "arithmetic":
        terms = {1: 500, 2: 20_000, 3: 400_000}[difficulty] + rng.randrange(1000)
        first, step = rng.randrange(100, 10_000), rng.randrange(3, 1000)
        text = (
            f"Find the sum of the first {terms} terms of the arithmetic sequence "
            f"${first}, {first + step}, {first + 2 * step}, \\ldots$."
        )
        code = f"print(sum({first} + {step} * k for k in range({terms})))"
        return text, terms * first + step * terms * (terms - 1) // 2, code
    if kind == "geometric":
        terms = {1: 15, 2: 30, 3: 60}[difficulty] + rng.randrange(10)
        first, ratio = rng.randrange(2, 100), rng.randrange(2, 10)
        text = (
            f"Find the sum of the first {terms} terms of the geometric sequence "
            f"${first}, {first * ratio}, {first * ratio**2}, \\ldots$."
        )
        code = f"print(sum({first} * {ratio}**k for k in range({terms})))"
        return text, sum(first * ratio**k for k in range(terms)), code
    upper = {1: 200, 2: 5_000, 3: 50_000}[difficulty] + rng.randrange(100)
    c3, c2, c1 = rng.randrange(1, 10), rng.randrange(1, 50), rng.randrange(1, 500)
    text = f"Compute $\\sum_{{k=1}}^{{{upper}}} \\left({c3}k^3 + {c2}k^2 + {c1}k\\right)$."
    code = f"print(sum({c3} * k**3 + {c2} * k**2 + {c1} * k for k in range(1, {upper + 1})))"
    n = upper  # closed forms of sum k, sum k^2, sum k^3
    answer = c3 * (n * (n + 1) // 2) ** 2 + c2 * n * (n + 1) * (2 * n + 1) // 6 + c1 * n * (n + 1) // 2
    return text, answer, code


def _derangements(n: int) -> int:
    """D(n) by D(k) = (k - 1) * (D(k-1) + D(k-2)), D(0) = 1, D(1) = 0."""
    before, current = 1, 0
    if n == 0:
        return 1
    for k in range(2, n + 1):
        before, current = current, (k - 1) * (current + before)
    return current


@register_family("combinatorics")
def _combinatorics(rng: random.Random, difficulty: int) -> Generated:
    kind = rng.choice(("binomial", "lattice_paths", "multinomial", "derangements"))
    scale = {1: 1, 2: 3, 3: 8}[difficulty]
    if kind == "binomial":
        n = rng.randrange(30, 60) * scale
        k = rng.randrange(n // 4, n // 2)
        text = f"In how many ways can a committee of {k} people be chosen from {n} people?"
        return text, math.comb(n, k), f"import math\nprint(math.comb({n}, {k}))"
    if kind == "lattice_paths":
        right, up = rng.randrange(12, 25) * scale, rng.randrange(12, 25) * scale
        text = (
            f"How many shortest lattice paths lead from $(0, 0)$ to $({right}, {up})$ using unit steps "
            "right and up?"
        )
        return text, math.comb(right + up, right), f"import math\nprint(math.comb({right + up}, {right}))"
    if kind == "multinomial":
        counts = [rng.randrange(3, 8) * scale for _ in range(rng.randrange(3, 5))]
        letters = "ABCDE"[: len(counts)]
        described = ", ".join(f"{c} copies of {letter}" for c, letter in zip(counts, letters, strict=True))
        answer = math.factorial(sum(counts)) // math.prod(math.factorial(c) for c in counts)
        text = f"How many distinct strings can be formed by arranging all of the letters: {described}?"
        code = (
            f"import math\ncounts = {counts}\n"
            "print(math.factorial(sum(counts)) // math.prod(math.factorial(c) for c in counts))"
        )
        return text, answer, code
    n = rng.randrange(12, 20) * scale
    text = (
        f"In how many ways can {n} letters be placed into their {n} addressed envelopes, one letter per "
        "envelope, so that no letter is in its own envelope?"
    )
    code = f"d = [1, 0]\nfor k in range(2, {n} + 1):\n    d.append((k - 1) * (d[-1] + d[-2]))\nprint(d[{n}])"
    return text, _derangements(n), code


MIXED_FAMILIES: tuple[str, ...] = tuple(sorted(PROBLEM_FAMILIES))
"""The families ``mixed`` draws from: the built-in ones, fixed here, so that registering a family
(``register_family``) never changes which problems a ``mixed`` source with a given seed gives; a
registered family is drawn by its name."""
