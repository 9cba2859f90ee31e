"""95 % confidence intervals of evaluation metrics: how far a score measured on n problems may be from
the score on the whole distribution the problems were drawn from.

Two intervals, both over problems (the unit a benchmark samples):

    Wilson (k = 1, one 0/1 outcome per problem), with p = c / n and z = 1.96:
        center = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)
    percentile bootstrap (any per-problem score: avg@k's c/k, pass@k's unbiased estimate, maj@k):
        draw n problems with replacement B times, take the mean of each draw; the interval is the
        2.5th and 97.5th percentiles of those B means (seeded, so a rerun gives the same interval).

Wilson keeps its coverage near 0 and 1, where the normal interval collapses to a point; the bootstrap
needs no distributional form for scores between 0 and 1, but with few problems it is too narrow
(it cannot see outcomes the n problems did not show).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
BOOTSTRAP_DRAWS = 2000


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n`` (``successes`` may be a sum of
    scores in [0, 1]: see :func:`score_interval`).

    >>> lo, hi = wilson_interval(1, 4)
    >>> round(lo, 4), round(hi, 4)
    (0.0456, 0.6994)
    >>> wilson_interval(0, 10)[0]
    0.0
    """
    if not 0 <= successes <= n or n < 1:
        raise ValueError(f"the Wilson interval needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # exactly 0 or 1 at the ends, which the float sum center +- half misses by an ulp
    return (0.0 if successes == 0 else max(0.0, center - half)), (
        1.0 if successes == n else min(1.0, center + half)
    )


def bootstrap_interval(
    scores: Sequence[float], *, seed: int = 0, draws: int = BOOTSTRAP_DRAWS, level: float = 0.95
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean of per-problem ``scores`` (resampling problems).

    The percentiles are the ``floor(0.025 (B - 1))``-th and ``ceil(0.975 (B - 1))``-th of the B sorted draw
    means (no interpolation).

    >>> bootstrap_interval([0.5, 0.5, 0.5])
    (0.5, 0.5)
    """
    import numpy as np

    if not scores:
        return math.nan, math.nan
    values = np.asarray(scores, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(values), size=(draws, len(values)))
    means = np.sort(values[picks].mean(axis=1))
    tail = (1 - level) / 2
    return float(means[math.floor(tail * (draws - 1))]), float(means[math.ceil((1 - tail) * (draws - 1))])


def score_interval(scores: Sequence[float], *, seed: int = 0) -> tuple[float, float]:
    """95 % interval of the mean of per-problem ``scores`` in [0, 1] (avg@k's c/k, pass@k): the
    percentile bootstrap, except where it cannot see any spread (every problem scored the same: all 0,
    all 1, or one problem), where it would collapse to a point. There it is the Wilson interval of the
    mean taken as n 0/1 outcomes: a score in [0, 1] with mean p varies at most as a 0/1 outcome of
    mean p does, so that interval is wide enough.

    >>> [round(x, 4) for x in score_interval([0.0] * 30)]  # the bootstrap says [0.0, 0.0]
    [0.0, 0.1135]
    >>> score_interval([0.0, 0.5, 1.0]) == bootstrap_interval([0.0, 0.5, 1.0])
    True
    """
    if not scores:
        return math.nan, math.nan
    if any(not 0.0 <= x <= 1.0 for x in scores):
        raise ValueError(f"score_interval takes scores in [0, 1], got {min(scores)} .. {max(scores)}")
    if max(scores) > min(scores):
        return bootstrap_interval(scores, seed=seed)
    return wilson_interval(sum(scores), len(scores))


def paired_difference_interval(first: Sequence[float], second: Sequence[float]) -> tuple[float, float]:
    """95 % interval of ``mean(second) - mean(first)``, two scores of the SAME problems (a policy before
    and after training): the problems' shared difficulty cancels, so it is narrower than two separate
    intervals.

    0/1 outcomes (k = 1): Newcombe's hybrid score interval for paired proportions (1998, Statistics in
    Medicine 17:2635, method 10). With a = both right, b = right only in ``second``, c = right only in
    ``first``, d = neither, the difference is (b - c) / n; with Wilson intervals (l1, u1) of p1 = (a + c)/n
    and (l2, u2) of p2 = (a + b)/n and phi = (ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d)) (0 when a margin is 0):

        lower = D - sqrt((p2 - l2)^2 - 2 phi (p2 - l2)(u1 - p1) + (u1 - p1)^2)
        upper = D + sqrt((u2 - p2)^2 - 2 phi (u2 - p2)(p1 - l1) + (p1 - l1)^2)

    Other scores (avg@k's c/k): the percentile bootstrap of the per-problem differences.

    >>> before = [1] * 12 + [0] * 9 + [1] * 2 + [0] * 4  # (a, b, c, d) = (12, 9, 2, 4), n = 27
    >>> after = [1] * 12 + [1] * 9 + [0] * 2 + [0] * 4
    >>> [round(x, 4) for x in paired_difference_interval(before, after)]  # D = 7/27 = 0.2593
    [0.0315, 0.4521]
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"paired scores need the same problems, got {len(first)} and {len(second)} scores")
    if not all(x in (0, 1) for x in (*first, *second)):
        return bootstrap_interval([y - x for x, y in zip(first, second, strict=True)])
    n = len(first)
    a = sum(1 for x, y in zip(first, second, strict=True) if x and y)
    b = sum(1 for x, y in zip(first, second, strict=True) if y and not x)
    c = sum(1 for x, y in zip(first, second, strict=True) if x and not y)
    d = n - a - b - c
    p1, p2 = (a + c) / n, (a + b) / n
    (l1, u1), (l2, u2) = wilson_interval(a + c, n), wilson_interval(a + b, n)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    D = p2 - p1
    lower = D - math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0.0))
    upper = D + math.sqrt(max((u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2, 0.0))
    return max(lower, -1.0), min(upper, 1.0)


# Over seeds (a study's runs): m +- t_{0.975, n-1} * sd / sqrt(n), sd the sample SD (n - 1).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # t_{0.975, df} for df = 1 .. 30; Z95 beyond  # fmt: skip


def mean_sd_ci(xs: Sequence[float]) -> dict[str, float]:
    """``{"mean", "sd", "ci95", "n"}`` of a few seeds' values: sample SD and the 95 % t half-width.

    One value has no spread: its SD and half-width are NaN, not 0.

    >>> out = mean_sd_ci([1.0, 2.0, 3.0])
    >>> out["mean"], out["sd"], round(out["ci95"], 3)  # 4.303 * 1 / sqrt(3)
    (2.0, 1.0, 2.484)
    """
    n = len(xs)
    if n == 0:
        raise ValueError("mean_sd_ci needs at least one value")
    m = sum(xs) / n
    if n == 1:
        return {"mean": m, "sd": math.nan, "ci95": math.nan, "n": 1}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = _T975[n - 2] if n - 1 <= len(_T975) else Z95
    return {"mean": m, "sd": sd, "ci95": t * sd / math.sqrt(n), "n": n}


def format_ci(stats: dict[str, float], digits: int = 3) -> str:
    """``mean ± ci95`` of :func:`mean_sd_ci` (one value: the mean alone)."""
    if stats["n"] < 2:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['ci95']:.{digits}f}"


__all__ = [
    "BOOTSTRAP_DRAWS",
    "Z95",
    "bootstrap_interval",
    "score_interval",
    "format_ci",
    "mean_sd_ci",
    "paired_difference_interval",
    "wilson_interval",
]
