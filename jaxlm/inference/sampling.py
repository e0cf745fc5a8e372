"""Sampling primitives shared by the decode loops (plain, speculative, early exit): an exact
two-level inverse-CDF categorical draw and the token choice with its log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _invert_cdf(key: jax.Array, mass: jax.Array) -> jax.Array:
    """Index ``i`` with probability ``mass[..., i] / mass.sum(-1)`` (``mass >= 0``): the first
    index whose running sum exceeds a uniform draw; the heaviest entry if rounding leaves none."""
    cdf = jnp.cumsum(mass, axis=-1)
    u = jax.random.uniform(key, mass.shape[:-1] + (1,), jnp.float32) * cdf[..., -1:]
    above = cdf > u
    return jnp.where(jnp.any(above, -1), jnp.argmax(above, -1), jnp.argmax(mass, -1))


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
    mass = jnp.exp(logits - top)
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
        token, processed_lse = jnp.argmax(processed, axis=-1), None
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
