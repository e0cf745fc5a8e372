"""Post-hoc recalibration of a confidence score, as the Generalized Correctness Models paper
(Xiao et al. 2025) applies it to a correctness model's P(correct): Platt scaling (a
one-feature logistic regression, Platt 1999) and isotonic regression (pool-adjacent
violators). Each ``fit_*`` returns a frozen calibrator; calling it maps scores to
probabilities. Fit on a held-out calibration split, never on the test split."""

from __future__ import annotations

import dataclasses

import numpy as np

_EPS = 1e-12


def _pairs(score, correct) -> tuple[np.ndarray, np.ndarray]:
    score = np.asarray(score, np.float64).ravel()
    correct = np.asarray(correct, np.float64).ravel()
    if score.shape != correct.shape:
        raise ValueError(f"score {score.shape} and correct {correct.shape} differ in size")
    if score.size < 2:
        raise ValueError(f"recalibration needs at least 2 calibration points, got {score.size}")
    if not np.all(np.isfinite(score)):
        raise ValueError("score has NaN or infinite entries")
    if not np.all((correct == 0.0) | (correct == 1.0)):
        raise ValueError("correct must be 0/1 (or boolean)")
    return score, correct


def _feature(score: np.ndarray, on: str) -> np.ndarray:
    if on == "logit":
        if np.any((score < 0.0) | (score > 1.0)):
            bad = score[(score < 0.0) | (score > 1.0)][0]
            raise ValueError(f"score {bad!r} is outside [0, 1]: on='logit' takes probabilities "
                             "(use on='score' for raw margins)")
        p = np.clip(score, _EPS, 1.0 - _EPS)
        return np.log(p) - np.log1p(-p)
    return score


@dataclasses.dataclass(frozen=True)
class PlattCalibrator:
    """``sigmoid(slope * f(score) + intercept)`` with ``f`` the logit (``on="logit"``, for a
    probability) or the identity (``on="score"``, for a raw margin)."""

    slope: float
    intercept: float
    on: str = "logit"

    def __call__(self, score) -> np.ndarray:
        z = self.slope * _feature(np.asarray(score, np.float64), self.on) + self.intercept
        return 1.0 / (1.0 + np.exp(-z))


def fit_platt(score, correct, *, on: str = "logit", C: float = 1e11, max_iter: int = 100) -> PlattCalibrator:
    """Maximum-likelihood logistic regression of ``correct`` on one feature of ``score``, with
    sklearn's convention for the penalty: ``||slope||^2 / (2 C)`` (none on the intercept;
    ``C = 1e11`` as the GCM code sets it). Newton steps with step halving."""
    if on not in ("logit", "score"):
        raise ValueError(f"on={on!r} must be 'logit' (a probability) or 'score' (a raw score)")
    if not 0 < C < np.inf:  # NaN passed "<= 0" and fitted a constant 0.5
        raise ValueError(f"C={C} must be a finite number > 0")
    score, y = _pairs(score, correct)
    x = _feature(score, on)
    X = np.stack([x, np.ones_like(x)], 1)
    reg = np.array([1.0 / C, 0.0])

    def objective(w):
        z = X @ w
        return np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(reg * w * w)

    w = np.zeros(2)
    f = objective(w)
    for _ in range(max_iter):
        p = 1.0 / (1.0 + np.exp(-(X @ w)))
        grad = X.T @ (p - y) + reg * w
        hess = (X * (p * (1 - p))[:, None]).T @ X + np.diag(reg) + 1e-12 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-10:
            w_new = w - t * step
            f_new = objective(w_new)
            if f_new <= f:
                break
            t *= 0.5
        else:
            break
        converged = abs(f - f_new) <= 1e-12 * max(1.0, abs(f))
        w, f = w_new, f_new
        if converged:
            break
    return PlattCalibrator(float(w[0]), float(w[1]), on)


@dataclasses.dataclass(frozen=True)
class IsotonicCalibrator:
    """The non-decreasing fit at the calibration scores ``x``, linearly interpolated between
    them and clipped outside their range (sklearn's ``out_of_bounds="clip"``)."""

    x: tuple[float, ...]
    y: tuple[float, ...]

    def __call__(self, score) -> np.ndarray:
        return np.interp(np.asarray(score, np.float64), np.asarray(self.x), np.asarray(self.y))


def isotonic_fit_values(y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Pool-adjacent violators: the weighted least-squares non-decreasing sequence."""
    means, weights, sizes = [], [], []
    for v, w in zip(y, weight):
        means.append(float(v))
        weights.append(float(w))
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            w2 = weights[-2] + weights[-1]
            m = (means[-2] * weights[-2] + means[-1] * weights[-1]) / w2
            sizes[-2] += sizes[-1]
            means[-2], weights[-2] = m, w2
            means.pop(), weights.pop(), sizes.pop()
    return np.repeat(means, sizes)


def fit_isotonic(score, correct) -> IsotonicCalibrator:
    """Isotonic regression of ``correct`` on ``score``; tied scores are pooled first."""
    score, y = _pairs(score, correct)
    xs, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ys = np.bincount(inverse, weights=y) / counts
    fitted = isotonic_fit_values(ys, counts.astype(np.float64))
    return IsotonicCalibrator(tuple(map(float, xs)), tuple(map(float, fitted)))


RECALIBRATORS = {"platt": fit_platt, "isotonic": fit_isotonic}
