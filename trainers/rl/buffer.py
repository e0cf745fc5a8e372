"""Buffer samplers (``BUFFER_SAMPLERS``): the hook between advantages and minibatches.

``sampler(priority [R], rng, cfg) -> (indices [R], weights [R])`` chooses which of the R
rollouts fill the epoch's R minibatch slots (``priority`` is each rollout's ``|A|``) and an
importance weight per slot that multiplies its token losses.

- ``uniform``: a permutation (every rollout once), weights 1.
- ``q_pas``: CofactGVR's quantile-filtered prioritized advantage sampling (seed abstract;
  the card B.4 reconstructs it): drop rollouts with ``|A|`` below the ``qpas_quantile``
  quantile, draw slots with replacement with ``P(i) ∝ |A_i|^alpha`` (``qpas_alpha``), and
  correct with prioritized-replay weights ``(N P(i))^(-beta) / max`` (``qpas_beta``; 0 = none),
  N the number kept.
"""

from __future__ import annotations

import numpy as np

from jaxlm.registry import Registry

BUFFER_SAMPLERS: Registry = Registry("buffer sampler")


@BUFFER_SAMPLERS.register("uniform")
def uniform_sampler(priority: np.ndarray, rng: np.random.Generator, cfg=None):
    n = len(priority)
    return rng.permutation(n), np.ones(n, np.float32)


def qpas_probabilities(priority: np.ndarray, quantile: float, alpha: float) -> np.ndarray:
    """``P(i)`` of Q-PAS: zero below the ``quantile`` of ``|A|``, else ``∝ |A_i|^alpha``."""
    a = np.abs(np.asarray(priority, np.float64))
    keep = a >= np.quantile(a, quantile)
    p = np.where(keep, a, 0.0) ** alpha
    p = np.where(keep, p, 0.0)
    if p.sum() <= 0:  # every kept rollout has A = 0: nothing to prefer
        p = keep.astype(np.float64)
    return p / p.sum()


@BUFFER_SAMPLERS.register("q_pas")
def qpas_sampler(priority: np.ndarray, rng: np.random.Generator, cfg=None):
    quantile = getattr(cfg, "qpas_quantile", 0.25)
    alpha = getattr(cfg, "qpas_alpha", 1.0)
    beta = getattr(cfg, "qpas_beta", 1.0)
    p = qpas_probabilities(priority, quantile, alpha)
    n = len(priority)
    idx = rng.choice(n, size=n, replace=True, p=p)
    kept = int((p > 0).sum())
    w = (kept * p[idx]) ** (-beta)
    return idx, (w / w.max()).astype(np.float32)
