"""Attention masks as booleans ``[B, 1 | N, T, S]`` (True = may attend).

The forward's ``mask`` argument is either a padding mask ``[B, T]`` (which new
tokens are real; causality is added) or a full mask ``[B, T, S]`` / ``[B, 1|N, T, S]``
that is used as given (bidirectional, prefix-LM, packed or graph masks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def build_attention_mask(
    *,
    kv_valid: jax.Array,
    q_start: jax.Array | int,
    num_queries: int,
    full_mask: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Combine slot validity with causality (and a sliding window) or with a given full mask.

    kv_valid: ``[B, S]`` which key slots hold real tokens.
    q_start: slot of the first query (the cache's write index; 0 without a cache), or ``[B]``
      with one per row (a cache with per-row write slots).
    Sliding window (Mistral; Beltagy et al. 2020): a query sees the last ``sliding_window``
    real tokens, itself included: key ``j`` only if ``n_i - n_j < sliding_window``, with
    ``n`` a slot's count of real tokens before it. Padding slots take no room in the window,
    also where they sit between real ones (a padded chunk appended to a cache); without such
    gaps this is HF's slot rule ``i - j < sliding_window``.
    """
    B, S = kv_valid.shape
    allowed = kv_valid[:, None, None, :]
    if full_mask is None:
        q_start = jnp.asarray(q_start)
        q_idx = q_start.reshape(-1, 1, 1) + jnp.arange(num_queries)[None, :, None]  # [1 | B, T, 1]
        kv_idx = jnp.arange(S)[None, None, :]
        rel = kv_idx <= q_idx
        if sliding_window is not None:
            n = jnp.cumsum(kv_valid.astype(jnp.int32), axis=1)  # [B, S] real tokens up to each slot
            q_slots = jnp.clip(jnp.broadcast_to(q_idx[..., 0], (B, num_queries)), 0, S - 1)
            n_q = jnp.take_along_axis(n, q_slots, axis=1)  # [B, T]
            rel = rel & (n_q[:, :, None] - n[:, None, :] < sliding_window)
        return allowed & rel[:, None]
    if full_mask.ndim == 3:
        full_mask = full_mask[:, None]
    return allowed & full_mask.astype(bool)


def segment_mask(segment_ids: jax.Array, *, sliding_window: int | None = None) -> jax.Array:
    """Block-diagonal causal mask ``[B, 1, T, T]`` for packed rows: token ``i`` sees token
    ``j <= i`` only in the same document (segment id > 0; 0 marks padding)."""
    T = segment_ids.shape[1]
    i = jnp.arange(T)[:, None]
    j = jnp.arange(T)[None, :]
    allowed = (j <= i)[None]
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)[None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids > 0)[:, None, :]
    return (allowed & same & real)[:, None]
