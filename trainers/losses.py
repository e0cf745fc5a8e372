"""SFT losses as (sum, count) pairs, so accumulation and data parallelism stay exact.

``TOKEN_WEIGHTS`` maps a config string to ``weights(batch, logits) -> [B, T]`` per-token
weights (no gradient flows through them). Importance-reweighted SFT (PEAR) and selective
entropy minimisation (SEM) plug in here.
"""

from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.registry import Registry

TOKEN_WEIGHTS: Registry = Registry("token weights")


@TOKEN_WEIGHTS.register("uniform")
def uniform_weights(batch, logits) -> jax.Array:
    return jnp.ones(batch["tokens"].shape, jnp.float32)


def next_token_targets(batch) -> tuple[jax.Array, jax.Array]:
    """Targets ``tokens[t + 1]`` and where they count: the target is trained
    (``loss_mask``), in the same document as position t, and not padding."""
    tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    valid = mask[:, 1:] & (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    valid = jnp.concatenate([valid, jnp.zeros_like(valid[:, :1])], axis=1)
    return targets, valid


@jax.custom_vjp
def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def _nll_fwd(logits, targets):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked, (logits, targets, lse)


def _nll_bwd(res, g):
    # d/dlogits (lse - logits[target]) = softmax(logits) - onehot(target), in one elementwise
    # pass over the saved logits (autodiff keeps exp(logits - max) and scatters the one-hot
    # into a zero [..., V] buffer)
    logits, targets, lse = res
    onehot = targets[..., None] == jnp.arange(logits.shape[-1], dtype=targets.dtype)
    dlogits = g[..., None] * (jnp.exp(logits - lse[..., None]) - onehot.astype(logits.dtype))
    return dlogits, np.zeros(targets.shape, jax.dtypes.float0)


_nll.defvjp(_nll_fwd, _nll_bwd)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log softmax(logits)[target]`` per position, float32 ``[B, T]`` (the cross-entropy;
    its gradient is ``softmax - onehot``, written in one pass over the logits)."""
    return _nll(logits.astype(jnp.float32), targets)


def sft_loss_sum(logits, batch, weight_fn=uniform_weights) -> tuple[jax.Array, jax.Array]:
    """(sum over trained tokens of weight x NLL, number of trained tokens)."""
    targets, valid = next_token_targets(batch)
    weights = jax.lax.stop_gradient(weight_fn(batch, logits))
    nll = token_nll(logits, targets)
    total = jnp.sum(jnp.where(valid, weights * nll, 0.0))
    return total, valid.sum(dtype=jnp.float32)


def token_entropy(logits: jax.Array) -> jax.Array:
    """``H_t = -sum_v p log p`` per position, float32 ``[B, T]`` (differentiable; a ``-inf``
    logit, a banned token, contributes ``0 log 0 = 0``)."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(lp) * jnp.where(jnp.isneginf(lp), 0.0, lp), axis=-1)


def sem_weights(entropy: jax.Array, valid: jax.Array, threshold: float) -> jax.Array:
    """Selective entropy minimisation's soft weights (ReQAT, ``SEMTrainer.masked_ce``):
    ``w_t = max(0, 1 - (H_t - H_min) / (tau - H_min + 1e-12))`` with ``tau`` the k-th
    smallest entropy among the trained tokens, ``k = floor(N * threshold)`` (at least 1), so
    the most confident tokens get the largest weight and tokens above ``tau`` none."""
    h = jnp.where(valid, entropy, jnp.inf).ravel()
    n = valid.sum(dtype=jnp.int32)
    # floor(N * threshold) in integers, threshold as the fraction it is written as (0.65 = 13/20):
    # float32's 0.65 is 0.6499999762, and floor(180 * it) would be 116, not 117. Exact for
    # denominators up to 46340 (every threshold with at most four decimals), where
    # (N mod den) * num stays inside int32
    frac = fractions.Fraction(str(float(threshold))).limit_denominator(46340)
    num, den = frac.numerator, frac.denominator
    k = jnp.maximum((n // den) * num + (n % den) * num // den, 1)
    ordered = jnp.sort(h)
    h_min, tau = ordered[0], ordered[k - 1]
    w = jnp.maximum(0.0, 1.0 - (entropy - h_min) / (tau - h_min + 1e-12))
    return jnp.where(valid, w, 0.0)


def sem_entropy_sum(logits, batch, threshold: float) -> jax.Array:
    """``sum_t w_t H_t`` over the trained tokens, ``w`` without gradient; added as
    ``lambda * sem_entropy_sum`` to the CE sum, the loss is ``L_CE + lambda (1/N) sum_t w_t H_t``.
    Under gradient accumulation ``tau`` is per micro-batch (the reference computes it per batch)."""
    _, valid = next_token_targets(batch)
    entropy = token_entropy(logits)
    w = jax.lax.stop_gradient(sem_weights(jax.lax.stop_gradient(entropy), valid, threshold))
    return jnp.sum(w * jnp.where(valid, entropy, 0.0))
