"""Paired comparison of two systems scored right/wrong on the same items.

Only the discordant items carry information: ``fixed`` (wrong under A, right under B) and
``broken`` (right under A, wrong under B). Under the null hypothesis that neither system is
better, each discordant item falls either way with probability 1/2, so the two-sided exact
p-value is ``min(1, 2 * P[X <= min(fixed, broken)])`` for ``X ~ Binomial(fixed + broken, 1/2)``
(the exact McNemar test, McNemar 1947; the sign test on the paired differences). It is the
test the claim benchmarks use when two checkpoints decode the same held-out prompts.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class PairedComparison:
    """``fixed``: items B gets right and A wrong; ``broken``: the reverse; ``p_value``: the exact
    two-sided sign test on them (1.0 when there are none)."""

    fixed: int
    broken: int
    p_value: float


def sign_test_p(fixed: int, broken: int) -> float:
    """Two-sided exact sign-test p-value for ``fixed`` vs ``broken`` discordant pairs:
    ``min(1, 2 * sum_{k <= min} C(n, k) / 2^n)`` with ``n = fixed + broken`` (1.0 for n = 0).

    The largest term ``C(n, min) / 2^n`` is taken from the exact integer (its logarithm), and
    the tail below it summed by the ratio ``C(n, k-1) / C(n, k) = k / (n - k + 1)`` until the
    terms no longer change the sum: relative error ~1e-12 up to n = 20000 and ~1e-9 beyond
    (where ``lgamma`` gives the top term), in time ~sqrt(n) (summing every exact coefficient
    took 99 s at n = 20000)."""
    for name, v in (("fixed", fixed), ("broken", broken)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    n, low = int(fixed) + int(broken), min(int(fixed), int(broken))
    if n == 0:
        return 1.0
    if n <= 20_000:  # the exact binomial (a few ms)
        log_comb = math.log(math.comb(n, low))
    else:  # its big integer costs seconds; lgamma's error here is ~n log n ulp (< 1e-9 relative)
        log_comb = math.lgamma(n + 1) - math.lgamma(low + 1) - math.lgamma(n - low + 1)
    log_top = log_comb - n * math.log(2.0)
    ratio_sum, term = 1.0, 1.0
    for k in range(low, 0, -1):
        term *= k / (n - k + 1)
        ratio_sum += term
        if term < 1e-17 * ratio_sum:
            break
    return min(1.0, 2.0 * math.exp(log_top) * ratio_sum)


def paired_comparison(correct_a, correct_b) -> PairedComparison:
    """Compare per-item correctness of system A and system B (boolean or 0/1 arrays of one
    shape): the discordant counts and the exact two-sided sign test on them."""
    a, b = np.asarray(correct_a), np.asarray(correct_b)
    if a.shape != b.shape:
        raise ValueError(f"correct_a has shape {a.shape} and correct_b {b.shape}: they must score the same items")
    for name, v in (("correct_a", a), ("correct_b", b)):
        if v.size and v.dtype != bool and not (v.dtype.kind in "iu" and np.isin(v, (0, 1)).all()):
            raise ValueError(f"{name} must be booleans or 0/1 integers (got dtype {v.dtype})")
    a, b = a.astype(bool), b.astype(bool)
    fixed, broken = int(np.sum(~a & b)), int(np.sum(a & ~b))
    return PairedComparison(fixed, broken, sign_test_p(fixed, broken))
