"""KL estimators of ``KL(pi_theta || pi_ref)`` per sampled token (``KL_ESTIMATORS``), from
Schulman's "Approximating KL divergence" (2020), with ``x = ref_logp - logp``:

- ``k1``: ``-x``;  ``k2``: ``x^2 / 2``;  ``k3``: ``exp(x) - x - 1`` (low variance, >= 0);
- ``k3+``: the value of k3 with the gradient of k2, by straight-through
  ``k2 - sg(k2) + sg(k3)`` (verl's ``+`` suffix; k2's gradient is the unbiased one).
``x`` is clamped to +-20 before ``exp``; k3 is evaluated as ``expm1(x) - x``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")
sg = jax.lax.stop_gradient


@KL_ESTIMATORS.register("k1")
def k1(logp, ref_logp):
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logp, ref_logp):
    x = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.expm1(x) - x  # expm1: no cancellation in exp(x) - 1 for small x


@KL_ESTIMATORS.register("k3+")
def k3_plus(logp, ref_logp):
    a, b = k2(logp, ref_logp), k3(logp, ref_logp)
    return a - sg(a) + sg(b)
