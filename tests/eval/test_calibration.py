"""Calibration errors against a loop written from the definitions (Guo et al. 2017; classwise
ECE, Kull et al. 2019), with bin edges, empty input and perfectly calibrated cases."""

import numpy as np
import pytest

from jaxlm.eval import expected_calibration_error, full_calibration_error


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
