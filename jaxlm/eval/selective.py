"""Ranking quality of a confidence or uncertainty score: AUROC (the Mann-Whitney statistic,
ties counted one half), the risk-coverage curve of selective prediction and its area (AURC,
Geifman & El-Yaniv 2017), and selective accuracy at a coverage.

Convention: ``confidence`` is higher for predictions more likely right. A detector's
uncertainty (Evidence Drop, BPE, Bayes risk) is passed as ``-uncertainty``, or to `auroc`
with ``positive = error``.
"""

from __future__ import annotations

import numpy as np


def _scores(score, label, name: str = "label") -> tuple[np.ndarray, np.ndarray]:
    score = np.asarray(score, np.float64).ravel()
    label = np.asarray(label).ravel()
    if score.shape != label.shape:
        raise ValueError(f"score {score.shape} and {name} {label.shape} differ in size")
    if not np.all(np.isfinite(score)):
        raise ValueError("score has NaN or infinite entries")
    if label.size and not np.all((label == 0) | (label == 1)):
        raise ValueError(f"{name} must be 0/1 (or boolean)")
    return score, label.astype(bool)


def auroc(score: np.ndarray, positive: np.ndarray) -> float:
    """``P(score_pos > score_neg) + P(tie) / 2`` over all (positive, negative) pairs, computed
    from average ranks (O(N log N)). Raises if either class is empty."""
    score, positive = _scores(score, positive, "positive")
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUROC needs both classes, got {n_pos} positive and {n_neg} negative")
    order = np.argsort(score, kind="mergesort")
    s = score[order]
    ranks = np.empty(s.size)
    start = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    end = np.r_[start[1:], s.size]
    for a, b in zip(start, end):  # average rank (1-based) within each tie group
        ranks[a:b] = (a + b + 1) / 2.0
    rank_of = np.empty(s.size)
    rank_of[order] = ranks
    u = rank_of[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def risk_coverage(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The selective-risk curve: at each distinct confidence ``c`` (high to low), the coverage
    ``|{conf >= c}| / N`` and the error rate among those predictions. Tied confidences enter
    together (a threshold cannot split them)."""
    confidence, correct = _scores(confidence, correct, "correct")
    if confidence.size == 0:
        return np.zeros(0), np.zeros(0)
    order = np.argsort(-confidence, kind="mergesort")
    c, err = confidence[order], ~correct[order]
    last = np.flatnonzero(np.r_[c[1:] != c[:-1], True])  # end of each tie group
    kept = last + 1
    return kept / confidence.size, np.cumsum(err)[last] / kept


def aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """Area under the risk-coverage curve, ``sum_j (cov_j - cov_{j-1}) risk_j`` over the curve's
    points; with distinct confidences it is ``(1/N) sum_k risk(top k)``. Lower is better."""
    coverage, risk = risk_coverage(confidence, correct)
    if coverage.size == 0:
        return 0.0
    return float(np.sum(np.diff(np.r_[0.0, coverage]) * risk))


def selective_accuracy(confidence: np.ndarray, correct: np.ndarray, coverage: float) -> float:
    """Accuracy on the ``ceil(coverage * N)`` most confident predictions (ties in input order)."""
    confidence, correct = _scores(confidence, correct, "correct")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage={coverage} must be in (0, 1]")
    if confidence.size == 0:
        raise ValueError("selective accuracy of no predictions")
    x = coverage * confidence.size  # ceil up to float error, relative to x (0.28 * 1e5 = 28000.000000000004)
    k = max(1, int(np.ceil(x - 1e-9 * max(x, 1.0))))  # any coverage > 0 keeps at least one
    top = np.argsort(-confidence, kind="mergesort")[:k]
    return float(correct[top].mean())
