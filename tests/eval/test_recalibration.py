"""Platt scaling and isotonic regression against scikit-learn (LogisticRegression with C=1e11
as the GCM code sets it; IsotonicRegression with out_of_bounds="clip")."""

import numpy as np
import pytest
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from jaxlm.eval.calibration import expected_calibration_error
from jaxlm.eval.recalibration import fit_isotonic, fit_platt


def overconfident(n, seed):
    rng = np.random.default_rng(seed)
    true_p = rng.uniform(0.05, 0.95, n)
    correct = rng.uniform(size=n) < true_p
    logit = np.log(true_p / (1 - true_p))
    return 1 / (1 + np.exp(-2.5 * logit + 0.7)), correct  # sharpened and shifted


def test_platt_matches_sklearn():
    conf, correct = overconfident(500, 0)
    for on, feature in (("logit", np.log(conf / (1 - conf))), ("score", conf)):
        ours = fit_platt(conf, correct, on=on)
        ref = LogisticRegression(C=1e11, tol=1e-12, max_iter=10_000).fit(feature[:, None], correct)
        assert ours.slope == pytest.approx(ref.coef_[0, 0], rel=1e-5)
        assert ours.intercept == pytest.approx(ref.intercept_[0], rel=1e-5, abs=1e-7)
        np.testing.assert_allclose(ours(conf), ref.predict_proba(feature[:, None])[:, 1], atol=1e-6)


def test_platt_repairs_an_overconfident_score():
    conf, correct = overconfident(4000, 1)
    test_conf, test_correct = overconfident(4000, 2)
    platt = fit_platt(conf, correct)
    before = expected_calibration_error(test_conf, test_correct, n_bins=30)
    after = expected_calibration_error(platt(test_conf), test_correct, n_bins=30)
    assert after < 0.5 * before, (before, after)


def test_isotonic_matches_sklearn_with_ties_and_out_of_range():
    rng = np.random.default_rng(3)
    score = np.round(rng.uniform(size=300), 2)  # ties
    correct = rng.uniform(size=300) < score ** 2
    ours = fit_isotonic(score, correct)
    ref = IsotonicRegression(out_of_bounds="clip").fit(score, correct)
    grid = np.r_[-0.5, np.linspace(0, 1, 101), 1.5]
    np.testing.assert_allclose(ours(grid), ref.predict(grid), atol=1e-12)
    assert np.all(np.diff(ours(grid)) >= 0)


def test_bad_calibration_sets():
    with pytest.raises(ValueError, match="at least 2"):
        fit_platt([0.5], [1])
    with pytest.raises(ValueError, match="0/1"):
        fit_isotonic([0.1, 0.2], [0.5, 1])
    with pytest.raises(ValueError, match="'logit'"):
        fit_platt([0.1, 0.2], [0, 1], on="probit")
    for C in (float("nan"), 0.0, float("inf")):  # NaN fitted a constant 0.5 calibrator
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            fit_platt([0.1, 0.2], [0, 1], C=C)
    # raw margins under on="logit" were clipped to [0, 1] before the logit
    with pytest.raises(ValueError, match="outside \\[0, 1\\]: on='logit' takes probabilities"):
        fit_platt([-3.0, 0.5, 2.0], [0, 1, 1])
    platt = fit_platt([0.2, 0.4, 0.6, 0.9], [0, 1, 0, 1])
    with pytest.raises(ValueError, match="outside"):
        platt([1.5])
