"""Fused block transform + activation quantization: ``x [M, K]`` -> 4-bit codes + block scales.

Each ``block``-wide slice ``x_i`` of a row is transformed, ``y_i = T_i x_i``, then
quantized with its own scale, in one pass over ``x``:
- ``transform=None``: identity (plain RTN quantization);
- a shared ``[B, B]`` matrix (e.g. the normalised Hadamard, as in QuaRot/FP-Quant);
- a distinct ``[K/B, B, B]`` matrix per block, as WUSH needs (A1 in the quantization card).
The shared and per-block paths run the same batched product (the shared matrix is
broadcast over blocks in-kernel), so a per-block transform whose blocks all equal the
shared one gives bit-identical codes and scales (tested).

Formats: ``mxfp4`` (E2M1 + E8M0, exponent rule ``ocp | ceil | alpha3``) and ``nvfp4``
(E2M1 + E4M3 with a given FP32 tensor scale: one scalar, or one per row ``[M]`` so rows of
different tensors, e.g. the sequences of a batch, quantize in one call). Outputs are packed
like weights (even element in the low nibble) and are consumed by `kernels_pallas.w4a4`.

Grid over row-blocks; each program holds whole rows (full-width blocks keep Mosaic's
(8, 128) tiling rule satisfied). Tested in interpret mode; the compiled GPU/TPU lowering is not yet verified on hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import formats as F


def _quantize_blocks(y, gscale, *, fmt: str, rule: str):
    """``y [..., nb, B]`` (transformed) -> (codes [..., nb, B], scales [..., nb])."""
    amax = jnp.max(jnp.abs(y), axis=-1)
    if fmt == "mxfp4":
        e = F.e8m0_exponent(amax, rule)
        v = F.times_pow2(y, -e[..., None])
        if rule == "alpha3":
            v = v * 3.0
        return F.e2m1_encode(v), F.e8m0_encode(e)
    if fmt == "nvfp4":
        s = F.e4m3_block_scale(amax / (F.E2M1_MAX * gscale))
        denom = s.astype(jnp.float32) * gscale
        safe = jnp.where(denom > 0, denom, 1.0)
        v = jnp.where(denom[..., None] > 0, y / safe[..., None], 0.0)
        return F.e2m1_encode(v), s
    raise ValueError(f"fmt={fmt!r} is invalid: must be 'mxfp4' or 'nvfp4'")


def _pack_last(codes):
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def _transform(xb, t, mode):
    if mode == "none":
        return xb
    if mode == "shared":
        t = jnp.broadcast_to(t[None], (xb.shape[-2],) + t.shape)
    return jnp.einsum("mnb,nbc->mnc", xb, t, preferred_element_type=jnp.float32)


def _row_scales(global_scale, M):
    """A scalar or per-row ``[M]`` tensor scale -> ``[M, 1]`` float32."""
    g = jnp.asarray(global_scale, jnp.float32)
    if g.ndim == 0:
        return jnp.broadcast_to(g, (M, 1))
    if g.shape != (M,):
        raise ValueError(f"global_scale has shape {g.shape}: expected a scalar or one per row ({M},)")
    return g.reshape(M, 1)


def reference(x, transform=None, *, fmt="mxfp4", rule="ocp", global_scale=1.0, block=None):
    """jnp reference: ``(codes [M, K/2] uint8, scales [M, K/B])``."""
    block = block or (32 if fmt == "mxfp4" else 16)
    M, K = x.shape
    xb = x.astype(jnp.float32).reshape(M, K // block, block)
    mode, tt = _mode_and_tt(transform, K, block)
    y = _transform(xb, tt, mode)
    codes, scales = _quantize_blocks(y, _row_scales(global_scale, M), fmt=fmt, rule=rule)
    return _pack_last(codes.reshape(M, K)), scales


def _mode_and_tt(transform, K, block):
    """Transform -> (mode, transposed matrices for the row-vector product ``x_b @ T^T``)."""
    if transform is None:
        return "none", jnp.zeros((1, 1), jnp.float32)
    t = jnp.asarray(transform, jnp.float32)
    if t.shape == (block, block):
        return "shared", t.T
    if t.shape == (K // block, block, block):
        return "per_block", jnp.swapaxes(t, -1, -2)
    raise ValueError(
        f"transform shape {t.shape} is invalid: expected ({block}, {block}) or ({K // block}, {block}, {block})"
    )


def _kernel(x_ref, t_ref, g_ref, c_ref, s_ref, *, block, mode, fmt, rule):
    x = x_ref[...].astype(jnp.float32)
    bm, K = x.shape
    y = _transform(x.reshape(bm, K // block, block), t_ref[...], mode)
    codes, scales = _quantize_blocks(y, g_ref[...], fmt=fmt, rule=rule)  # g: [bm, 1]
    c_ref[...] = _pack_last(codes.reshape(bm, K))
    s_ref[...] = scales


@functools.partial(jax.jit, static_argnames=("fmt", "rule", "block", "bm", "interpret"))
def transform_quantize(x, transform=None, global_scale=1.0, *, fmt="mxfp4", rule="ocp", block=None, bm=16, interpret=False):
    """Transform each ``block`` of every row of ``x [M, K]`` and quantize it.
    ``global_scale``: the NVFP4 tensor scale, a scalar or one per row ``[M]`` (ignored by
    MXFP4). Returns ``(codes [M, K/2] uint8, scales [M, K/block])``."""
    block = block or (32 if fmt == "mxfp4" else 16)
    M, K = x.shape
    if K % block:
        raise ValueError(f"K={K} is not divisible by the block {block}")
    if M == 0:  # no rows: a zero-size grid has nothing to run
        return reference(x, transform, fmt=fmt, rule=rule, global_scale=global_scale, block=block)
    mode, tt = _mode_and_tt(transform, K, block)
    Mp = -(-M // bm) * bm
    xp = jnp.pad(x, ((0, Mp - M), (0, 0)))
    g = jnp.pad(_row_scales(global_scale, M), ((0, Mp - M), (0, 0)), constant_values=1.0)  # [Mp, 1]
    scale_dtype = jnp.uint8 if fmt == "mxfp4" else jnp.float8_e4m3fn
    zero = (0,) * tt.ndim
    codes, scales = pl.pallas_call(
        functools.partial(_kernel, block=block, mode=mode, fmt=fmt, rule=rule),
        out_shape=(
            jax.ShapeDtypeStruct((Mp, K // 2), jnp.uint8),
            jax.ShapeDtypeStruct((Mp, K // block), scale_dtype),
        ),
        grid=(Mp // bm,),
        in_specs=[
            pl.BlockSpec((bm, K), lambda i: (i, 0)),
            pl.BlockSpec(tt.shape, lambda i: zero),
            pl.BlockSpec((bm, 1), lambda i: (i, 0)),
        ],
        out_specs=(
            pl.BlockSpec((bm, K // 2), lambda i: (i, 0)),
            pl.BlockSpec((bm, K // block), lambda i: (i, 0)),
        ),
        interpret=interpret,
    )(xp, tt, g)
    return codes[:M], scales[:M]
