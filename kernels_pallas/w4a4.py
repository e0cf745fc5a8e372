"""W4A4 matmul: 4-bit activations (from `block_quant.transform_quantize`) times 4-bit weights.

Both operands are packed along K (even k in the low nibble) with block scales along K.
Hardware without FP4 matrix units (e.g. H200, CPUs) is emulated: each K-tile of both
operands is dequantised in-kernel to ``compute_dtype`` (E2M1 x E8M0/E4M3 values are exact in
bf16) and multiplied with float32 accumulation; tensor scales and alphas are applied once in
the epilogue. Tested in interpret mode; the compiled GPU/TPU lowering is not yet verified on hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import w4a16
from kernels_pallas.formats import DECODERS, apply_scales, dequantize_packed_rows


def _dequantize_packed_cols(codes, scales, *, element, block, scale_kind):
    """Activation codes ``[M, K/2]`` (even k low nibble), scales ``[M, K/block]`` ->
    even-column and odd-column values ``[M, K/2]`` each (float32)."""
    decode = DECODERS[element]
    M, nb = scales.shape
    s = jnp.broadcast_to(scales[:, :, None], (M, nb, block // 2)).reshape(M, nb * block // 2)
    return apply_scales(decode(codes & 0xF), s, scale_kind), apply_scales(decode(codes >> 4), s, scale_kind)


def reference(xc, xs, xg, wc, ws, wg, *, x_fmt, w_fmt, alpha=1.0, compute_dtype=jnp.bfloat16, out_dtype=jnp.float32):
    """Dequantize both operands fully, then one float32-accumulated matmul."""
    xe, xo = _dequantize_packed_cols(xc, xs, **x_fmt)
    x = jnp.stack([xe, xo], axis=-1).reshape(xe.shape[0], -1).astype(compute_dtype)
    w = w4a16.dequantize_reference(wc, ws, 1.0, **w_fmt, dtype=compute_dtype)
    acc = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return (acc * (jnp.float32(xg) * jnp.float32(wg) * alpha)).astype(out_dtype)


def _kernel(xc_ref, xs_ref, wc_ref, ws_ref, g_ref, o_ref, *, x_fmt, w_fmt, alpha, bk, compute_dtype):
    hk = bk // 2
    n_steps = xc_ref.shape[1] // hk
    xb, wb = x_fmt["block"], w_fmt["block"]

    def body(k, acc):
        xe, xo = _dequantize_packed_cols(
            xc_ref[:, pl.ds(k * hk, hk)], xs_ref[:, pl.ds(k * (bk // xb), bk // xb)], **x_fmt
        )
        we, wo = dequantize_packed_rows(
            wc_ref[pl.ds(k * hk, hk), :], ws_ref[pl.ds(k * (bk // wb), bk // wb), :], **w_fmt
        )
        acc += jnp.dot(xe.astype(compute_dtype), we.astype(compute_dtype), preferred_element_type=jnp.float32)
        acc += jnp.dot(xo.astype(compute_dtype), wo.astype(compute_dtype), preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (acc * (g_ref[0, 0] * alpha)).astype(o_ref.dtype)


def w4a4_matmul(xc, xs, xg, wc, ws, wg, *, x_fmt: dict, w_fmt: dict, alpha: float = 1.0, bm: int | None = None,
                bn: int = 128, bk: int = 256, interpret: bool = False, compute_dtype=jnp.bfloat16,
                out_dtype=jnp.float32):
    """``x_fmt`` / ``w_fmt``: ``dict(element=, block=, scale_kind=)`` of each operand."""
    return _w4a4(xc, xs, xg, wc, ws, wg, x_fmt=tuple(sorted(x_fmt.items())), w_fmt=tuple(sorted(w_fmt.items())),
                 alpha=alpha, bm=bm, bn=bn, bk=bk, interpret=interpret, compute_dtype=compute_dtype,
                 out_dtype=out_dtype)


@functools.partial(
    jax.jit,
    static_argnames=("x_fmt", "w_fmt", "alpha", "bm", "bn", "bk", "interpret", "compute_dtype", "out_dtype"),
)
def _w4a4(xc, xs, xg, wc, ws, wg, *, x_fmt, w_fmt, alpha, bm, bn, bk, interpret, compute_dtype, out_dtype):
    x_fmt, w_fmt = dict(x_fmt), dict(w_fmt)
    M, K2 = xc.shape
    K, N = 2 * K2, wc.shape[1]
    xb, wb = x_fmt["block"], w_fmt["block"]
    if K % xb or K % wb:
        raise ValueError(f"K={K} is not divisible by the activation block {xb} and the weight block {wb}")
    if wc.shape[0] * 2 != K or xs.shape != (M, K // xb) or ws.shape != (K // wb, N):
        raise ValueError(f"operands do not match: activation codes {xc.shape} / scales {xs.shape} (K={K}, block "
                         f"{xb}), weight codes {wc.shape} / scales {ws.shape} (block {wb}); expected weight codes "
                         f"({K // 2}, N), activation scales ({M}, {K // xb}), weight scales ({K // wb}, {N})")
    if bk % xb or bk % wb:
        raise ValueError(f"bk={bk} must be a multiple of both blocks")
    if M == 0:  # no rows: a zero-size grid has nothing to run
        return jnp.zeros((0, N), out_dtype)
    bm = bm or w4a16.default_bm(M)
    Mp, Np, Kp = (-(-M // bm) * bm), (-(-N // bn) * bn), (-(-K // bk) * bk)
    xc = jnp.pad(xc, ((0, Mp - M), (0, (Kp - K) // 2)))
    xs = jnp.pad(xs, ((0, Mp - M), (0, (Kp - K) // x_fmt["block"])))
    wc = jnp.pad(wc, ((0, (Kp - K) // 2), (0, Np - N)))
    ws = jnp.pad(ws, ((0, (Kp - K) // w_fmt["block"]), (0, Np - N)))
    g = (jnp.asarray(xg, jnp.float32) * jnp.asarray(wg, jnp.float32)).reshape(1, 1)
    out = pl.pallas_call(
        functools.partial(_kernel, x_fmt=x_fmt, w_fmt=w_fmt, alpha=alpha, bk=bk, compute_dtype=compute_dtype),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype),
        grid=(Mp // bm, Np // bn),
        in_specs=[
            pl.BlockSpec((bm, Kp // 2), lambda i, j: (i, 0)),
            pl.BlockSpec((bm, Kp // x_fmt["block"]), lambda i, j: (i, 0)),
            pl.BlockSpec((Kp // 2, bn), lambda i, j: (0, j)),
            pl.BlockSpec((Kp // w_fmt["block"], bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
    )(xc, xs, wc, ws, g)
    return out[:M, :N]
