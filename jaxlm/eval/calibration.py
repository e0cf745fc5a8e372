"""Calibration of next-token predictions: expected calibration error (Guo et al. 2017) of the
top-1 prediction, and the "full" ECE over every class's probability (Kull et al. 2019's
classwise ECE summed over classes, the Full-ECE of the tail-aware distillation paper's
summary [INFERRED])."""

from __future__ import annotations

import numpy as np


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, *, n_bins: int = 15) -> float:
    """``sum_b (n_b / N) |acc_b - conf_b|`` over ``n_bins`` equal-width confidence bins
    ``(b/n, (b+1)/n]`` (confidence 0 falls in the first bin); 0 for no predictions."""
    confidence = np.asarray(confidence, np.float64).ravel()
    correct = np.asarray(correct, np.float64).ravel()
    if confidence.shape != correct.shape:
        raise ValueError(f"confidence {confidence.shape} and correct {correct.shape} differ in size")
    if n_bins < 1:
        raise ValueError(f"n_bins={n_bins} must be >= 1")
    n = confidence.size
    if n == 0:
        return 0.0
    bins = np.clip(np.ceil(confidence * n_bins).astype(int) - 1, 0, n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    conf_sum = np.bincount(bins, weights=confidence, minlength=n_bins)
    acc_sum = np.bincount(bins, weights=correct, minlength=n_bins)
    return float(np.abs(acc_sum - conf_sum).sum() / n)


def full_calibration_error(probs: np.ndarray, labels: np.ndarray, *, n_bins: int = 15) -> float:
    """Classwise ECE summed over classes: for each class ``k``, the ECE of ``p_k`` against
    ``[label == k]`` over every prediction, summed over ``k`` (``probs [N, V]``)."""
    probs = np.asarray(probs, np.float64)
    labels = np.asarray(labels).ravel()
    if probs.ndim != 2 or probs.shape[0] != labels.size:
        raise ValueError(f"probs must be [N, V] with N = len(labels), got {probs.shape} and {labels.shape}")
    n, V = probs.shape
    if n == 0:
        return 0.0
    bins = np.clip(np.ceil(probs * n_bins).astype(int) - 1, 0, n_bins - 1)  # [N, V]
    hit = labels[:, None] == np.arange(V)[None]
    flat = (bins + n_bins * np.arange(V)[None]).ravel()
    conf_sum = np.bincount(flat, weights=probs.ravel(), minlength=n_bins * V)
    acc_sum = np.bincount(flat, weights=hit.ravel().astype(np.float64), minlength=n_bins * V)
    return float(np.abs(acc_sum - conf_sum).sum() / n)
