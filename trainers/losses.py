"""SFT losses as (sum, count) pairs, so accumulation and data parallelism stay exact.

``TOKEN_WEIGHTS`` maps a config string to ``weights(batch, logits) -> [B, T]`` per-token
weights (no gradient flows through them). Importance-reweighted SFT (PEAR) and selective
entropy minimisation (SEM) plug in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``-log softmax(logits)[target]`` per position, float32 ``[B, T]``."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def sft_loss_sum(logits, batch, weight_fn=uniform_weights) -> tuple[jax.Array, jax.Array]:
    """(sum over trained tokens of weight x NLL, number of trained tokens)."""
    targets, valid = next_token_targets(batch)
    weights = jax.lax.stop_gradient(weight_fn(batch, logits))
    nll = token_nll(logits, targets)
    total = jnp.sum(jnp.where(valid, weights * nll, 0.0))
    return total, valid.sum(dtype=jnp.float32)
