"""Grouped-query attention (Ainslie et al. 2023) with RoPE, optional qk-norm and a KV cache.

``ATTENTION`` maps ``ModelConfig.attention`` to a module class. A variant changes
how scores become weights by overriding `Attention.attend` (the projections,
RoPE, qk-norm and cache handling are shared); `dot_product_attention` is the
plain-softmax reference every variant is compared against.

The probabilities ``[B, N, T, S]`` are only formed when something asks for them (the
``attn_probs`` tap, a variant that needs them, ``ModelConfig.attention_impl="reference"``).
Otherwise `attention_context` computes the context alone, by the implementation
`resolve_attention_impl` picks (``ATTENTION_IMPLS``): cuDNN flash attention through
`jax.nn.dot_product_attention` on GPU, query-chunked attention with recomputation
(`chunked_attention`) for long sequences elsewhere, and the einsum path for short ones
(decoding). Every implementation gives rows with no visible key the reference's uniform
weights over all ``S`` slots (the mean of the values), never NaN.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.inference.cache import LayerKV
from jaxlm.models.layers.linear import Linear, param
from jaxlm.models.layers.norms import RMSNorm
from jaxlm.models.layers.rope import ROPE, RopeFrequencies, inv_frequencies, rotate_per_head
from jaxlm.models.taps import Taps
from jaxlm.quant.formats import fake_quant
from jaxlm.registry import Registry

ATTENTION: Registry = Registry("attention")

_MASKED = float(jnp.finfo(jnp.float32).min)

#: ``ModelConfig.attention_impl`` values: ``auto`` picks per call (`resolve_attention_impl`);
#: ``reference`` always forms the probabilities; ``chunked`` = `chunked_attention`; ``xla`` /
#: ``cudnn`` = `jax.nn.dot_product_attention` with that ``implementation``.
ATTENTION_IMPLS = ("auto", "reference", "chunked", "xla", "cudnn")
#: queries per block of `chunked_attention` (``auto`` chunks when ``T`` exceeds it)
QUERY_CHUNK = 512


def attention_scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """``scale * q k^T`` grouped by KV head: q ``[B,T,N,H]``, k ``[B,K,S,H]`` -> ``[B,K,G,T,S]`` fp32."""
    B, T, N, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    return jnp.einsum("bkgth,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale


def grouped_mask(mask: jax.Array, n_kv_heads: int) -> jax.Array:
    """``[B, 1|N, T, S]`` -> broadcastable to ``[B, K, G, T, S]``."""
    B, M, T, S = mask.shape
    if M == 1:
        return mask[:, :, None]
    return mask.reshape(B, n_kv_heads, M // n_kv_heads, T, S)


def weighted_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """``[B,K,G,T,S]`` weights x ``[B,K,S,H]`` values -> context ``[B,T,N,H]``."""
    B, K, G, T, S = probs.shape
    ctx = jnp.einsum("bkgts,bksh->bkgth", probs.astype(v.dtype), v)
    return ctx.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, v.shape[-1])


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float
) -> tuple[jax.Array, jax.Array]:
    """softmax(scale q k^T + mask) v (Vaswani et al. 2017, eq. 1), GQA by head groups.

    q ``[B, T, N, H]``; k, v ``[B, K, S, H]`` (the cache layout: heads before slots, so
    each head's keys are contiguous); mask ``[B, 1|N, T, S]`` bool. Returns the context
    ``[B, T, N, H]`` in ``q.dtype`` and the probabilities ``[B, N, T, S]`` in float32.
    Rows with no visible key get uniform weights (finite mask value) instead of NaN.
    """
    B, T, N, H = q.shape
    K = k.shape[1]
    logits = attention_scores(q, k, scale)
    logits = jnp.where(grouped_mask(mask, K), logits, _MASKED)
    probs = jax.nn.softmax(logits, axis=-1)
    return weighted_values(probs, v).astype(q.dtype), probs.reshape(B, N, T, -1)


def chunked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float, chunk: int = QUERY_CHUNK
) -> jax.Array:
    """`dot_product_attention`'s context computed at most ``chunk`` queries at a time, each block
    rematerialised in the backward pass (Rabe & Staats 2021, "Self-attention does not need
    O(n^2) memory", with query chunking only: every block sees all ``S`` keys, so its softmax
    is the exact one). Peak memory is ``[B, N, chunk, S]`` per block instead of ``[B, N, T, S]``.
    The ``ceil(T / chunk)`` blocks are of equal size, so fewer than one query per block is padding.

    Shapes as `dot_product_attention`; returns the context ``[B, T, N, H_v]`` in ``q.dtype``.
    """
    B, T, N, H = q.shape
    S = k.shape[2]
    chex.assert_rank(mask, 4)
    chex.assert_axis_dimension(mask, 2, T)
    n_blocks = -(-T // chunk)
    chunk = -(-T // n_blocks)
    pad = n_blocks * chunk - T
    M = mask.shape[1]
    mask = jnp.broadcast_to(mask, (B, M, T, S))
    if pad:  # padded queries see every key (finite rows) and are dropped below
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad), (0, 0)), constant_values=True)
    q_blocks = q.reshape(B, n_blocks, chunk, N, H).transpose(1, 0, 2, 3, 4)
    mask_blocks = mask.reshape(B, M, n_blocks, chunk, S).transpose(2, 0, 1, 3, 4)

    @jax.checkpoint
    def block(xs):
        qb, mb = xs
        return dot_product_attention(qb, k, v, mb, scale=scale)[0]

    ctx = jax.lax.map(block, (q_blocks, mask_blocks))  # [n_blocks, B, chunk, N, H_v]
    ctx = ctx.transpose(1, 0, 2, 3, 4).reshape(B, n_blocks * chunk, N, v.shape[-1])
    return ctx[:, :T]


def _cudnn_supported(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Shapes and dtypes cuDNN's fused attention takes: half precision, equal query/key/value
    widths, a multiple of 8 and at most 128."""
    H = q.shape[-1]
    return (
        q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and v.dtype == q.dtype
        and v.shape[-1] == H and H % 8 == 0 and H <= 128
    )


def resolve_attention_impl(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, *, need_probs: bool) -> str:
    """The implementation one attention call uses: ``reference`` whenever the probabilities are
    needed; for ``auto``, ``cudnn`` on GPU when it supports the shapes and there is more than one
    query, else ``chunked`` when the queries exceed `QUERY_CHUNK`, else ``reference`` (short
    blocks and decoding, where ``[B, N, T, S]`` is small and the einsums on the cache layout
    are fastest)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"ModelConfig.attention_impl={impl!r} is invalid: must be one of {ATTENTION_IMPLS}")
    if need_probs or impl == "reference":
        return "reference"
    if impl != "auto":
        return impl
    T = q.shape[1]
    if T > 1 and jax.default_backend() == "gpu" and _cudnn_supported(q, k, v):
        return "cudnn"
    if T > QUERY_CHUNK:
        return "chunked"
    return "reference"


def attention_context(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float, impl: str = "auto"
) -> jax.Array:
    """softmax(scale q k^T + mask) v without returning the probabilities, by ``impl``
    (`resolve_attention_impl`). Shapes as `dot_product_attention`; returns ``[B, T, N, H_v]``."""
    impl = resolve_attention_impl(impl, q, k, v, need_probs=False)
    if impl == "reference":
        return dot_product_attention(q, k, v, mask, scale=scale)[0]
    if impl == "chunked":
        return chunked_attention(q, k, v, mask, scale=scale, chunk=QUERY_CHUNK)
    # jax.nn takes keys/values [B, S, K, H]; rows with no visible key get its finite mask value,
    # i.e. the same uniform weights as the reference
    out = jax.nn.dot_product_attention(
        q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask.astype(bool), scale=scale,
        implementation=impl,
    )
    return out.astype(q.dtype)


@ATTENTION.register("softmax")
class Attention(nnx.Module):
    def __init__(self, config, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(std=c.init_std, param_dtype=c.weight_dtype, fake_quant=c.qat_format, rngs=rngs)
        self.q_proj = Linear(c.d_model, c.q_dim, axes=("embed", "q_heads"), use_bias=c.qkv_bias, **kw)
        self.k_proj = Linear(c.d_model, c.k_dim, axes=("embed", "kv_heads"), use_bias=c.qkv_bias, **kw)
        self.v_proj = Linear(c.d_model, c.v_dim, axes=("embed", "kv_heads"), use_bias=c.qkv_bias, **kw)
        self.o_proj = Linear(c.o_dim, c.d_model, axes=("q_heads", "embed"), **kw)
        if c.rope_pairs_selected:
            # compressed heads (A^3-QK): the original frequencies of the kept pairs, per KV head;
            # a placeholder (the first pairs) until a compression or a checkpoint sets them
            first = np.asarray(inv_frequencies(c))[: c.qk_head_dim // 2]
            freq = jnp.asarray(np.tile(first, (c.n_kv_heads, 1)), jnp.float32)
            self.rope_inv_freq = RopeFrequencies(freq, out_sharding=("kv_heads", None), eager_sharding=False)
        else:
            self.rope_inv_freq = None
        if c.k_shift:  # Q-FIT's post-RoPE key shift (ReQAT): zeros, i.e. no shift, at init
            self.k_shift = param(jnp.zeros((c.n_kv_heads, c.qk_head_dim), c.weight_dtype), ("kv_heads", "head_dim"))
        else:
            self.k_shift = None
        if c.qk_norm:  # Qwen3: RMSNorm over head_dim on q and k before RoPE
            self.q_norm = RMSNorm(c.head_dim, eps=c.norm_eps, axis_name="head_dim", param_dtype=c.weight_dtype)
            self.k_norm = RMSNorm(c.head_dim, eps=c.norm_eps, axis_name="head_dim", param_dtype=c.weight_dtype)
        else:
            self.q_norm = self.k_norm = None

    def attend(self, q, k, v, mask, inputs=None, *, need_probs: bool = True) -> tuple[jax.Array, jax.Array | None]:
        """Scores -> weights -> context, and the weights ``[B, N, T, S]`` when ``need_probs``
        (else None: the context alone, by ``ModelConfig.attention_impl``). Variants override
        this; ``inputs`` is the layer's (normed) input ``[B, T, D]`` for variants whose weights
        depend on it."""
        return self.softmax_attention(q, k, v, mask, need_probs=need_probs)

    def softmax_attention(self, q, k, v, mask, *, need_probs: bool) -> tuple[jax.Array, jax.Array | None]:
        """Plain softmax attention: the reference (with probabilities) when ``need_probs``,
        else `attention_context` by ``ModelConfig.attention_impl``."""
        scale = self.config.head_dim**-0.5
        if need_probs:
            return dot_product_attention(q, k, v, mask, scale=scale)
        return attention_context(q, k, v, mask, scale=scale, impl=self.config.attention_impl), None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        kv: LayerKV | None,
        taps: Taps,
    ) -> tuple[jax.Array, LayerKV | None]:
        """Returns the output ``[B,T,D]`` and the cache with this step's keys/values written."""
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.project(x, positions, taps)
        if kv is not None:
            kv, k, v = kv.write(k, v)
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        need_probs = "attn_probs" in taps.names
        ctx, probs = self.attend(q, k, v, mask, inputs=x, need_probs=need_probs)
        if need_probs:
            taps.put("attn_probs", probs)
        ctx = taps.put("attn_ctx", ctx.reshape(B, T, c.o_dim))
        return self.o_proj(ctx), kv

    def project(self, x: jax.Array, positions: jax.Array, taps: Taps) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B, T, N, H]`` and keys / values in the cache layout ``[B, K, T, H]`` of
        the (normed) input ``x`` at ``positions``: projections, qk-norm, RoPE, key shift and
        the simulated low-bit KV cache."""
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, c.n_heads, c.qk_head_dim)
        k = self.k_proj(x).reshape(B, T, c.n_kv_heads, c.qk_head_dim)
        v = self.v_proj(x).reshape(B, T, c.n_kv_heads, c.v_head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = taps.put("q", q), taps.put("k", k), taps.put("v", v)
        if self.rope_inv_freq is not None:
            freq = jax.lax.stop_gradient(self.rope_inv_freq[...])  # [K, qk_head_dim/2]
            q = rotate_per_head(q, positions, jnp.repeat(freq, c.n_heads // c.n_kv_heads, axis=0))
            k = rotate_per_head(k, positions, freq)
        else:
            rope = ROPE[c.rope]
            q, k = rope(q, positions, c), rope(k, positions, c)
        if self.k_shift is not None:
            # k - m: every score of a query moves by the same q.m, so softmax attention is
            # unchanged; the shifted keys are what the (quantized) cache stores
            shift = self.k_shift[...]
            if not c.k_shift_trainable:
                shift = jax.lax.stop_gradient(shift)
            k = k - shift.astype(k.dtype)
        q, k = taps.put("q_rot", q), taps.put("k_rot", k)
        if c.kv_quant is not None:  # a low-bit KV cache, simulated (straight-through)
            k, v = fake_quant(k, c.kv_quant, axis=-1).astype(k.dtype), fake_quant(v, c.kv_quant, axis=-1).astype(v.dtype)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        return q, k, v
