"""Grammar mask: ``where(bit(words, v), logits, -inf)``, the bitmask unpacked in-kernel.

``logits [B, V]`` and each row's packed allowed-token words ``words [B, ceil(V/32)]``
(int32, token ``v`` is bit ``v % 32`` of word ``v // 32``, the layout of XGrammar's
bitmask and of `jaxlm.inference.grammar.tables.pack_bits`). The logits are viewed as
``[B, W, 32]`` (a free reshape when ``V`` is a multiple of 32; otherwise padded), so a grid
program's ``(bb, bw, 32)`` tile lines up with its ``(bb, bw)`` tile of words and the bits
are expanded by a shift along the last axis: the ``[B, V]`` boolean mask never exists in
memory. Grid edges that overhang ``B`` or ``W`` are handled by Pallas' partial blocks.

Backends: the tests run the kernel in Pallas interpret mode on CPU against `reference`
(`jaxlm.inference.grammar.mask_backend`); the compiled lowering is not yet verified on
hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def unpack_words(words: jax.Array, vocab_size: int) -> jax.Array:
    """``[B, vocab_size]`` bool from ``words [B, W]``: bit ``v % 32`` of word ``v // 32``."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


def reference(logits: jax.Array, words: jax.Array) -> jax.Array:
    """What the kernel computes, in plain jnp."""
    return jnp.where(unpack_words(words, logits.shape[-1]), logits, jnp.asarray(-jnp.inf, logits.dtype))


def _kernel(w_ref, x_ref, o_ref):
    shift = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 2)
    bits = (w_ref[...][:, :, None] >> shift) & 1
    o_ref[...] = jnp.where(bits != 0, x_ref[...], jnp.asarray(-jnp.inf, o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("bb", "bw", "interpret"))
def masked_logits(logits: jax.Array, words: jax.Array, *, bb: int = 8, bw: int = 128,
                  interpret: bool = False) -> jax.Array:
    """``logits [B, V]`` with the tokens whose bit in ``words [B, ceil(V / 32)]`` is 0 set to
    ``-inf``. ``bb`` rows and ``bw`` words (``32 bw`` tokens) per grid program."""
    B, V = logits.shape
    W = -(-V // 32)
    if words.shape != (B, W):
        raise ValueError(f"words {words.shape} do not match logits {logits.shape}: need ({B}, {W})")
    if words.dtype != jnp.int32:
        raise ValueError(f"words must be int32, got {words.dtype}")
    x = logits if V == W * 32 else jnp.pad(logits, ((0, 0), (0, W * 32 - V)))
    x = x.reshape(B, W, 32)
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(B, bb), pl.cdiv(W, bw)),
        in_specs=[pl.BlockSpec((bb, bw), lambda i, j: (i, j)),
                  pl.BlockSpec((bb, bw, 32), lambda i, j: (i, j, 0))],
        out_specs=pl.BlockSpec((bb, bw, 32), lambda i, j: (i, j, 0)),
        interpret=interpret,
    )(words, x)
    return out.reshape(B, W * 32)[:, :V]
