"""Low-level 4-bit element codes, block scales and nibble packing (jax only).

E2M1 (OCP MX v1.0 FP4): sign, 2 exponent bits (bias 1), 1 mantissa bit, no Inf/NaN;
magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. A 4-bit code is ``sign << 3 | magnitude index``,
the same bit pattern as ``ml_dtypes.float4_e2m1fn``. Encoding rounds to nearest, ties to
the even code (IEEE RTNE), and saturates at 6.

E1M2 (the KV-cache grid of ReQAT): magnitudes {0, 0.5, ..., 3.5}, a uniform grid.

INT4: two's complement in [-8, 7]. INT4 midrise (``int4m``): the same codes ``q`` stand for
``q + 0.5`` (the RMS-scaled INT quantizer of WUSH, arXiv 2512.00956).

Packing: two codes per byte along the packed axis, **even element in the low nibble**
(the layout of WUSH/qutlass and NeMo/ModelOpt checkpoints).

Decoding is arithmetic (shifts, compares, multiplies), not a table gather, so the same
functions lower inside Pallas kernels on GPU and TPU as well as in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_MAX = 6.0
E1M2_VALUES = np.arange(8, dtype=np.float32) * 0.5
E1M2_MAX = 3.5
E4M3_MAX = 448.0


def _nearest_index_rtne(mag: jax.Array, grid: np.ndarray) -> jax.Array:
    """Index of the nearest grid value to ``mag >= 0`` (saturating), ties to the even index."""
    idx = jnp.zeros(mag.shape, jnp.uint8)
    for i in range(len(grid) - 1):
        mid = np.float32((grid[i] + grid[i + 1]) / 2)
        above = (mag >= mid) if (i + 1) % 2 == 0 else (mag > mid)
        idx = idx + above.astype(jnp.uint8)
    return idx


def e2m1_encode(x: jax.Array) -> jax.Array:
    """float -> 4-bit E2M1 codes (uint8, low nibble), RTNE, saturating at +-6."""
    x = x.astype(jnp.float32)
    mag = _nearest_index_rtne(jnp.abs(x), E2M1_VALUES)
    sign = jnp.signbit(x).astype(jnp.uint8) << 3
    return sign | mag


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes -> float32: ``(-1)^s * (e == 0 ? m/2 : (1 + m/2) * 2^(e-1))``."""
    codes = codes.astype(jnp.int32)
    sign = jnp.where((codes & 8) != 0, -1.0, 1.0)
    e = (codes >> 1) & 3
    m = (codes & 1).astype(jnp.float32)
    normal = (1.0 + 0.5 * m) * jnp.exp2((e - 1).astype(jnp.float32))
    return sign * jnp.where(e == 0, 0.5 * m, normal)


def e1m2_encode(x: jax.Array) -> jax.Array:
    """float -> 4-bit E1M2 codes: magnitude index on the uniform 0.5 grid (max 3.5), RTNE."""
    x = x.astype(jnp.float32)
    return (jnp.signbit(x).astype(jnp.uint8) << 3) | _nearest_index_rtne(jnp.abs(x), E1M2_VALUES)


def e1m2_decode(codes: jax.Array) -> jax.Array:
    codes = codes.astype(jnp.int32)
    return jnp.where((codes & 8) != 0, -1.0, 1.0) * 0.5 * (codes & 7).astype(jnp.float32)


def int4_encode(x: jax.Array) -> jax.Array:
    """float (already divided by the scale) -> 4-bit two's complement codes, RTNE, [-8, 7]."""
    q = jnp.clip(jnp.round(x.astype(jnp.float32)), -8, 7).astype(jnp.int32)
    return (q & 0xF).astype(jnp.uint8)


def int4_decode(codes: jax.Array) -> jax.Array:
    codes = codes.astype(jnp.int32)
    return jnp.where(codes >= 8, codes - 16, codes).astype(jnp.float32)


def int4m_encode(x: jax.Array) -> jax.Array:
    """Midrise INT4 (WUSH's ``pseudoquantize_int``): ``q = clamp(floor(x), -8, 7)`` stored as
    4-bit two's complement; it stands for ``q + 0.5`` (grid {-7.5, ..., 7.5}, no zero)."""
    q = jnp.clip(jnp.floor(x.astype(jnp.float32)), -8, 7).astype(jnp.int32)
    return (q & 0xF).astype(jnp.uint8)


