"""AUROC, the risk-coverage curve, AURC and selective accuracy against scikit-learn and loops
written from the definitions, with ties and one-class inputs."""

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from jaxlm.eval.selective import aurc, auroc, risk_coverage, selective_accuracy


def pair_count_auroc(score, positive):
    pos = [s for s, y in zip(score, positive) if y]
    neg = [s for s, y in zip(score, positive) if not y]
    return np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a in pos for b in neg])


def test_auroc_matches_sklearn_and_the_pair_count():
    rng = np.random.default_rng(0)
    y = rng.uniform(size=300) < 0.3
    s = np.round(rng.normal(size=300) + y, 1)  # rounded: many ties
    assert auroc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert auroc(s, y) == pytest.approx(pair_count_auroc(s, y), abs=1e-12)
    assert auroc([0.0, 0.0, 0.0], [1, 0, 1]) == 0.5  # all tied
    assert auroc([3.0, 1.0], [1, 0]) == 1.0
    with pytest.raises(ValueError, match="both classes"):
        auroc([0.1, 0.2], [1, 1])


def test_risk_coverage_and_aurc_by_hand():
    conf = [0.9, 0.8, 0.7, 0.6]
    correct = [1, 0, 1, 0]
    cov, risk = risk_coverage(conf, correct)
    np.testing.assert_allclose(cov, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(risk, [0.0, 0.5, 1 / 3, 0.5])
    assert aurc(conf, correct) == pytest.approx(np.mean([0.0, 0.5, 1 / 3, 0.5]))
    # a tie is entered as one threshold step
    cov, risk = risk_coverage([0.9, 0.5, 0.5], [1, 1, 0])
    np.testing.assert_allclose(cov, [1 / 3, 1.0])
    np.testing.assert_allclose(risk, [0.0, 1 / 3])
    assert aurc([0.9, 0.5, 0.5], [1, 1, 0]) == pytest.approx(2 / 3 * 1 / 3)
    assert aurc([], []) == 0.0


def test_aurc_with_distinct_confidences_is_the_mean_top_k_risk():
    rng = np.random.default_rng(1)
    conf = rng.uniform(size=200)
    correct = rng.uniform(size=200) < conf
    order = np.argsort(-conf)
    want = np.mean([1 - correct[order[:k]].mean() for k in range(1, 201)])
    assert aurc(conf, correct) == pytest.approx(want, abs=1e-12)


def test_selective_accuracy():
    conf = [0.1, 0.9, 0.8, 0.2]
    correct = [0, 1, 0, 1]
    assert selective_accuracy(conf, correct, 0.25) == 1.0
    assert selective_accuracy(conf, correct, 0.5) == 0.5
    assert selective_accuracy(conf, correct, 1.0) == 0.5
    # ceil(coverage * N) of the decimal coverage: 0.28 * 1e5 keeps 28000, not 28001
    big_conf = -np.arange(100_000, dtype=float)
    big_correct = np.arange(100_000) < 28_000  # exactly the 28000 most confident are right
    assert selective_accuracy(big_conf, big_correct, 0.28) == 1.0
    assert selective_accuracy(big_conf, big_correct, 0.28001) < 1.0
    with pytest.raises(ValueError, match="coverage"):
        selective_accuracy(conf, correct, 0.0)
    # any coverage above 0 keeps ceil(coverage * N) >= 1 prediction: the most confident
    assert selective_accuracy(conf, correct, 3e-10) == 1.0
    assert selective_accuracy([0.4], [0], 5e-10) == 0.0
