"""Fused low-rank + 4-bit residual matmul (the TwinQuant / SVDQuant shape) in one `pallas_call`:

    y = x @ dequant(R) * global_scale * alpha  +  (x @ P) @ Lt

with ``R`` a 4-bit block-scaled ``[K, N]`` residual (packed as in `w4a16`), ``P [K, r]``
the down-projection and ``Lt [r, N]`` the up-projection, both 16-bit. While a program
streams its ``x`` row-block over K it accumulates both the residual product (``acc``)
and the rank-``r`` down-projection (``z``, kept on chip); after the last K step it adds
``z @ Lt[:, n-block]`` into the same output in one epilogue and writes once.

Each ``(m, n)`` program recomputes ``z`` for its row-block: an extra ``r / bn`` of the
residual's MACs, and ``P`` re-read per N-block (``K r`` 16-bit values, which stay in L2
on a GPU). Backends as in `w4a16`: tested in interpret mode, compiled lowering not yet verified on hardware.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas import w4a16
from kernels_pallas.formats import dequantize_packed_rows


def reference(x, codes, scales, global_scale, P, Lt, *, element, block, scale_kind, alpha=1.0, out_dtype=None):
    """The kernel's math in jnp: the low-rank branch in ``x.dtype`` inputs, f32 accumulation."""
    main = w4a16.reference(x, codes, scales, global_scale, element=element, block=block,
                           scale_kind=scale_kind, alpha=alpha, out_dtype=jnp.float32)
    z = jnp.dot(x, P.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    low = jnp.dot(z, Lt.astype(x.dtype), preferred_element_type=jnp.float32)
    return (main + low).astype(out_dtype or x.dtype)


def _kernel(xe_ref, xo_ref, c_ref, s_ref, g_ref, pe_ref, po_ref, lt_ref, o_ref, *, element, block, scale_kind, alpha, bk):
    hk = bk // 2
    n_steps = xe_ref.shape[1] // hk
    dtype = xe_ref.dtype
    r = pe_ref.shape[1]

    def body(k, carry):
        acc, z = carry
        xe = xe_ref[:, pl.ds(k * hk, hk)]
        xo = xo_ref[:, pl.ds(k * hk, hk)]
        codes = c_ref[pl.ds(k * hk, hk), :]
        scales = s_ref[pl.ds(k * (bk // block), bk // block), :]
        w_even, w_odd = dequantize_packed_rows(codes, scales, element=element, block=block, scale_kind=scale_kind)
        acc += jnp.dot(xe, w_even.astype(dtype), preferred_element_type=jnp.float32)
        acc += jnp.dot(xo, w_odd.astype(dtype), preferred_element_type=jnp.float32)
        z += jnp.dot(xe, pe_ref[pl.ds(k * hk, hk), :].astype(dtype), preferred_element_type=jnp.float32)
        z += jnp.dot(xo, po_ref[pl.ds(k * hk, hk), :].astype(dtype), preferred_element_type=jnp.float32)
        return acc, z

    init = (jnp.zeros(o_ref.shape, jnp.float32), jnp.zeros((o_ref.shape[0], r), jnp.float32))
    acc, z = jax.lax.fori_loop(0, n_steps, body, init)
    low = jnp.dot(z.astype(dtype), lt_ref[...].astype(dtype), preferred_element_type=jnp.float32)
    o_ref[...] = (acc * (g_ref[0, 0] * alpha) + low).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("element", "block", "scale_kind", "alpha", "bm", "bn", "bk", "interpret", "out_dtype"),
)
def lowrank_w4a16_matmul(
    x, codes, scales, global_scale, P, Lt, *, element: str, block: int, scale_kind: str, alpha: float = 1.0,
    bm: int | None = None, bn: int = 128, bk: int = 256, interpret: bool = False, out_dtype=None,
):
    """``x [M, K]``, residual ``codes [K/2, N]`` / ``scales [K/block, N]``, ``P [K, r]``, ``Lt [r, N]``."""
    M, K = x.shape
    w4a16.check_operands(x, codes, scales, block=block, bk=bk)
    if P.ndim != 2 or Lt.ndim != 2:
        raise ValueError(f"P {P.shape} and Lt {Lt.shape} must be matrices [K, r] and [r, N]")
    r = P.shape[1]
    if P.shape[0] != K or Lt.shape != (r, codes.shape[1]):
        raise ValueError(f"P {P.shape} / Lt {Lt.shape} do not match x {x.shape} and N={codes.shape[1]}")
    if r < 1:
        raise ValueError(f"rank r={r} (P {P.shape}): the low-rank branch needs r >= 1; without one use "
                         "kernels_pallas.w4a16.w4a16_matmul")
    if M == 0:  # no rows: a zero-size grid has nothing to run
        return jnp.zeros((0, codes.shape[1]), out_dtype or x.dtype)
    bm = bm or w4a16.default_bm(M)
    xp, cp, sp, (M, N) = w4a16.pad_operands(x, codes, scales, block=block, bm=bm, bn=bn, bk=bk)
    Mp, Kp = xp.shape
    Np = cp.shape[1]
    Pp = jnp.pad(P, ((0, Kp - K), (0, 0)))
    Ltp = jnp.pad(Lt, ((0, 0), (0, Np - N)))
    xe, xo = w4a16.split_even_odd(xp)
    pe, po = Pp[0::2], Pp[1::2]
    g = jnp.asarray(global_scale, jnp.float32).reshape(1, 1)
    out = pl.pallas_call(
        functools.partial(_kernel, element=element, block=block, scale_kind=scale_kind, alpha=alpha, bk=bk),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype or x.dtype),
        grid=(Mp // bm, Np // bn),
        in_specs=w4a16.w4a16_in_specs(bm, bn, Kp, block) + [
            pl.BlockSpec((Kp // 2, r), lambda i, j: (0, 0)),
            pl.BlockSpec((Kp // 2, r), lambda i, j: (0, 0)),
            pl.BlockSpec((r, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
    )(xe, xo, cp, sp, g, pe, po, Ltp)
    return out[:M, :N]
