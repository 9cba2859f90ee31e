"""95 % intervals of evaluation metrics; expected values worked out by hand."""

from __future__ import annotations

import math

import pytest

from stare_agent.intervals import bootstrap_interval, paired_difference_interval, wilson_interval


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


def test_paired_difference_interval_is_newcombes_method_10_worked_by_hand():
    # (a, b, c, d) = (12, 9, 2, 4), n = 27: 12 right both times, 9 only after, 2 only before, 4 never.
    # p1 = 14/27 = 0.51852 (before), p2 = 21/27 = 0.77778 (after), D = 7/27 = 0.25926.
    # Wilson 95 % (z^2 = 3.84146, 1 + z^2/n = 1.14228):
    #   21/27: centre (0.77778 + 0.07114) / 1.14228 = 0.74318, half 1.71587 * sqrt(0.0064014 + 0.0013174)
    #          = 0.15075 -> (0.59243, 0.89393)
    #   14/27: centre (0.51852 + 0.07114) / 1.14228 = 0.51621, half 1.71587 * sqrt(0.0092468 + 0.0013174)
    #          = 0.17636 -> (0.33985, 0.69257)
    # phi = (12*4 - 9*2) / sqrt(21 * 6 * 14 * 13) = 30 / 151.433 = 0.19811
    # lower: D - sqrt(0.18535^2 - 2 phi 0.18535 * 0.17405 + 0.17405^2) = 0.25926 - 0.22780 = 0.03146
    # upper: D + sqrt(0.11615^2 - 2 phi 0.11615 * 0.17867 + 0.17867^2) = 0.25926 + 0.19284 = 0.45210
    before = [1] * 12 + [0] * 9 + [1] * 2 + [0] * 4
    after = [1] * 12 + [1] * 9 + [0] * 2 + [0] * 4
    lo, hi = paired_difference_interval(before, after)
    assert lo == pytest.approx(0.03146, abs=2e-4) and hi == pytest.approx(0.45210, abs=2e-4)
    # the other way round: the same interval, negated
    lo2, hi2 = paired_difference_interval(after, before)
    assert (lo2, hi2) == pytest.approx((-hi, -lo), abs=1e-12)


def test_paired_difference_interval_of_unchanged_outcomes_holds_zero_and_is_narrower_than_wilsons():
    same = [1] * 30 + [0] * 10
    lo, hi = paired_difference_interval(same, same)
    assert lo < 0 < hi
    w_lo, w_hi = wilson_interval(30, 40)
    assert hi - lo < w_hi - w_lo  # the problems' shared difficulty cancels


def test_paired_difference_interval_of_fractional_scores_bootstraps_the_differences():
    before, after = [0.0, 0.25, 0.5, 0.5], [0.5, 0.25, 0.75, 1.0]
    assert paired_difference_interval(before, after) == bootstrap_interval([0.5, 0.0, 0.25, 0.5])
    with pytest.raises(ValueError, match="the same problems"):
        paired_difference_interval([1, 0], [1])


def test_an_interval_of_scores_never_collapses_where_every_problem_scored_the_same():
    """30 problems all at 0: the bootstrap sees no spread and says [0, 0]; the Wilson interval of 0 of
    30, worked by hand: z^2 = 3.8415, denominator 1 + z^2/30 = 1.12805, center = (z^2/60) / 1.12805 =
    0.056757, half = z / 1.12805 * sqrt(z^2 / 3600) = 0.056757: [0, 0.11351]."""
    from stare_agent.intervals import score_interval

    assert bootstrap_interval([0.0] * 30) == (0.0, 0.0)
    lo, hi = score_interval([0.0] * 30)
    assert lo == 0.0 and hi == pytest.approx(0.11351, abs=1e-5)
    lo, hi = score_interval([1.0] * 30)
    assert hi == 1.0 and lo == pytest.approx(1 - 0.11351, abs=1e-5)
    lo, hi = score_interval([0.0])  # one problem (avg@2 of 0 on one problem)
    assert lo == 0.0 and hi > 0.75
    assert score_interval([0.5] * 4) == wilson_interval(2, 4)  # no spread inside (0, 1): conservative
    assert score_interval([0.0, 0.5, 1.0], seed=3) == bootstrap_interval([0.0, 0.5, 1.0], seed=3)
    with pytest.raises(ValueError, match=r"scores in \[0, 1\]"):
        score_interval([1.5])


def test_the_evaluation_summary_interval_of_a_model_that_scores_nothing_is_not_a_point():
    """The README's AIME command on a model that scores 0 (--samples 4 --limit 30) printed [0, 0]."""
    from stare_agent.evaluation import ProblemResult, summarize_with_intervals

    results = [
        ProblemResult(f"p{i}", "1", answers=["2"] * 4, correct=[False] * 4, tool_calls=[0] * 4,
                      response_tokens=[10] * 4, truncated=[False] * 4)
        for i in range(30)
    ]  # fmt: skip
    metrics, intervals = summarize_with_intervals(results, 4)
    assert metrics["avg@4"] == 0.0 and intervals["avg@4"][0] == 0.0
    assert intervals["avg@4"][1] == pytest.approx(0.11351, abs=1e-5)
    assert all(hi > lo for lo, hi in intervals.values())
