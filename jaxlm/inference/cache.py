"""The KV cache: an explicit pytree returned by every forward pass that takes one.

Layout: keys and values stacked over layers, ``[L, B, K, S, H]`` (``H`` is
``qk_head_dim`` for keys and ``v_head_dim`` for values: both ``head_dim`` unless the
heads were compressed, `jaxlm.compress`; a scanned model
scans over the leading axis; heads before slots keeps each head's keys contiguous
for the decode-time attention matmuls), plus per-slot validity ``[B, S]``, the next
write slot ``end_index`` (shared by the batch: prompts are left-padded) and the
per-sequence count of real tokens ``lengths [B]`` (the next RoPE position).
Writes are `lax.dynamic_update_slice` at ``end_index``. ``end_index`` may instead be ``[B]``,
one write slot per row (`per_row`): speculative decoding commits a different number of
tokens per row and rolls each row back on its own (`jaxlm.inference.speculative`).

With per-layer key/value widths (``ModelConfig.layer_qk_head_dims`` / ``layer_v_head_dims``,
A^3 with mixed ranks; unrolled layers only) ``k`` and ``v`` are instead tuples of ``L`` arrays
``[B, K, S, H_i]``, so the cache holds exactly each layer's width. Code that touches the batch
axis of ``k`` / ``v`` maps over both layouts with `jax.tree.map` and `batch_axis`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxlm.dtypes import dtype_name


@struct.dataclass
class KVCache:
    k: jax.Array | tuple[jax.Array, ...]  # [L, B, K, S, qk_head_dim], or per layer [B, K, S, H_i]
    v: jax.Array | tuple[jax.Array, ...]  # [L, B, K, S, v_head_dim], or per layer [B, K, S, H_i]
    valid: jax.Array  # [B, S] bool: slot holds a real token
    end_index: jax.Array  # [] int32: next slot to write (or [B]: one per row)
    lengths: jax.Array  # [B] int32: real tokens so far per sequence

    @classmethod
    def init(cls, config, batch_size: int, max_len: int, dtype=None, *, per_layer: bool = False) -> "KVCache":
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` slots, in ``dtype``
        (a name or a jnp/numpy dtype; default: the model's compute dtype).

        ``per_layer=True`` stores one ``[B, K, S, H]`` array per layer even when the widths
        agree (unrolled layers only): each layer then writes and reads its own buffer, with
        no slice of a stacked array to copy per layer and token (the decode loop's layout)."""
        if max_len > config.max_seq_len:
            raise ValueError(
                f"cache max_len={max_len} exceeds ModelConfig.max_seq_len={config.max_seq_len}"
            )
        if per_layer and config.scan_layers:
            raise ValueError(
                "KVCache.init(per_layer=True) needs ModelConfig.scan_layers=False (a scanned model "
                "scans over the stacked [L, ...] cache)"
            )
        dtype = jnp.dtype(config.dtype if dtype is None else dtype_name(dtype, field="KVCache dtype"))
        if config.per_layer_kv or per_layer:  # one array per layer, each of its own width
            layers = [config.layer_config(i) for i in range(config.n_layers)]
            shape = (batch_size, config.n_kv_heads, max_len)
            return cls(
                k=tuple(jnp.zeros((*shape, c.qk_head_dim), dtype) for c in layers),
                v=tuple(jnp.zeros((*shape, c.v_head_dim), dtype) for c in layers),
                valid=jnp.zeros((batch_size, max_len), bool),
                end_index=jnp.zeros((), jnp.int32),
                lengths=jnp.zeros((batch_size,), jnp.int32),
            )
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len)
        return cls(
            k=jnp.zeros((*shape, config.qk_head_dim), dtype),
            v=jnp.zeros((*shape, config.v_head_dim), dtype),
            valid=jnp.zeros((batch_size, max_len), bool),
            end_index=jnp.zeros((), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0] if isinstance(self.k, tuple) else self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if isinstance(self.k, tuple) else self.k.shape[3]

    @property
    def is_per_layer(self) -> bool:
        """Keys/values are a tuple of per-layer arrays ``[B, K, S, H_i]``."""
        return isinstance(self.k, tuple)

    def stacked(self) -> "KVCache":
        """The same cache with keys/values stacked ``[L, B, K, S, H]`` (they must share a width)."""
        if not self.is_per_layer:
            return self
        return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    def grow(self, max_len: int) -> "KVCache":
        """The same cache with room for ``max_len`` slots: empty (invalid) slots appended.
        A decode loop that runs in segments grows its cache between them, so that each step
        reads only the slots its segment can reach."""
        extra = max_len - self.max_len
        if extra < 0:
            raise ValueError(f"KVCache.grow({max_len}) would shrink the cache of {self.max_len} slots")
        if extra == 0:
            return self

        def pad(x):  # [..., S, H]: slots on the second-to-last axis in both layouts
            return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)])

        return self.replace(k=jax.tree.map(pad, self.k), v=jax.tree.map(pad, self.v),
                            valid=jnp.pad(self.valid, ((0, 0), (0, extra))))

    def take_rows(self, rows: jax.Array) -> "KVCache":
        """The cache of sequences ``rows [B']`` (int indices into this cache's batch): beam
        search's reorder after each step, or ``G`` copies of each prompt's cache."""
        take = lambda x: jnp.take(x, rows, axis=batch_axis(x))  # noqa: E731
        end = self.end_index[rows] if self.per_row_index else self.end_index
        return self.replace(k=jax.tree.map(take, self.k), v=jax.tree.map(take, self.v),
                            valid=self.valid[rows], lengths=self.lengths[rows], end_index=end)

    @property
    def per_row_index(self) -> bool:
        """Each row has its own write slot (``end_index`` is ``[B]``)."""
        return self.end_index.ndim == 1

    def per_row(self) -> "KVCache":
        """The same cache with one write slot per row (``end_index [B]``)."""
        if self.per_row_index:
            return self
        return self.replace(end_index=jnp.broadcast_to(self.end_index, (self.batch_size,)).astype(jnp.int32))

    def truncate(self, end_index: jax.Array, lengths: jax.Array) -> "KVCache":
        """Roll each row back to ``end_index [B]`` (next write slot) and ``lengths [B]``
        (next RoPE position): slots at or past ``end_index`` stop being valid. Their
        keys/values stay in the buffer but are never read (invalid) and the next write
        overwrites them."""
        slots = jnp.arange(self.max_len, dtype=jnp.int32)[None, :]
        return self.replace(valid=self.valid & (slots < end_index[:, None]), end_index=end_index.astype(jnp.int32),
                            lengths=lengths.astype(jnp.int32))

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values (all layers)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves((self.k, self.v)))


