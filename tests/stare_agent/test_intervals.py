"""95 % intervals of evaluation metrics; expected values worked out by hand."""

from __future__ import annotations

import math

import pytest

from stare_agent.intervals import bootstrap_interval, wilson_interval


def test_wilson_interval_by_hand():
    # 1 of 4, z = 1.96: z^2/n = 0.9604, center = (0.25 + 0.4802) / 1.9604 = 0.37247,
    # half = 1.96 / 1.9604 * sqrt(0.25 * 0.75 / 4 + 3.8416 / 64) = 0.32689
    lo, hi = wilson_interval(1, 4)
    assert (lo, hi) == pytest.approx((0.37247 - 0.32689, 0.37247 + 0.32689), abs=2e-4)
    # 0 of n: the lower end is 0, the upper z^2/(n + z^2) = 3.8415 / 13.8415 for n = 10
    assert wilson_interval(0, 10) == pytest.approx((0.0, 3.8415 / 13.8415), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((1 - 3.8415 / 13.8415, 1.0), abs=1e-4)
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        wilson_interval(3, 2)


def test_bootstrap_interval_by_hand():
    # Equal scores: every draw has the same mean.
    assert bootstrap_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    # 1 of 20 problems solved: a draw's count of it is Binomial(20, 1/20); P(0) = 0.358 > 2.5 %, so the
    # low end is 0; P(>= 4) = 0.016 < 2.5 % < P(>= 3) = 0.075, so the high end is 3/20.
    assert bootstrap_interval([1.0] + [0.0] * 19) == (0.0, 0.15)
    # Seeded: the same interval each time, another seed may differ only by sampling noise.
    scores = [i / 10 for i in range(10)]
    assert bootstrap_interval(scores, seed=1) == bootstrap_interval(scores, seed=1)
    assert all(math.isnan(x) for x in bootstrap_interval([]))
