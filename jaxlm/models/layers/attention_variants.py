"""Attention variants that change how scores become weights (registered in ``ATTENTION``).

- ``affine_scaled``: Affine-Scaled Attention (Bae, Park et al., arXiv 2602.23057). The paper's
  formula was not public; jaxlm implements the parameterisation of the method card (3.2,
  marked inferred): ``o_i = sum_{j visible} (s_i a_ij + b_i) v_j`` with per-head,
  input-dependent ``s_i = psi_s(w_s . x_i)`` and either a free bias
  ``b_i = (w_b . x_i) / n_i`` or the mass-conserving coupled bias ``b_i = (1 - s_i) / n_i``
  (``ModelConfig.affine_bias``; ``n_i`` = visible keys). Computed in the efficient form
  ``s_i * attention(q, k, v)_i + (n_i b_i) * mean_{visible} v`` so a fused attention kernel
  stays usable: ``attention(q, k, v)`` is `Attention.softmax_attention` (the probability-free
  paths unless the weights are asked for). ``w_s = w_b = 0`` at init, and ``psi_s(0) = 1``: the
  model starts exactly as softmax attention.
- ``sink``: a learnable per-head sink logit in the softmax denominator (the baseline the paper
  compares against; as in GPT-OSS / StreamingLLM's sink): ``a_ij = exp(l_ij) / (exp(z_h) +
  sum_j exp(l_ij))``. ``z_h = -inf`` is exactly softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.layers.attention import (
    _MASKED,
    ATTENTION,
    Attention,
    attention_context,
    attention_scores,
    grouped_mask,
    weighted_values,
)
from jaxlm.models.layers.linear import param


def visible_mean_values(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *,
                        impl: str = "reference") -> tuple[jax.Array, jax.Array]:
    """Mean of the visible values per query, ``[B, T, N, H]`` (0 for a query that sees no key),
    and the count ``n_i`` ``[B, T, N]`` (the uniform-attention term; a causal running mean when
    the mask is causal). The mean is attention with all-zero logits, run by the same ``impl``
    as the softmax term (`attention_context`), so a chunked or fused path keeps its memory:
    the weights were a dense ``[B, K, G, T, S]`` float32 array kept for the backward pass."""
    B, T, N, _ = q.shape
    n = jnp.broadcast_to(jnp.sum(mask, axis=-1, dtype=jnp.float32), (B, N, T)).transpose(0, 2, 1)
    mean_v = attention_context(jnp.zeros_like(q), k, v, mask, scale=1.0, impl=impl)
    return jnp.where((n > 0)[..., None], mean_v, jnp.zeros((), mean_v.dtype)), n


@ATTENTION.register("affine_scaled")
class AffineScaledAttention(Attention):
    def __init__(self, config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        self.scale_proj = param(jnp.zeros((c.d_model, c.n_heads), c.weight_dtype), ("embed", None))
        self.bias_proj = param(jnp.zeros((c.d_model, c.n_heads), c.weight_dtype), ("embed", None))

    def affine_terms(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-token, per-head ``s`` and the pre-normalisation bias ``z_b`` (``[B, T, N]``)."""
        x = inputs.astype(jnp.float32)
        z_s = x @ self.scale_proj[...].astype(jnp.float32)
        s = 2.0 * jax.nn.sigmoid(z_s) if self.config.affine_scale_act == "sigmoid2" else jnp.exp(z_s)
        return s, x @ self.bias_proj[...].astype(jnp.float32)

    def attend(self, q, k, v, mask, inputs=None, *, need_probs: bool = True):
        """The returned probabilities (the ``attn_probs`` tap) are the softmax weights
        ``a_ij``; the weights applied to the values are ``s_i a_ij + b_i`` (`affine_terms`)."""
        c = self.config
        ctx, probs = self.softmax_attention(q, k, v, mask, need_probs=need_probs)
        s, z_b = self.affine_terms(inputs)
        mean_v, _ = visible_mean_values(q, k, v, mask, impl=c.attention_impl)
        # b_i * sum_j v_j = (n_i b_i) * mean_j v_j; free: n_i b_i = z_b; coupled: 1 - s_i
        total_bias = z_b if c.affine_bias == "free" else 1.0 - s
        out = s[..., None] * ctx.astype(jnp.float32) + total_bias[..., None] * mean_v.astype(jnp.float32)
        return out.astype(q.dtype), probs


def affine_scaled_naive(q, k, v, mask, s, z_b, *, scale: float, coupled: bool):
    """``sum_j (s_i a_ij + b_i) v_j`` with the weights formed explicitly (test reference)."""
    B, T, N, H = q.shape
    K = k.shape[1]
    logits = jnp.where(grouped_mask(mask, K), attention_scores(q, k, scale), _MASKED)
    a = jax.nn.softmax(logits, axis=-1).reshape(B, N, T, -1)
    m = jnp.broadcast_to(grouped_mask(mask, K), logits.shape).reshape(B, N, T, -1).astype(jnp.float32)
    n = m.sum(-1)
    s_, zb = s.transpose(0, 2, 1), z_b.transpose(0, 2, 1)  # [B, N, T]
    b = (1.0 - s_) / n if coupled else zb / n
    w = (s_[..., None] * a + b[..., None]) * m
    v_full = jnp.repeat(v, N // K, axis=1)  # [B, N, S, H]
    return jnp.einsum("bnts,bnsh->btnh", w, v_full.astype(jnp.float32))


@ATTENTION.register("sink")
class SinkAttention(Attention):
    def __init__(self, config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.sink = param(jnp.full((config.n_heads,), config.sink_init, jnp.float32), (None,))

    def attend(self, q, k, v, mask, inputs=None, *, need_probs: bool = True):
        """The sink enters the softmax denominator, so this variant always forms the weights."""
        c = self.config
        B, T, N, H = q.shape
        K = k.shape[1]
        logits = jnp.where(grouped_mask(mask, K), attention_scores(q, k, c.head_dim**-0.5), _MASKED)
        sink = self.sink[...].astype(jnp.float32).reshape(1, K, N // K, 1, 1)
        sink = jnp.broadcast_to(sink, logits.shape[:-1] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
        return weighted_values(probs, v).astype(q.dtype), probs.reshape(B, N, T, -1)