def batch_axis(x) -> int:
    """The batch axis of a cache key/value array: 1 stacked ``[L, B, K, S, H]``, 0 per layer
    ``[B, K, S, H]`` (use with ``jax.tree.map`` over ``cache.k`` / ``cache.v``)."""
    return x.ndim - 4


@struct.dataclass
class LayerKV:
    """Write access to layer ``layer`` of the stacked cache, handed to an attention layer.

    `write` updates the stacked arrays in place (one `dynamic_update_slice` of the new
    tokens) *before* the layer's keys/values are read back, so XLA never has to copy
    the cache to keep an old version alive.
    """

    k: jax.Array  # [L, B, K, S, H]; or this layer's own [B, K, S, H] when ``layer`` is None
    v: jax.Array
    layer: jax.Array | None  # [] int32; None: k / v are this layer's arrays (per-layer cache)
    index: jax.Array  # [] int32: first slot to write; [B]: one per row

    def write(self, k_new: jax.Array, v_new: jax.Array) -> tuple["LayerKV", jax.Array, jax.Array]:
        """Store ``[B, K, T, H]`` keys/values; return the updated cache and this layer's
        full ``[B, K, S, H]`` keys and values."""
        if self.index.ndim == 1:
            return self._write_rows(k_new, v_new)
        if self.layer is None:
            start = (0, 0, self.index, 0)
            k = jax.lax.dynamic_update_slice(self.k, k_new.astype(self.k.dtype), start)
            v = jax.lax.dynamic_update_slice(self.v, v_new.astype(self.v.dtype), start)
            return self.replace(k=k, v=v), k, v
        start = (self.layer, 0, 0, self.index, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_new[None].astype(self.k.dtype), start)
        v = jax.lax.dynamic_update_slice(self.v, v_new[None].astype(self.v.dtype), start)
        return self.replace(k=k, v=v), k[self.layer], v[self.layer]

    def _write_rows(self, k_new, v_new):
        """`write` with one start slot per row (a scatter of each row's ``T`` slots)."""
        def put(buf, new):  # buf [B, K, S, H], new [B, K, T, H]
            return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice(b, n, (0, i, 0)))(
                buf, new.astype(buf.dtype), self.index)

        if self.layer is None:
            k, v = put(self.k, k_new), put(self.v, v_new)
            return self.replace(k=k, v=v), k, v
        k_layer, v_layer = put(self.k[self.layer], k_new), put(self.v[self.layer], v_new)
        k = jax.lax.dynamic_update_index_in_dim(self.k, k_layer, self.layer, 0)
        v = jax.lax.dynamic_update_index_in_dim(self.v, v_layer, self.layer, 0)
        return self.replace(k=k, v=v), k_layer, v_layer