def int4m_decode(codes: jax.Array) -> jax.Array:
    return int4_decode(codes) + 0.5


ENCODERS = {"e2m1": e2m1_encode, "e1m2": e1m2_encode, "int4": int4_encode, "int4m": int4m_encode}
DECODERS = {"e2m1": e2m1_decode, "e1m2": e1m2_decode, "int4": int4_decode, "int4m": int4m_decode}


def pack_nibbles(codes: jax.Array, axis: int = -1) -> jax.Array:
    """Pack 4-bit codes two per byte along ``axis`` (even element -> low nibble)."""
    codes = jnp.moveaxis(codes.astype(jnp.uint8), axis, -1)
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of codes ({codes.shape[-1]}) along axis {axis}")
    packed = (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)
    return jnp.moveaxis(packed, -1, axis)


def unpack_nibbles(packed: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of `pack_nibbles`: bytes -> codes, twice as long along ``axis``."""
    packed = jnp.moveaxis(packed.astype(jnp.uint8), axis, -1)
    lo, hi = packed & 0xF, packed >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return jnp.moveaxis(codes, -1, axis)


# ------------------------------------------------------------------ scales


def e8m0_exponent(amax: jax.Array, rule: str) -> jax.Array:
    """Shared power-of-two exponent of an MXFP4 block from its absolute maximum.

    - ``ocp``: ``floor(log2 amax) - 2`` (OCP MX v1.0 / microxcaling: emax of E2M1 is 2);
      elements are then saturated, so ``amax / 2^e`` in [4, 8) can clip values above 6.
    - ``ceil``: ``ceil(log2(amax / 6))`` (NVIDIA / JAX ``scaled_matmul``): never clips.
    - ``alpha3``: ``floor(log2 amax)`` with elements multiplied by 3 before rounding and a
      global factor 1/3 on the output (FP-Quant / WUSH): scaled magnitudes in [3, 6).
    Exponents are clamped to E8M0's [-127, 127]; an all-zero block gets -127, a block with a
    NaN or inf 128 (E8M0's NaN byte). The exponents
    are exact (from the float's own exponent, not a rounded ``log2``): an amax
    just below a power of two gets the lower exponent, and ``ceil`` never clips.
    """
    amax = amax.astype(jnp.float32)
    safe = jnp.where(amax > 0, amax, 1.0)
    f = jnp.where(jnp.isinf(safe), 127, floor_log2(safe))  # amax in [2^f, 2^(f+1))
    if rule == "ocp":
        e = f - 2
    elif rule == "ceil":  # amax / 6 in (2^(f-3), 2^(f-1)): ceil(log2) is f - 2 or f - 1
        e = jnp.where(safe <= 1.5 * pow2(f), f - 2, f - 1)
    elif rule == "alpha3":
        e = f
    else:
        raise ValueError(f"MXFP4 scale rule {rule!r} is invalid: must be 'ocp', 'ceil' or 'alpha3'")
    e = jnp.clip(jnp.where(amax > 0, e, -127), -127, 127)
    # a block holding NaN or inf gets E8M0's NaN (exponent 128, byte 255): it decodes to NaN, as
    # the MX spec and NVFP4's float scales propagate it, instead of a finite block
    return jnp.where(jnp.isfinite(amax), e, 128).astype(jnp.int32)


def floor_log2(x: jax.Array) -> jax.Array:
    """``floor(log2 x)`` of positive normal float32 ``x``, exactly (int32; ``frexp``'s exponent).
    A subnormal ``x`` (flushed to zero on CPU) gives a value below -126, which every E8M0
    exponent derived from it clamps to -127 as its exact value would."""
    _, p = jnp.frexp(x.astype(jnp.float32))
    return p.astype(jnp.int32) - 1


def times_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x * 2^e`` for int ``e`` in [-254, 254] through two normal factors: ``2^-127`` alone is
    subnormal, which XLA:CPU flushes to zero (a block of amax >= 2^127 quantized to 0)."""
    e = jnp.asarray(e).astype(jnp.int32)
    half = e // 2
    return x * pow2(half) * pow2(e - half)


def pow2(e: jax.Array) -> jax.Array:
    """float32 ``2^e`` for int ``e`` in [-149, 127], exactly, from the bits (XLA:CPU's ``exp2``
    is off by ulps for most exponents, which moves round-to-nearest-even ties)."""
    e = jnp.asarray(e).astype(jnp.int32)
    normal = jnp.clip(e + 127, 1, 254) << 23
    subnormal = jnp.int32(1) << jnp.clip(e + 149, 0, 22)
    return jax.lax.bitcast_convert_type(jnp.where(e >= -126, normal, subnormal), jnp.float32)


def e8m0_encode(exponent: jax.Array) -> jax.Array:
    """Exponent in [-127, 127] -> E8M0 byte (bias 127); 128 (a non-finite block) -> 255, NaN."""
    return (exponent + 127).astype(jnp.uint8)


def e8m0_decode(byte: jax.Array) -> jax.Array:
    """E8M0 byte -> float32 ``2^(byte - 127)``, exactly; byte 255 is E8M0's NaN."""
    byte = byte.astype(jnp.int32)
    return jnp.where(byte == 255, jnp.float32(jnp.nan), pow2(jnp.minimum(byte, 254) - 127))


def to_e4m3(x: jax.Array) -> jax.Array:
    """float32 -> float8_e4m3fn, RTNE, saturating at 448 (E4M3 has no Inf)."""
    return jnp.clip(x.astype(jnp.float32), -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def walsh_hadamard(n: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix ``H_n / sqrt(n)`` (n a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def e4m3_block_scale(ratio: jax.Array) -> jax.Array:
    """An NVFP4 block scale ``amax_block / (6 s_g)`` as E4M3: `to_e4m3` (saturating) for a
    finite ratio, E4M3's NaN for a block holding a NaN or inf, so that block, and only it,
    decodes to NaN (MXFP4's E8M0 NaN scale does the same)."""
    return jnp.where(jnp.isfinite(ratio), to_e4m3(ratio).astype(jnp.float32), jnp.nan).astype(jnp.float8_e4m3fn)


# --------------------------------------------------- used inside kernels too


def decode_scales(scales: jax.Array, kind: str) -> jax.Array:
    """Stored block scales -> float32 multipliers (``e8m0`` bytes, ``e4m3`` or float). E8M0's
    smallest scale, ``2^-127``, is subnormal: multiplying by it flushes to zero on XLA:CPU, so
    decoders apply scales with `apply_scales`."""
    if kind == "e8m0":
        return e8m0_decode(scales)
    return scales.astype(jnp.float32)


def apply_scales(vals: jax.Array, scales: jax.Array, kind: str) -> jax.Array:
    """``vals * decode_scales(scales, kind)`` (broadcasting), with an E8M0 scale applied as two
    normal powers of two (as `times_pow2`): a block whose scale byte is 0 (amax about 1e-38, a
    normal float32) decoded to zeros through the subnormal ``2^-127``."""
    if kind == "e8m0":
        byte = scales.astype(jnp.int32)
        e = jnp.minimum(byte, 254) - 127
        half = jnp.right_shift(e, 1)  # floor(e / 2) in shifts and adds only (kernels run this too)
        return jnp.where(byte == 255, jnp.float32(jnp.nan), vals * pow2(half) * pow2(e - half))
    return vals * scales.astype(jnp.float32)


def expand_rows(s: jax.Array, rows_per_scale: int) -> jax.Array:
    """``[R, N] -> [R * rows_per_scale, N]``, each row repeated (block scales onto rows)."""
    R, N = s.shape
    return jnp.broadcast_to(s[:, None, :], (R, rows_per_scale, N)).reshape(R * rows_per_scale, N)


def dequantize_packed_rows(packed: jax.Array, scales: jax.Array, *, element: str, block: int, scale_kind: str):
    """Packed codes ``[K/2, N]`` (even row k in the low nibble) and scales ``[K/block, N]`` ->
    the even-row and odd-row weights ``[K/2, N]`` each, float32 (global scale not applied)."""
    decode = DECODERS[element]
    s = expand_rows(scales, block // 2)
    return apply_scales(decode(packed & 0xF), s, scale_kind), apply_scales(decode(packed >> 4), s, scale_kind)
