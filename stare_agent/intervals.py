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


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n``.

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
    return max(0.0, center - half), min(1.0, center + half)


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


__all__ = ["BOOTSTRAP_DRAWS", "Z95", "bootstrap_interval", "format_ci", "mean_sd_ci", "wilson_interval"]
