"""SCOPE's threshold and bidirectional preference entropy against references written from the
definitions (method card §7.1), the realised error rate over 1000 exchangeable splits, and
Learn-then-Test's high-probability guarantee against the population error rate."""

import numpy as np
import pytest
from scipy.stats import entropy

from jaxlm.eval.conformal import (bidirectional_preference, ltt_threshold, preference_entropy, scope_threshold,
                                  selective_report)


def reference_threshold(scores, errors, alpha):
    """max{lambda in scores : (1 + sum e [s <= lambda]) / (1 + sum [s <= lambda]) <= alpha}."""
    best = -np.inf
    for lam in scores:
        inside = [e for s, e in zip(scores, errors) if s <= lam]
        if (1 + sum(inside)) / (1 + len(inside)) <= alpha:
            best = max(best, lam)
    return best


def test_bpe_is_the_binary_entropy_of_the_order_averaged_preference():
    rng = np.random.default_rng(0)
    p_ab, p_ba = rng.uniform(size=50), rng.uniform(size=50)
    p, h = bidirectional_preference(p_ab, p_ba)
    np.testing.assert_allclose(p, (p_ab + 1 - p_ba) / 2)
    np.testing.assert_allclose(h, [entropy([q, 1 - q]) for q in p], atol=1e-12)
    # a consistent judge (p_ba = 1 - p_ab) keeps its preference; a position-biased one is
    # maximally unsure
    np.testing.assert_allclose(bidirectional_preference([0.9], [0.1])[0], [0.9])
    np.testing.assert_allclose(bidirectional_preference([0.9], [0.9])[1], [np.log(2)])
    np.testing.assert_allclose(preference_entropy([0.0, 1.0]), [0.0, 0.0])
    with pytest.raises(ValueError, match="probabilities"):
        bidirectional_preference([1.2], [0.5])
    for bad in (np.nan, 1.5, -0.5):  # NaN read as entropy 0 (the most certain), p > 1 as negative entropy
        with pytest.raises(ValueError, match="not probabilities in \\[0, 1\\]"):
            preference_entropy([0.3, bad])


def test_threshold_matches_the_reference_with_ties_and_edge_cases():
    rng = np.random.default_rng(1)
    for trial in range(30):
        n = int(rng.integers(1, 60))
        s = np.round(rng.uniform(size=n), 1)  # ties
        e = (rng.uniform(size=n) < s).astype(int)
        for alpha in (0.1, 0.3, 0.6):
            assert scope_threshold(s, e, alpha) == reference_threshold(list(s), list(e), alpha)
    assert scope_threshold([0.1, 0.2], [1, 1], 0.2) == -np.inf  # every judgment wrong
    assert scope_threshold(np.arange(20.0), np.zeros(20), 0.1) == 19.0  # none wrong
    assert scope_threshold([], [], 0.1) == -np.inf
    with pytest.raises(ValueError, match="alpha"):
        scope_threshold([0.1], [0], 1.0)
    with pytest.raises(ValueError, match="0/1"):
        scope_threshold([0.1], [0.5], 0.1)


def synthetic(rng, n):
    """Scores U(0, 1) with P(error | s) = s^2 / 2: the population error rate among s <= lam is
    lam^2 / 6."""
    s = rng.uniform(size=n)
    return s, (rng.uniform(size=n) < 0.5 * s ** 2).astype(int)


@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_realised_error_rate_is_at_most_alpha_over_1000_splits(alpha):
    rng = np.random.default_rng(2)
    rates, coverage = [], []
    for _ in range(1000):
        s, e = synthetic(rng, 1000)
        lam = scope_threshold(s[:500], e[:500], alpha)
        report = selective_report(s[500:], e[500:], lam)
        rates.append(report.error_rate)
        coverage.append(report.coverage)
    assert np.mean(rates) <= alpha, (np.mean(rates), alpha)
    assert np.mean(coverage) > 0.4  # the guarantee is not met by accepting nothing


def test_learn_then_test_holds_with_probability_one_minus_delta():
    rng = np.random.default_rng(3)
    alpha, delta = 0.1, 0.1
    violations = []
    for _ in range(1000):
        s, e = synthetic(rng, 500)
        lam = np.clip(ltt_threshold(s, e, alpha, delta=delta), 0.0, 1.0)
        violations.append(lam ** 2 / 6 > alpha)
    assert np.mean(violations) <= delta, np.mean(violations)
    # a fixed grid gives a threshold on the grid
    s, e = synthetic(rng, 500)
    grid = np.linspace(0, 1, 11)
    assert ltt_threshold(s, e, alpha, delta=delta, grid=grid) in grid
    with pytest.raises(ValueError, match="grid holds NaN"):  # a NaN threshold accepted nothing, silently
        ltt_threshold(s, e, alpha, delta=delta, grid=[0.5, np.nan])
    assert ltt_threshold(s[:5], e[:5], alpha, delta=delta) == -np.inf  # too few to reject anything
    # the first testable threshold exactly on the boundary: 29 error-free points give the
    # p-value 0.5^29 = delta (the closed-form bound rounded to 29.000000000000004 and skipped it)
    n = 29
    assert ltt_threshold(np.arange(n + 1.0), np.r_[np.zeros(n), 1.0], 0.5, delta=0.5 ** n) == n - 1


def test_selective_report():
    r = selective_report([0.1, 0.2, 0.9], [0, 1, 1], 0.5)
    assert (r.coverage, r.accepted, r.error_rate) == (pytest.approx(2 / 3), 2, 0.5)
    assert selective_report([0.1], [1], -np.inf).error_rate == 0.0
    # the checks of the calibration: a NaN score would be silently rejected, an error of 7 averaged
    with pytest.raises(ValueError, match="NaN or infinite"):
        selective_report([0.1, np.nan, 0.2], [0, 1, 0], 0.5)
    with pytest.raises(ValueError, match="errors must be 0/1"):
        selective_report([0.1, 0.2], [0, 7], 0.5)
