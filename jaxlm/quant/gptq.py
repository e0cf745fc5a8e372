"""GPTQ-style inner rounding for block-transformed W4A4 weights (WUSH, arXiv 2512.00956).

With RTN inner rounding (`jaxlm.quant.transforms`) every block of the transformed weights
``T_i^{-T} W_i`` is rounded on its own. GPTQ mode is the reference's
``gptq_babai_outer`` + ``block_transform_gptq_babai_inner`` (IST-DASLab/WUSH,
``src/quantization/wush_gptq.py``, ``force_rtn=False``): Babai's nearest-plane algorithm in
the lattice spanned by the upper Cholesky factor ``U`` of ``H = E[x x^T]`` (``U^T U = H``,
damped as in `damped_cholesky_upper`), which minimises ``E ||x^T (W - W^)||^2`` greedily:

1. ``Y = U W`` (``W [C, R]`` in jaxlm's ``[in, out]`` layout is the reference's column form).
2. Blocks ``i`` from last to first. The block target ``y_i`` then carries the error of the
   later, already rounded blocks: ``y_i = U_ii W_i + sum_{j>i} U_ij (W_j - W^_j)``.
3. ``T_i`` from ``(U_ii, y_i)``: the identity (RTN), the shared Hadamard, or WUSH's
   ``H_B diag(s)^{1/2} V^T U_ii^{-T}`` from the SVD of ``y_i`` (`transforms.wush_block`;
   in GPTQ mode the error-carrying target, as in the reference).
4. QR ``U_ii T_i^T = Q R_i``; ``z = Q^T y_i``; the unrounded transformed weights
   ``x~ = R_i^{-1} z`` (= ``T_i^{-T} W_i`` when no error is carried) fix the block scales
   (one per output column, the format's own rule).
5. Babai/GPTQ inside the block: rows ``k = B-1 .. 0``: ``x^_k = Q_fmt(z_k / R_i[k, k])`` on
   the format's grid with the fixed scale, then ``z_{<k} -= R_i[<k, k] x^_k``.
6. ``W^_i = T_i^T x^`` (the dequantized weights in the original basis) and
   ``Y_{<i} -= U_{<i, i} W^_i`` (the error propagation of step 2).

The result is stored like the RTN path: ``T`` ``[C/B, B, B]`` and the rounded ``x^`` as a
`QArray` (codes on the format's grid, the scales of step 4), so `TransformedWeight` runs
it unchanged. NVFP4's FP32 tensor scale must be fixed before the first block is rounded:
it is taken from the unrounded transformed weights of RTN mode (``amax / (6 * 448)``,
jaxlm's rule); if error feedback pushed a block past it (its E4M3 scale would saturate),
the layer is redone with 1.25x the observed amax (at most 3 times). Everything but the
scale rule (`quantize`, jitted) runs in float64 numpy on the host, like the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.quant.formats import QArray, QFormat, get_format, quantize
from jaxlm.quant.transforms import damped_cholesky_upper, wush_block
from kernels_pallas import formats as F

INNER = ("rtn", "gptq")
TRANSFORMS = ("rtn", "hadamard", "wush")
_GRIDS = {"e2m1": F.E2M1_VALUES.astype(np.float64), "e1m2": F.E1M2_VALUES.astype(np.float64)}


def round_scaled(v: np.ndarray, element: str) -> tuple[np.ndarray, np.ndarray]:
    """``v`` (already divided by its scale) -> (4-bit codes uint8, their values), the
    rounding of `kernels_pallas.formats` ``ENCODERS[element]`` in numpy float64."""
    if element in _GRIDS:  # sign-magnitude grid, nearest, ties to the even code, saturating
        grid = _GRIDS[element]
        mag = np.abs(v)
        idx = np.zeros(v.shape, np.uint8)
        for i in range(len(grid) - 1):
            mid = (grid[i] + grid[i + 1]) / 2
            idx += ((mag >= mid) if (i + 1) % 2 == 0 else (mag > mid)).astype(np.uint8)
        neg = np.signbit(v)
        return (neg.astype(np.uint8) << 3) | idx, np.where(neg, -grid[idx], grid[idx])
    if element == "int4":
        q = np.clip(np.round(v), -8, 7)
        return (q.astype(np.int64) & 0xF).astype(np.uint8), q
    if element == "int4m":  # midrise: floor, value q + 0.5
        q = np.clip(np.floor(v), -8, 7)
        return (q.astype(np.int64) & 0xF).astype(np.uint8), q + 0.5
    raise ValueError(f"no rounding rule for element {element!r}")


@functools.partial(jax.jit, static_argnames=("fmt",))
def _scales_jit(xt, g, *, fmt: QFormat):
    q = quantize(xt, fmt, axis=-2, global_scale=g if fmt.two_level else None)
    return q.scales, F.decode_scales(q.scales, fmt.scale_kind) * q.global_scale * fmt.alpha


def _block_scales(xt: np.ndarray, fmt: QFormat, g) -> tuple[np.ndarray, np.ndarray]:
    """Scales of one block ``xt [B, R]`` by the format's own rule (`quantize`): (stored
    scales ``[1, R]``, the float64 multiplier of each column's codes)."""
    scales, mult = _scales_jit(jnp.asarray(xt, jnp.float32), jnp.float32(1.0 if g is None else g), fmt=fmt)
    return np.asarray(scales), np.asarray(mult, np.float64)[0]


