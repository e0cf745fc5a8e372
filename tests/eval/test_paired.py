"""The exact paired sign test against its definition (enumerating every way the discordant
items could fall under the null) and against scipy's binomial test."""

import itertools

import numpy as np
import pytest
from scipy import stats

from jaxlm.eval.paired import paired_comparison, sign_test_p


def enumerated_p(fixed: int, broken: int) -> float:
    """Two-sided: the probability, with each discordant item a fair coin, of a split at least
    as uneven as the observed one."""
    n = fixed + broken
    if n == 0:
        return 1.0
    observed = abs(fixed - broken)
    splits = [sum(s) for s in itertools.product((0, 1), repeat=n)]
    return sum(abs(2 * k - n) >= observed for k in splits) / 2**n


@pytest.mark.parametrize("n", range(11))
def test_matches_enumeration(n):
    for fixed in range(n + 1):
        assert sign_test_p(fixed, n - fixed) == pytest.approx(enumerated_p(fixed, n - fixed), rel=1e-12)


@pytest.mark.parametrize("fixed,broken", [(0, 1), (1, 8), (26, 399), (278, 211), (83, 46), (123, 598), (500, 500),
                                          (1000, 1), (3, 0)])
def test_matches_scipy(fixed, broken):
    want = stats.binomtest(fixed, fixed + broken, 0.5, alternative="two-sided").pvalue
    assert sign_test_p(fixed, broken) == pytest.approx(want, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("fixed,broken", [(9_800, 10_200), (10_000, 10_400), (99_000, 100_000), (400_000, 410_000),
                                          (10_000_000, 10_009_000), (3, 1_000_000)])
def test_large_benchmarks_are_fast_and_match_scipy(fixed, broken):
    """A 100k-item benchmark with 20% disagreement has ~20000 discordant items: summing every
    exact coefficient took minutes there; scipy's binomial CDF is the reference."""
    import time

    start = time.perf_counter()
    got = sign_test_p(fixed, broken)
    assert time.perf_counter() - start < 2.0
    want = min(1.0, 2 * stats.binom.cdf(min(fixed, broken), fixed + broken, 0.5))
    assert got == pytest.approx(want, rel=1e-7, abs=1e-300)


def test_paired_counts_on_random_items():
    rng = np.random.default_rng(0)
    a, b = rng.random(500) < 0.6, rng.random(500) < 0.7
    got = paired_comparison(a, b)
    fixed = sum(1 for x, y in zip(a, b) if not x and y)
    broken = sum(1 for x, y in zip(a, b) if x and not y)
    assert (got.fixed, got.broken) == (fixed, broken)
    assert got.p_value == sign_test_p(fixed, broken)
    assert paired_comparison(a.astype(int), b.astype(np.int64)) == got
    assert paired_comparison(a, a) == paired_comparison([], []) == type(got)(0, 0, 1.0)
    assert paired_comparison(b, a) == type(got)(broken, fixed, got.p_value)


def test_bad_input():
    with pytest.raises(ValueError, match="same items"):
        paired_comparison([True, False], [True])
    with pytest.raises(ValueError, match="correct_b must be booleans"):
        paired_comparison([1, 0], [0.5, 1.0])
    with pytest.raises(ValueError, match="correct_a must be booleans"):
        paired_comparison([2, 0], [1, 1])
    with pytest.raises(ValueError, match="fixed=-1"):
        sign_test_p(-1, 3)
    with pytest.raises(ValueError, match="broken=True"):
        sign_test_p(1, True)
