"""Selective judging with a guarantee: SCOPE's acceptance threshold (Badshah et al. 2026;
method card §7.1, the threshold rule [INFERRED] there) and the Learn-then-Test variant.

A judgment with uncertainty score ``s`` (the bidirectional preference entropy, or any score
where lower means surer) is accepted when ``s <= lambda``. From a labelled calibration set
``{(s_i, e_i)}`` (``e_i = 1`` when the judgment was wrong):

* `scope_threshold`: the largest distinct calibration score ``lambda`` with
  ``(1 + sum_i e_i [s_i <= lambda]) / (1 + sum_i [s_i <= lambda]) <= alpha``
  (the +1s count the test judgment as a possible error: a finite-sample correction), so
  the error rate among accepted exchangeable test judgments is ``<= alpha`` on average.
  (Scanning from the loosest ``lambda`` down and stopping at the first that passes gives the
  same value; scanning up from the strictest and stopping at the first violation would stop
  at once, since a single accepted point already gives ``(1 + e) / 2 > alpha``.)
* `ltt_threshold`: Learn-then-Test (Angelopoulos et al. 2021) with fixed-sequence testing:
  for each ``lambda`` from strict to loose, reject ``H_lambda: FDR(lambda) > alpha`` when the
  binomial p-value ``P(Binom(n_lambda, alpha) <= k_lambda) <= delta``; stop at the first
  non-rejection. With probability ``>= 1 - delta`` over the calibration draw, the accepted
  set's error rate is ``<= alpha``. The sequence starts at the first ``lambda`` accepting at
  least ``log(delta) / log(1 - alpha)`` points: below that count no p-value can reach
  ``delta`` (even with no errors), so those hypotheses could never be rejected; the
  candidates are the distinct calibration scores or a fixed ``grid``.

A threshold of ``-inf`` accepts nothing (no ``lambda`` passed).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy import stats


def preference_entropy(p) -> np.ndarray:
    """Binary entropy ``-p log p - (1 - p) log(1 - p)`` in nats (0 at p = 0 or 1); ``p`` must be
    probabilities in [0, 1] (NaN is refused: read as entropy 0 it would be the most certain score)."""
    p = np.asarray(p, np.float64)
    bad = ~((p >= 0) & (p <= 1))
    if bad.any():
        raise ValueError(f"p holds {int(bad.sum())} value(s) that are not probabilities in [0, 1] "
                         f"(e.g. {p[bad].ravel()[0]!r})")
    q = 1.0 - p
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0) - np.where(q > 0, q * np.log(q), 0.0)
    return h


def bidirectional_preference(p_ab, p_ba) -> tuple[np.ndarray, np.ndarray]:
    """``(p, BPE)`` with ``p = (p_ab + 1 - p_ba) / 2``: the order-averaged P(A better) and its
    binary entropy. ``p_ba`` is the judge's P(first better) with the responses swapped."""
    p_ab, p_ba = np.asarray(p_ab, np.float64), np.asarray(p_ba, np.float64)
    if p_ab.shape != p_ba.shape:
        raise ValueError(f"p_ab {p_ab.shape} and p_ba {p_ba.shape} differ in shape")
    for name, v in (("p_ab", p_ab), ("p_ba", p_ba)):
        if v.size and not (np.all(v >= 0) and np.all(v <= 1)):
            raise ValueError(f"{name} must be probabilities in [0, 1]")
    p = 0.5 * (p_ab + (1.0 - p_ba))
    return p, preference_entropy(p)


def _scores_errors(scores, errors) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, np.float64).ravel()
    e = np.asarray(errors).ravel()
    if s.shape != e.shape:
        raise ValueError(f"scores {s.shape} and errors {e.shape} differ in size")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores have NaN or infinite entries")
    if e.size and not np.all((e == 0) | (e == 1)):
        raise ValueError("errors must be 0/1 (1 = the judgment disagreed with the label)")
    return s, e


def _calibration(scores, errors, alpha: float):
    s, e = _scores_errors(scores, errors)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha} must be in (0, 1)")
    order = np.argsort(s, kind="mergesort")
    s, e = s[order], e[order].astype(np.float64)
    last = np.flatnonzero(np.r_[s[1:] != s[:-1], True]) if s.size else np.zeros(0, int)
    return s[last], np.cumsum(e)[last] if s.size else np.zeros(0), (last + 1).astype(np.float64)


def scope_threshold(scores, errors, alpha: float) -> float:
    """SCOPE's acceptance threshold ``lambda_hat`` (module docstring); accept ``s <= lambda_hat``."""
    lam, err, kept = _calibration(scores, errors, alpha)
    ok = np.flatnonzero((1.0 + err) / (1.0 + kept) <= alpha)
    return float(lam[ok[-1]]) if ok.size else float("-inf")


def ltt_threshold(scores, errors, alpha: float, *, delta: float = 0.1, grid=None) -> float:
    """Learn-then-Test threshold with binomial p-values and fixed-sequence testing."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta={delta} must be in (0, 1)")
    lam, err, kept = _calibration(scores, errors, alpha)
    if grid is not None:
        s = np.sort(np.asarray(scores, np.float64).ravel())
        e = np.asarray(errors, np.float64).ravel()[np.argsort(np.asarray(scores, np.float64).ravel(), kind="mergesort")]
        lam = np.sort(np.asarray(grid, np.float64).ravel())
        if np.isnan(lam).any():
            raise ValueError(f"grid holds NaN ({int(np.isnan(lam).sum())} of {lam.size} thresholds): thresholds "
                             "must be numbers")
        kept = np.searchsorted(s, lam, side="right").astype(np.float64)
        err = np.r_[0.0, np.cumsum(e)][kept.astype(int)]
    # the first threshold whose p-value can reach delta at all (zero errors among those kept),
    # computed exactly: the closed form log(delta) / log1p(-alpha) rounds above an integer bound
    start = np.flatnonzero(stats.binom.cdf(0, kept, alpha) <= delta)
    if not start.size:
        return float("-inf")
    lam, err, kept = lam[start[0]:], err[start[0]:], kept[start[0]:]
    rejected = stats.binom.cdf(err, kept, alpha) <= delta
    fail = np.flatnonzero(~rejected)
    stop = fail[0] if fail.size else rejected.size
    return float(lam[stop - 1]) if stop > 0 else float("-inf")


@dataclasses.dataclass(frozen=True)
class SelectiveReport:
    """What a threshold does on a labelled set: the fraction accepted (coverage), how many,
    and the error rate among the accepted (0 when none is)."""

    threshold: float
    coverage: float
    accepted: int
    error_rate: float


def selective_report(scores, errors, threshold: float) -> SelectiveReport:
    """Accept ``scores <= threshold``; scores must be finite and errors 0/1, as in calibration."""
    s, e = _scores_errors(scores, errors)
    e = e.astype(np.float64)
    keep = s <= threshold
    n = int(keep.sum())
    return SelectiveReport(float(threshold), float(keep.mean()) if s.size else 0.0, n,
                           float(e[keep].mean()) if n else 0.0)