def _block_transform(method: str, Uii: np.ndarray, y: np.ndarray, Hb: np.ndarray) -> np.ndarray:
    if method == "rtn":
        return np.eye(len(Uii))
    if method == "hadamard":
        return Hb.copy()
    return wush_block(Uii, y, Hb)


def _babai(U, W, block, method, fmt, g):
    """Steps 1-6 for every block. ``fmt=None``: no rounding (``x^ = x~``)."""
    C, R = W.shape
    n = C // block
    Hb = None if method == "rtn" else F.walsh_hadamard(block).astype(np.float64)
    Y = U @ W
    T = np.empty((n, block, block))
    xq = np.empty((C, R))
    codes = np.zeros((C, R), np.uint8)
    scales = [None] * n
    amax = 0.0
    for i in range(n - 1, -1, -1):
        sl = slice(i * block, (i + 1) * block)
        Uii, y = U[sl, sl], Y[sl]
        T[i] = _block_transform(method, Uii, y, Hb)
        Q, Ri = np.linalg.qr(Uii @ T[i].T)
        z = Q.T @ y
        xt = np.linalg.solve(Ri, z)
        if fmt is None:
            xq[sl] = xt
        else:
            amax = max(amax, float(np.abs(xt).max()))
            scales[i], mult = _block_scales(xt, fmt, g)
            safe = np.where(mult > 0, mult, 1.0)
            for k in range(block - 1, -1, -1):
                v = np.where(mult > 0, z[k] / Ri[k, k] / safe, 0.0)
                c, val = round_scaled(v, fmt.element)
                codes[i * block + k] = c
                xq[i * block + k] = val * mult
                z[:k] -= np.outer(Ri[:k, k], xq[i * block + k])
        Y[: i * block] -= U[: i * block, sl] @ (T[i].T @ xq[sl])
    return T, xq, codes, scales, amax


def gptq_transform_quantize(H, W, fmt: str | QFormat | None, method: str = "wush", *, block: int | None = None,
                            damp: float = 0.01):
    """Block transforms and GPTQ-rounded transformed weights of ``W [C, R]`` under
    ``H = E[x x^T]`` ``[C, C]``: ``(T [C/B, B, B] float32, weight)``, ``weight`` a `QArray`
    in ``fmt`` (blocks along the input axis) or, with ``fmt=None`` (``block`` given), the
    unrounded float32 ``T^{-T} W`` (a check of exactness). ``method``: the transform,
    ``rtn`` (identity: plain GPTQ), ``hadamard`` (shared) or ``wush``."""
    if method not in TRANSFORMS:
        raise ValueError(f"method={method!r} is invalid: must be one of {TRANSFORMS}")
    fmt = None if fmt is None else get_format(fmt)
    if fmt is not None and block is not None and block != fmt.block:  # it was ignored silently
        raise ValueError(f"block={block!r} contradicts the {fmt.name} block {fmt.block}: the format fixes the "
                         "block (pass block only with fmt=None)")
    B = fmt.block if fmt is not None else block
    if B is None:
        raise ValueError("pass fmt or block")
    if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
        raise ValueError(f"block={B!r} is invalid: must be a positive int")
    W = np.asarray(W, np.float64)
    C, R = W.shape
    if C % B:
        raise ValueError(f"input size {C} is not a multiple of the block size {B}")
    if np.shape(H) != (C, C):
        raise ValueError(f"H has shape {np.shape(H)}, expected ({C}, {C}) for W of shape {W.shape}")
    if method == "wush" and R < B:
        raise ValueError(f"WUSH needs at least {B} output columns (the block size), W has {R}")
    U = damped_cholesky_upper(H, damp)
    if fmt is None:
        T, xq, *_ = _babai(U, W, B, method, None, None)
        return jnp.asarray(T, jnp.float32), jnp.asarray(xq, jnp.float32)
    g = None
    if fmt.two_level:
        top = F.E2M1_MAX if fmt.element == "e2m1" else F.E1M2_MAX
        cap = top * F.E4M3_MAX
        _, x0, *_ = _babai(U, W, B, method, None, None)
        a0 = np.float32(np.abs(x0).max())
        g = np.float32(a0 / cap) if a0 > 0 else np.float32(1.0)
        T, xq, codes, scales, amax = _babai(U, W, B, method, fmt, g)
        for _ in range(3):  # a block scale saturated: redo with the observed amax + 25%
            if amax <= cap * float(g):
                break
            g = np.float32(np.float32(1.25 * amax) / cap)
            T, xq, codes, scales, amax = _babai(U, W, B, method, fmt, g)
    else:
        T, xq, codes, scales, amax = _babai(U, W, B, method, fmt, None)
    packed = jnp.asarray((codes[0::2] & 0xF) | (codes[1::2] << 4))  # even row -> low nibble
    sc = jnp.asarray(np.concatenate(scales, axis=0))
    gs = jnp.full((1, 1), 1.0 if g is None else g, jnp.float32)
    return jnp.asarray(T, jnp.float32), QArray(packed, sc, gs, fmt, -2, "float32")
