"""Sampling primitives shared by the decode loops (plain, speculative, early exit): the
greedy choice (`argmax_last`), an exact two-level inverse-CDF categorical draw and the token
choice with its log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def first_true(hit: jax.Array) -> jax.Array:
    """The first index along the last axis where ``hit`` is True (``n`` where none is), as a
    plain min-reduction: ``jnp.argmax`` on booleans lowers to a (value, index) pair reduction
    that XLA:CPU runs several times slower."""
    n = hit.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def argmax_last(x: jax.Array, block: int = 128) -> jax.Array:
    """``jnp.argmax(x, axis=-1)``: the first index of the largest entry, or of the first NaN
    if the row has one. Computed in two levels: per block of ``block`` entries its maximum and
    whether it holds a NaN (``sum(sign(x))`` is NaN exactly then: XLA:CPU's vectorised max
    does not propagate NaN reliably), then the first block that holds the row's maximum (or
    its first NaN) and the first such position inside it. XLA:CPU lowers `jnp.argmax` to a
    (value, index) pair reduction that runs ~12x slower over a ``[64, 32000]`` array; this
    is two plain reductions in one pass over ``x`` and a read of one block per row.
    Returns int32 ``x.shape[:-1]``."""
    *lead, V = x.shape
    x = x.reshape(-1, V)
    R = x.shape[0]
    pad = (-V) % block
    if pad:  # the lowest value, after every real entry of its block: never chosen
        low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.iinfo(x.dtype).min
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=low)
    blocks = x.reshape(R, -1, block)
    block_max = jnp.max(blocks, axis=-1)  # [R, V / block]; exact in a block without NaN
    block_nan = jnp.isnan(jnp.sum(jnp.sign(blocks), axis=-1))  # sign: +-inf -> +-1, NaN -> NaN
    row_nan = jnp.any(block_nan, axis=-1, keepdims=True)  # then the first NaN wins, as in jnp.argmax
    top = jnp.max(block_max, axis=-1, keepdims=True)
    b = first_true(jnp.where(row_nan, block_nan, block_max == top))
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [R, block]
    j = first_true(jnp.where(row_nan, jnp.isnan(inner), inner == top))
    return (b * block + j).reshape(lead)


def _invert_cdf(key: jax.Array, mass: jax.Array) -> jax.Array:
    """Index ``i`` with probability ``mass[..., i] / mass.sum(-1)`` (``mass >= 0``): the first
    index whose running sum exceeds a uniform draw; the heaviest entry if rounding leaves none."""
    cdf = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, mass.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    index = first_true(cdf > u)
    return jnp.where(index < mass.shape[-1], index, argmax_last(mass))


def sample_categorical(key: jax.Array, logits: jax.Array, block: int = 128) -> jax.Array:
    """One exact draw per row from ``softmax(logits)``, inverting the CDF in two levels.

    First a block of ``block`` tokens is drawn by its total mass, then a token within
    it by its own: P(token) = P(block) P(token | block). This needs two uniforms per row
    instead of the ``B x V`` Gumbel noise of `jax.random.categorical` (whose threefry bits
    cost more than a decode step on CPU), and cumulative sums over ``V / block`` and
    ``block`` entries instead of ``V`` (a 32k-long cumsum takes ~3 ms on CPU).
    Masked (-inf) entries have zero mass and are never drawn.
    """
    return categorical_and_logsumexp(key, logits, block)[0]


def categorical_and_logsumexp(key: jax.Array, logits: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`sample_categorical`'s draw ``[B]`` and ``logsumexp(logits) [B]`` from the same
    ``exp(logits - max)`` (one pass over the vocabulary instead of two)."""
    B, V = logits.shape
    logits = logits.astype(jnp.float32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    # the largest entry has mass exactly 1 (exp of a fused, rounded logits - top could be 0)
    mass = jnp.where((logits == top) & jnp.isfinite(top), 1.0, jnp.exp(logits - top))
    mass = jnp.pad(mass, ((0, 0), (0, (-V) % block))).reshape(B, -1, block)
    k_block, k_token = jax.random.split(key)
    block_mass = mass.sum(-1)  # [B, V / block]
    chosen = _invert_cdf(k_block, block_mass)  # [B]
    inner = jnp.take_along_axis(mass, chosen[:, None, None], axis=1)[:, 0]  # [B, block]
    lse = top[:, 0] + jnp.log(block_mass.sum(-1))
    return chosen * block + _invert_cdf(k_token, inner), lse


def _select(logits, processed, key, greedy: bool, same: bool = False):
    """Choose a token per row; its log-prob under the raw and the processed distribution
    (``same``: no processors, the two are one)."""
    if greedy:
        token, processed_lse = argmax_last(processed), None
    else:
        token, processed_lse = categorical_and_logsumexp(key, processed)
    token = token.astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(x, token[:, None], axis=-1)[:, 0]
    if same and processed_lse is not None:
        raw = pick(logits) - processed_lse
        return token, raw, raw
    raw = pick(logits) - jax.nn.logsumexp(logits, axis=-1)
    if same:
        return token, raw, raw
    if processed_lse is None:
        processed_lse = jax.nn.logsumexp(processed, axis=-1)
    return token, raw, pick(processed) - processed_lse
