"""Calibration errors against loops written from the definitions (ECE, Guo et al. 2017; signed
ECE and RMSCE over the same bins; ACE over equal-mass bins, Nixon et al. 2019; classwise ECE,
Kull et al. 2019), with bin edges, empty input and perfectly calibrated cases."""

import numpy as np
import pytest

from jaxlm.eval.calibration import (adaptive_calibration_error, calibration_report, expected_calibration_error,
                                    full_calibration_error, rms_calibration_error, signed_calibration_error)


def loop_ece(conf, correct, n_bins):
    total, n = 0.0, len(conf)
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [i for i in range(n) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0.0)]
        if members:
            acc = np.mean([correct[i] for i in members])
            avg = np.mean([conf[i] for i in members])
            total += len(members) / n * abs(acc - avg)
    return total


def test_ece_matches_the_definition():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0, 1, 500)
    conf[:5] = [0.0, 1.0, 0.2, 0.4, 1 / 3]  # bin edges and a non-dyadic value
    correct = rng.uniform(0, 1, 500) < conf ** 1.5
    for n_bins in (1, 10, 15):
        np.testing.assert_allclose(expected_calibration_error(conf, correct, n_bins=n_bins),
                                   loop_ece(conf, correct, n_bins), rtol=1e-12, atol=1e-12)
    # decimals on the edges: 0.07 is the edge 7/100, though 0.07 * 100 rounds to 7.000000000000001
    conf = np.array([float(f"0.{k:03d}") for k in range(1000)] + [1.0])
    correct = rng.uniform(0, 1, conf.size) < 0.5
    for n_bins in (25, 50, 100, 1000):
        np.testing.assert_allclose(expected_calibration_error(conf, correct, n_bins=n_bins),
                                   loop_ece(conf, correct, n_bins), rtol=1e-12, atol=1e-12)
    assert expected_calibration_error([0.07, 0.075], [1, 0], n_bins=100) == pytest.approx((0.93 + 0.075) / 2)


def test_ece_hand_example_and_degenerate_inputs():
    # two predictions at 0.9, one right: |0.5 - 0.9| = 0.4 over the whole set
    assert expected_calibration_error([0.9, 0.9], [True, False], n_bins=10) == pytest.approx(0.4)
    assert expected_calibration_error([1.0, 1.0], [True, True]) == 0.0
    assert expected_calibration_error([], []) == 0.0
    with pytest.raises(ValueError, match="differ in size"):
        expected_calibration_error([0.5], [True, False])


def test_full_ece_is_the_classwise_sum():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(5) * 0.7, size=300)
    labels = np.array([rng.choice(5, p=p) for p in probs])
    want = sum(loop_ece(probs[:, k], labels == k, 15) for k in range(5))
    np.testing.assert_allclose(full_calibration_error(probs, labels), want, rtol=1e-10, atol=1e-12)
    # one-hot predictions that are always right are perfectly calibrated
    assert full_calibration_error(np.eye(4)[[0, 1, 2, 3]], np.array([0, 1, 2, 3])) == 0.0
    with pytest.raises(ValueError, match="probabilities, not logits"):
        full_calibration_error(np.log(probs), labels)
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, V=5\)"):
        full_calibration_error(probs[:2], np.array([0, 5]))
    assert full_calibration_error(probs, labels, n_bins=15.0) == full_calibration_error(probs, labels)


def test_bin_counts_must_be_integers():
    conf, correct = np.array([0.2, 0.7, 0.9]), np.array([0, 1, 1])
    for metric in (expected_calibration_error, signed_calibration_error, adaptive_calibration_error):
        assert metric(conf, correct, n_bins=4.0) == metric(conf, correct, n_bins=4)
        for bad in (0, 2.5, float("nan"), True, "4"):
            with pytest.raises(ValueError, match="must be an integer >= 1"):
                metric(conf, correct, n_bins=bad)


def loop_bins(conf, correct, n_bins):
    """(n_b, acc_b, conf_b) for each non-empty equal-width bin, written from the definition."""
    out = []
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [i for i in range(len(conf)) if (lo < conf[i] <= hi) or (b == 0 and conf[i] == 0.0)]
        if members:
            out.append((len(members), np.mean([correct[i] for i in members]), np.mean([conf[i] for i in members])))
    return out


def test_signed_and_rms_errors_match_the_definition():
    rng = np.random.default_rng(2)
    conf = rng.uniform(0, 1, 400)
    conf[:3] = [0.0, 1.0, 0.1]
    correct = rng.uniform(0, 1, 400) < conf ** 2
    for n_bins in (1, 7, 30):
        cells = loop_bins(conf, correct, n_bins)
        signed = sum(n / 400 * (c - a) for n, a, c in cells)
        rms = np.sqrt(sum(n / 400 * (a - c) ** 2 for n, a, c in cells))
        np.testing.assert_allclose(signed_calibration_error(conf, correct, n_bins=n_bins), signed, atol=1e-12)
        np.testing.assert_allclose(rms_calibration_error(conf, correct, n_bins=n_bins), rms, atol=1e-12)
    # over-confident predictor: positive signed error equal to mean(conf) - accuracy
    assert signed_calibration_error([0.9] * 4, [1, 0, 0, 1]) == pytest.approx(0.4)
    assert rms_calibration_error([0.9] * 4, [1, 0, 0, 1]) == pytest.approx(0.4)


def test_adaptive_error_uses_equal_mass_bins():
    # six predictions, three bins of two sorted predictions each
    conf = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2]
    correct = [1, 0, 1, 0, 0, 1]
    # sorted: (0.1,0) (0.2,1) | (0.3,0) (0.5,1) | (0.7,0) (0.9,1)
    want = (abs(0.5 - 0.15) + abs(0.5 - 0.4) + abs(0.5 - 0.8)) / 3
    assert adaptive_calibration_error(conf, correct, n_bins=3) == pytest.approx(want)
    # more bins than predictions: one bin each
    want_each = np.mean([abs(c - k) for c, k in zip(conf, correct)])
    assert adaptive_calibration_error(conf, correct, n_bins=30) == pytest.approx(want_each)
    assert adaptive_calibration_error([], []) == 0.0


def test_report_and_bad_inputs():
    report = calibration_report([0.2, 0.8], [0, 1])
    assert set(report) == {"ece", "signed_ece", "rmsce", "ace"}
    assert report["ece"] == pytest.approx(0.2) and report["signed_ece"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        expected_calibration_error([1.5], [1])
    with pytest.raises(ValueError, match="0/1"):
        rms_calibration_error([0.5], [2])
    with pytest.raises(ValueError, match="n_bins"):
        adaptive_calibration_error([0.5], [1], n_bins=0)
