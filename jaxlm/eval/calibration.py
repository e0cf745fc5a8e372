"""Calibration errors of predicted probabilities.

Binary (a confidence against a 0/1 outcome, as a correctness model or the top-1 token
prediction gives): the expected calibration error (Guo et al. 2017) over equal-width bins,
its signed form (positive = over-confident), the root-mean-square error over the same bins
(RMSCE), and the adaptive calibration error over equal-mass bins (ACE, Nixon et al. 2019).
The Generalized Correctness Models paper (Xiao et al. 2025) reports these metrics (ECE with
30 bins); its scripts compute some of them differently (ECE on ``max(p, 1 - p)``, RMSCE over
adaptive bins of 100 points, class-conditional ACE), so its numbers are not these exactly.
Multiclass: the "full" ECE over every class's probability (Kull et al. 2019's classwise ECE
summed over classes, the Full-ECE of the tail-aware distillation paper's summary [INFERRED]).
"""

from __future__ import annotations

import numpy as np


def _binary(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    confidence = np.asarray(confidence, np.float64).ravel()
    correct = np.asarray(correct, np.float64).ravel()
    if confidence.shape != correct.shape:
        raise ValueError(f"confidence {confidence.shape} and correct {correct.shape} differ in size")
    if confidence.size and not (np.all(confidence >= 0.0) and np.all(confidence <= 1.0)):
        raise ValueError("confidence must lie in [0, 1] (probabilities, not logits)")
    if correct.size and not np.all((correct == 0.0) | (correct == 1.0)):
        raise ValueError("correct must be 0/1 (or boolean)")
    return confidence, correct


def _check_bins(n_bins: int) -> int:
    """``n_bins`` as an int (an integral float such as 15.0 is accepted)."""
    if isinstance(n_bins, (bool, np.bool_)) or not isinstance(n_bins, (int, float, np.integer, np.floating)) \
            or not np.isfinite(n_bins) or int(n_bins) != n_bins or n_bins < 1:
        raise ValueError(f"n_bins={n_bins!r} must be an integer >= 1")
    return int(n_bins)


def _width_bin_index(confidence: np.ndarray, n_bins: int) -> np.ndarray:
    """The bin ``b`` of ``(b/n, (b+1)/n]`` (0 in the first) holding each confidence, compared
    with the float edges ``k / n`` (``ceil(c * n)`` rounds ``0.07 * 100`` up past 7)."""
    return np.searchsorted(np.arange(1, n_bins) / n_bins, confidence, side="left")


def _width_bins(confidence: np.ndarray, correct: np.ndarray, n_bins: int):
    """Per equal-width bin ``(b/n, (b+1)/n]`` (0 in the first): count, confidence sum, hits."""
    n_bins = _check_bins(n_bins)
    bins = _width_bin_index(confidence, n_bins)
    return (np.bincount(bins, minlength=n_bins), np.bincount(bins, weights=confidence, minlength=n_bins),
            np.bincount(bins, weights=correct, minlength=n_bins))


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 15) -> float:
    """``sum_b (n_b / N) |acc_b - conf_b|`` over ``n_bins`` equal-width confidence bins
    ``(b/n, (b+1)/n]`` (confidence 0 falls in the first bin); 0 for no predictions."""
    confidence, correct = _binary(confidence, correct)
    _, conf_sum, acc_sum = _width_bins(confidence, correct, n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / confidence.size) if confidence.size else 0.0


def signed_calibration_error(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 30) -> float:
    """``sum_b (n_b / N) (conf_b - acc_b)`` over the ECE's bins: positive when the predictor is
    over-confident on balance (it equals ``mean(confidence) - mean(correct)``)."""
    confidence, correct = _binary(confidence, correct)
    _, conf_sum, acc_sum = _width_bins(confidence, correct, n_bins)
    return float((conf_sum - acc_sum).sum() / confidence.size) if confidence.size else 0.0


def rms_calibration_error(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 30) -> float:
    """``sqrt(sum_b (n_b / N) (acc_b - conf_b)^2)`` over the ECE's equal-width bins."""
    confidence, correct = _binary(confidence, correct)
    count, conf_sum, acc_sum = _width_bins(confidence, correct, n_bins)
    if not confidence.size:
        return 0.0
    full = count > 0
    gap = (acc_sum[full] - conf_sum[full]) / count[full]
    return float(np.sqrt(np.sum(count[full] / confidence.size * gap * gap)))


def adaptive_calibration_error(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 30) -> float:
    """ACE: ``(1/B) sum_b |acc_b - conf_b|`` over ``B = min(n_bins, N)`` equal-mass bins of the
    predictions sorted by confidence (bin ``b`` holds sorted ranks ``[b N / B, (b+1) N / B)``,
    ties broken by input order)."""
    confidence, correct = _binary(confidence, correct)
    n_bins = _check_bins(n_bins)
    n = confidence.size
    if n == 0:
        return 0.0
    order = np.argsort(confidence, kind="stable")
    B = min(int(n_bins), n)
    bins = (np.arange(n) * B) // n  # rank -> bin, every bin non-empty
    count = np.bincount(bins, minlength=B)
    conf_sum = np.bincount(bins, weights=confidence[order], minlength=B)
    acc_sum = np.bincount(bins, weights=correct[order], minlength=B)
    return float(np.mean(np.abs(acc_sum - conf_sum) / count))


CALIBRATION_METRICS = {
    "ece": expected_calibration_error,
    "signed_ece": signed_calibration_error,
    "rmsce": rms_calibration_error,
    "ace": adaptive_calibration_error,
}


def calibration_report(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 30) -> dict[str, float]:
    """Every binary calibration metric above with ``n_bins`` bins, keyed by its short name."""
    return {name: fn(confidence, correct, n_bins=n_bins) for name, fn in CALIBRATION_METRICS.items()}


def full_calibration_error(probs: np.ndarray, labels: np.ndarray, *, n_bins: int = 15) -> float:
    """Classwise ECE summed over classes: for each class ``k``, the ECE of ``p_k`` against
    ``[label == k]`` over every prediction, summed over ``k`` (``probs [N, V]``)."""
    probs = np.asarray(probs, np.float64)
    labels = np.asarray(labels).ravel()
    if probs.ndim != 2 or probs.shape[0] != labels.size:
        raise ValueError(f"probs must be [N, V] with N = len(labels), got {probs.shape} and {labels.shape}")
    if probs.size and not (np.all(probs >= 0.0) and np.all(probs <= 1.0)):
        raise ValueError("probs must lie in [0, 1] (probabilities, not logits)")
    if labels.size and not (np.issubdtype(labels.dtype, np.integer)
                            and labels.min() >= 0 and labels.max() < probs.shape[1]):
        raise ValueError(f"labels must be class ids in [0, V={probs.shape[1]}), got {labels.dtype} "
                         f"in [{labels.min()}, {labels.max()}]")
    n_bins = _check_bins(n_bins)
    n, V = probs.shape
    if n == 0:
        return 0.0
    bins = _width_bin_index(probs, n_bins)  # [N, V]
    hit = labels[:, None] == np.arange(V)[None]
    flat = (bins + n_bins * np.arange(V)[None]).ravel()
    conf_sum = np.bincount(flat, weights=probs.ravel(), minlength=n_bins * V)
    acc_sum = np.bincount(flat, weights=hit.ravel().astype(np.float64), minlength=n_bins * V)
    return float(np.abs(acc_sum - conf_sum).sum() / n)
