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
    Computed with integers, so it stays exact for any n."""
    for name, v in (("fixed", fixed), ("broken", broken)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name}={v!r} must be an int >= 0")
    n, low = int(fixed) + int(broken), min(int(fixed), int(broken))
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(low + 1))
    return min(1.0, 2 * tail / 2**n)


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
