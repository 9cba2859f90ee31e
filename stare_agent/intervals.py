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


__all__ = ["BOOTSTRAP_DRAWS", "Z95", "bootstrap_interval", "wilson_interval"]
