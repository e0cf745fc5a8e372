"""W4A16 matmul: ``y = x @ dequant(W)`` with 4-bit block-scaled weights, dequantised in-kernel.

``x [M, K]`` (bf16/f32) times packed weight codes ``[K/2, N]`` (two per byte along K,
even k in the low nibble) with block scales ``[K/block, N]`` and a global scale. Each grid
program owns an ``(bm, bn)`` output tile and streams K in ``bk`` steps: it decodes the
codes arithmetically, applies the block scales, casts to ``x.dtype`` and accumulates
``x_even @ W_even + x_odd @ W_odd`` in float32 (x is split into even/odd columns outside
the kernel so the packed layout needs no in-kernel interleave). The full-size bf16 weight
never exists in HBM. Formats: ``e2m1`` + ``e8m0`` (MXFP4), ``e2m1`` + ``e4m3`` + fp32
tensor scale (NVFP4), ``int4`` + float16 (INT4-g).

Backends: the tests run the kernel in Pallas interpret mode on CPU against `reference`; the
same tests run compiled where a GPU (Triton) or TPU (Mosaic) is present. The compiled
lowerings are not yet verified on hardware. Block shapes are multiples of (8, 128), as
Mosaic tiling requires.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.formats import dequantize_packed_rows


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def default_bm(M: int) -> int:
    return 16 if M <= 16 else 64


def dequantize_reference(codes, scales, global_scale, *, element, block, scale_kind, alpha=1.0, dtype=jnp.float32):
    """The full ``[K, N]`` weight in float32 (or ``dtype``), for references and fallbacks."""
    lo, hi = dequantize_packed_rows(codes, scales, element=element, block=block, scale_kind=scale_kind)
    K2, N = lo.shape
    w = jnp.stack([lo, hi], axis=1).reshape(2 * K2, N)
    return (w * (jnp.asarray(global_scale, jnp.float32) * alpha)).astype(dtype)


def reference(x, codes, scales, global_scale, *, element, block, scale_kind, alpha=1.0, out_dtype=None):
    """What the kernel computes, in plain jnp: weights dequantised to ``x.dtype`` before a
    float32-accumulated matmul; global scale and alpha applied to the accumulator."""
    lo, hi = dequantize_packed_rows(codes, scales, element=element, block=block, scale_kind=scale_kind)
    w = jnp.stack([lo, hi], axis=1).reshape(2 * lo.shape[0], lo.shape[1]).astype(x.dtype)
    acc = jnp.dot(x, w, preferred_element_type=jnp.float32)
    acc = acc * (jnp.asarray(global_scale, jnp.float32) * alpha)
    return acc.astype(out_dtype or x.dtype)


def _kernel(xe_ref, xo_ref, c_ref, s_ref, g_ref, o_ref, *, element, block, scale_kind, alpha, bk):
    hk = bk // 2
    n_steps = xe_ref.shape[1] // hk
    dtype = xe_ref.dtype

    def body(k, acc):
        xe = xe_ref[:, pl.ds(k * hk, hk)]
        xo = xo_ref[:, pl.ds(k * hk, hk)]
        codes = c_ref[pl.ds(k * hk, hk), :]
        scales = s_ref[pl.ds(k * (bk // block), bk // block), :]
        w_even, w_odd = dequantize_packed_rows(codes, scales, element=element, block=block, scale_kind=scale_kind)
        acc += jnp.dot(xe, w_even.astype(dtype), preferred_element_type=jnp.float32)
        acc += jnp.dot(xo, w_odd.astype(dtype), preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, n_steps, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = (acc * (g_ref[0, 0] * alpha)).astype(o_ref.dtype)


def w4a16_in_specs(bm: int, bn: int, Kp: int, block: int) -> list:
    """Block specs of the W4A16 operands on an ``(M/bm, N/bn)`` grid: even and odd columns
    of x (``[bm, K/2]`` each), packed codes ``[K/2, bn]``, block scales ``[K/block, bn]`` and
    the global scale ``[1, 1]`` (shared by the plain and the low-rank kernels)."""
    return [
        pl.BlockSpec((bm, Kp // 2), lambda i, j: (i, 0)),
        pl.BlockSpec((bm, Kp // 2), lambda i, j: (i, 0)),
        pl.BlockSpec((Kp // 2, bn), lambda i, j: (0, j)),
        pl.BlockSpec((Kp // block, bn), lambda i, j: (0, j)),
        pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
    ]


def split_even_odd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x[..., 0::2], x[..., 1::2]


def pad_operands(x, codes, scales, *, block, bm, bn, bk):
    """Zero-pad M, N, K to tile multiples (zero codes decode to 0, so padding adds nothing)."""
    M, K = x.shape
    N = codes.shape[1]
    Mp, Np, Kp = _round_up(M, bm), _round_up(N, bn), _round_up(K, bk)
    x = jnp.pad(x, ((0, Mp - M), (0, Kp - K)))
    codes = jnp.pad(codes, ((0, (Kp - K) // 2), (0, Np - N)))
    scales = jnp.pad(scales, ((0, (Kp - K) // block), (0, Np - N)))
    return x, codes, scales, (M, N)


def check_operands(x, codes, scales, *, block: int, bk: int) -> None:
    """The packed weight must match ``x [M, K]`` and the K tile must hold whole blocks."""
    K = x.shape[1]
    if K % block:
        raise ValueError(f"K={K} is not divisible by the quantization block {block}")
    if codes.shape[0] * 2 != K or scales.shape[0] * block != K or scales.shape[1] != codes.shape[1]:
        raise ValueError(f"codes {codes.shape} / scales {scales.shape} do not match x {x.shape}")
    if bk % block or bk % 2:
        raise ValueError(f"bk={bk} must be a multiple of the block {block}")


@functools.partial(
    jax.jit,
    static_argnames=("element", "block", "scale_kind", "alpha", "bm", "bn", "bk", "interpret", "out_dtype"),
)
def w4a16_matmul(
    x, codes, scales, global_scale, *, element: str, block: int, scale_kind: str, alpha: float = 1.0,
    bm: int | None = None, bn: int = 128, bk: int = 256, interpret: bool = False, out_dtype=None,
):
    """``x [M, K] @ dequant(codes [K/2, N], scales [K/block, N]) * global_scale * alpha``."""
    M, K = x.shape
    check_operands(x, codes, scales, block=block, bk=bk)
    if M == 0:  # no rows: a zero-size grid has nothing to run
        return jnp.zeros((0, codes.shape[1]), out_dtype or x.dtype)
    bm = bm or default_bm(M)
    xp, cp, sp, (M, N) = pad_operands(x, codes, scales, block=block, bm=bm, bn=bn, bk=bk)
    xe, xo = split_even_odd(xp)
    Mp, Kp = xp.shape
    Np = cp.shape[1]
    g = jnp.asarray(global_scale, jnp.float32).reshape(1, 1)
    out = pl.pallas_call(
        functools.partial(_kernel, element=element, block=block, scale_kind=scale_kind, alpha=alpha, bk=bk),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype or x.dtype),
        grid=(Mp // bm, Np // bn),
        in_specs=w4a16_in_specs(bm, bn, Kp, block),
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
    )(xe, xo, cp, sp, g)
    return out[:M, :N]
