"""Block-scaled 4-bit formats and `QArray`, the quantized weight type.

Formats (``QFormat``), each a 4-bit element code plus a per-block scale along one axis:

- ``mxfp4(rule)``: E2M1 elements, block 32, E8M0 (power-of-two) scales (OCP MX v1.0).
  ``rule`` chooses the shared exponent (`kernels_pallas.formats.e8m0_exponent`):
  ``ocp`` = floor(log2 amax) - 2 with saturation (the spec), ``ceil`` = ceil(log2(amax/6))
  (never clips), ``alpha3`` = floor(log2 amax) with elements x3 and a global 1/3 (WUSH).
- ``nvfp4()``: E2M1, block 16, E4M3 block scales and an FP32 tensor scale:
  ``s_g = amax_tensor / (6 * 448)``, ``s_b = e4m3(amax_block / (6 s_g))``,
  ``q = RTN_E2M1(x / (s_b s_g))``.
- ``int4(group, scale)``: two's complement codes [-8, 7] per group, float16 scales.
  ``scale="absmax"`` (default): ``s = amax / 7``, ``q = RTN(x / s)``. ``scale="rms"``: the
  Gaussian-optimal RMS-scaled midrise quantizer of WUSH (arXiv 2512.00956; reference
  ``wush_utils.pseudoquantize_int``): ``s = c_4 * 2 / 15 * ||x_g|| / sqrt(G)`` with
  ``c_4 = 2.5139``, ``q = clamp(floor(x / s), -8, 7)``, ``x^ = (q + 0.5) s`` (element
  ``int4m``, rule ``rms``).
- ``e1m2(block)``: the uniform {0, .5, ..., 3.5} grid (ReQAT's KV cache), E4M3 scale
  ``amax / 3.5`` per 16.

A dimension not divisible by the block raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import formats as F


@dataclasses.dataclass(frozen=True)
class QFormat:
    name: str
    block: int
    element: str  # e2m1 | int4 | int4m (midrise) | e1m2
    scale_kind: str  # e8m0 | e4m3 | float16
    rule: str = "none"  # mxfp4 exponent rule; "rms" for int4m
    two_level: bool = False  # nvfp4 fp32 tensor scale

    @property
    def alpha(self) -> float:
        """Global output factor (1/3 for the alpha3 rule)."""
        return 1.0 / 3.0 if self.rule == "alpha3" else 1.0

    @property
    def bits_per_element(self) -> float:
        scale_bits = 16 if self.scale_kind == "float16" else 8
        return 4 + scale_bits / self.block


def mxfp4(rule: str = "ocp") -> QFormat:
    if rule not in ("ocp", "ceil", "alpha3"):
        raise ValueError(f"mxfp4 rule={rule!r} is invalid: must be 'ocp', 'ceil' or 'alpha3'")
    return QFormat("mxfp4", 32, "e2m1", "e8m0", rule)


def nvfp4() -> QFormat:
    return QFormat("nvfp4", 16, "e2m1", "e4m3", two_level=True)


#: the largest float16, int4's scale type: a group beyond 7x this saturates instead of NaN
F16_MAX = float(jnp.finfo(jnp.float16).max)

#: Gaussian-optimal clipping scale of the 4-bit RMS quantizer (WUSH ``optimal_gaussian_scales[4]``)
INT4_RMS_C = 2.513930578568423


def int4(group: int = 128, scale: str = "absmax") -> QFormat:
    if not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"int4 group={group!r} is invalid: must be an even int >= 2")
    if scale == "absmax":
        return QFormat("int4", group, "int4", "float16")
    if scale == "rms":
        return QFormat("int4", group, "int4m", "float16", rule="rms")
    raise ValueError(f"int4 scale={scale!r} is invalid: must be 'absmax' or 'rms'")


def e1m2(block: int = 16) -> QFormat:
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"e1m2 block={block!r} is invalid: must be an even int >= 2")
    return QFormat("e1m2", block, "e1m2", "e4m3")


FORMATS = {"mxfp4": mxfp4, "nvfp4": nvfp4, "int4": int4, "e1m2": e1m2}


def get_format(name: str | QFormat, **options: Any) -> QFormat:
    """``get_format("mxfp4", rule="ceil")``, ``get_format("int4", group=64)``, or the same as
    one string (what the command line takes): ``"int4:group=32,scale=rms"``."""
    if isinstance(name, QFormat):
        if options:  # they would be dropped silently
            raise ValueError(f"format options {sorted(options)} given with a QFormat ({name.name}): pass the format "
                             "by name (get_format('mxfp4', rule='ceil')) or build the QFormat with them")
        return name
    spec = name
    if isinstance(name, str) and ":" in name:
        name, _, opts = name.partition(":")
        given = dict(options)
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ValueError(f"format {spec!r}: option {item!r} is not key=value")
            key, value = key.strip(), value.strip()
            if key in options:  # given twice, or also as a keyword: neither may win silently
                raise ValueError(f"format {spec!r}: option {key!r} is given twice"
                                 + (f" (also as {key}={given[key]!r})" if key in given else ""))
            options[key] = int(value) if value.lstrip("+-").isdigit() else value
    if name not in FORMATS:
        raise ValueError(f"unknown quantization format {name!r}; available: {sorted(FORMATS)}")
    try:
        return FORMATS[name](**options)
    except TypeError as e:
        raise ValueError(f"format {spec!r}: invalid options {sorted(options)} ({e})") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized array: packed codes and block scales along ``axis``.

    codes: uint8, two 4-bit codes per byte along ``axis`` (even element in the low nibble).
    scales: one per ``fmt.block`` elements along ``axis`` (E8M0 bytes, E4M3 or float16).
    global_scale: float32 tensor scale (NVFP4), broadcastable over the blocks; 1 otherwise.
    Leading axes (e.g. stacked layers) are allowed, so slicing a QArray with stacked
    layers inside `lax.scan` gives the per-layer QArray.
    """

    codes: jax.Array
    scales: jax.Array
    global_scale: jax.Array
    fmt: QFormat = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(default=-2, metadata=dict(static=True))  # negative
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        s = list(self.codes.shape)
        s[self.axis] *= 2
        return tuple(s)

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    def dequantize(self, dtype=None) -> jax.Array:
        return dequantize(self, dtype)

    @property
    def nbytes(self) -> int:
        return int(self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize)


def _blocks_last(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Move ``axis`` last and split it into ``[..., K/block, block]``."""
    x = jnp.moveaxis(x, axis, -1)
    K = x.shape[-1]
    if K % block:
        raise ValueError(
            f"dimension {K} (axis {axis}) is not divisible by the quantization block {block}; "
            f"pad it to a multiple of {block} or choose another format"
        )
    return x.reshape(*x.shape[:-1], K // block, block)


def quantize(x: jax.Array, fmt: str | QFormat, *, axis: int = -2, global_scale=None) -> QArray:
    """Quantize ``x`` with blocks along ``axis`` (the reduction axis of a matmul: -2 for a
    ``[in, out]`` weight, -1 for activations ``[M, K]``). ``global_scale``: the FP32 tensor
    scale of a two-level format (NVFP4) to use instead of ``amax / (6 * 448)`` (GPTQ-style
    rounding fixes it before the blocks are rounded); ignored by one-level formats."""
    fmt = get_format(fmt)
    if x.ndim < 2:
        raise ValueError(f"quantize needs an array with >= 2 dims, got shape {x.shape}")
    axis = axis - x.ndim if axis >= 0 else axis
    if axis not in (-1, -2):
        raise ValueError(f"axis={axis} is invalid: quantize along -1 or -2")
    xb = _blocks_last(x.astype(jnp.float32), axis, fmt.block)  # [..., nb, B]
    amax = jnp.max(jnp.abs(xb), axis=-1)  # [..., nb]
    gscale = jnp.ones((*x.shape[:-2], 1, 1), jnp.float32)  # per leading index (stacked layers scan)
    if fmt.element == "e2m1" and fmt.scale_kind == "e8m0":
        e = F.e8m0_exponent(amax, fmt.rule)
        v = F.times_pow2(xb, -e[..., None])
        if fmt.rule == "alpha3":
            v = v * 3.0
        codes = F.e2m1_encode(v)
        scales = F.e8m0_encode(e)
    elif fmt.scale_kind == "e4m3":
        top = F.E2M1_MAX if fmt.element == "e2m1" else F.E1M2_MAX
        if fmt.two_level and global_scale is not None:
            given = jnp.asarray(global_scale, jnp.float32)
            if not isinstance(given, jax.core.Tracer) and not bool(jnp.all((given > 0) & jnp.isfinite(given))):
                raise ValueError(f"global_scale must be finite and > 0 (a zero scale made every value NaN), got "
                                 f"{np.asarray(given).ravel()[:4]}")
            gscale = jnp.broadcast_to(given, gscale.shape)
        elif fmt.two_level:
            # the tensor scale comes from the finite values, so a NaN or inf spoils only its
            # own block (as MXFP4's NaN block scale does), not every block of the tensor
            ax = jnp.abs(x.astype(jnp.float32))
            t_amax = jnp.max(jnp.where(jnp.isfinite(ax), ax, 0.0), axis=(-2, -1), keepdims=True, initial=0.0)
            # at least the smallest normal float32: below ~3e-35 the quotient is subnormal, XLA:CPU
            # flushes it to 0 and every block scale became inf (the whole tensor NaN)
            gscale = jnp.where(t_amax > 0, jnp.maximum(t_amax / (top * F.E4M3_MAX), jnp.finfo(jnp.float32).tiny), 1.0)
        g_blocks = jnp.moveaxis(gscale, axis, -1)  # broadcast over [..., nb]
        s = F.e4m3_block_scale(amax / (top * g_blocks))
        denom = s.astype(jnp.float32) * g_blocks
        v = jnp.where(denom[..., None] > 0, xb / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
        codes = F.ENCODERS[fmt.element](v)
        scales = s
    elif fmt.element == "int4":
        # saturate a finite amax, never an inf scale; a block holding inf or NaN gets a NaN scale
        # and decodes to NaN, as MXFP4 / NVFP4 blocks do (clamped, the inf read as a finite number)
        s = jnp.where(jnp.isfinite(amax), jnp.minimum(amax / 7.0, F16_MAX), jnp.nan).astype(jnp.float16)
        s32 = s.astype(jnp.float32)
        v = jnp.where(s32[..., None] > 0, xb / jnp.where(s32 > 0, s32, 1.0)[..., None], 0.0)
        codes = F.int4_encode(v)
        scales = s
    elif fmt.element == "int4m":  # RMS-scaled midrise (WUSH): s = c_4 * 2/15 * rms(x_g)
        rms = jnp.sqrt(jnp.mean(jnp.square(xb), axis=-1))
        finite = jnp.all(jnp.isfinite(xb), axis=-1)  # not isfinite(rms): x^2 of a finite 1e20 overflows
        s = jnp.where(finite, jnp.minimum(INT4_RMS_C * 2.0 / 15.0 * rms, F16_MAX), jnp.nan)
        s = s.astype(jnp.float16)
        s32 = s.astype(jnp.float32)
        v = jnp.where(s32[..., None] > 0, xb / jnp.where(s32 > 0, s32, 1.0)[..., None], 0.0)
        codes = F.int4m_encode(v)
        scales = s
    else:
        raise ValueError(f"unsupported format {fmt}")
    codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * codes.shape[-1])  # explicit: an empty array has no -1
    packed = jnp.moveaxis(F.pack_nibbles(codes, axis=-1), -1, axis)
    scales = jnp.moveaxis(scales, -1, axis)
    return QArray(packed, scales, gscale, fmt, axis, str(x.dtype))


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """Back to a dense array (float32 math, then ``dtype``, default the original dtype)."""
    fmt = q.fmt
    codes = F.unpack_nibbles(jnp.moveaxis(q.codes, q.axis, -1), axis=-1)
    vals = F.DECODERS[fmt.element](codes)
    vals = vals.reshape(*vals.shape[:-1], vals.shape[-1] // fmt.block, fmt.block)  # explicit: empty arrays
    s = jnp.moveaxis(q.scales, q.axis, -1)
    g = jnp.moveaxis(q.global_scale, q.axis, -1)
    out = F.apply_scales(vals, s[..., None], fmt.scale_kind)
    out = out.reshape(*vals.shape[:-2], vals.shape[-2] * fmt.block) * g * fmt.alpha
    dtype = jnp.dtype(dtype or q.dtype)
    if jnp.issubdtype(dtype, jnp.floating):  # a value rounded up past the dtype's range saturates
        top = float(jnp.finfo(dtype).max)
        out = jnp.where(jnp.isnan(out), out, jnp.clip(out, -top, top))
    return jnp.moveaxis(out, -1, q.axis).astype(dtype)


@jax.custom_vjp
def _ste(x, xq):
    return xq


def _ste_fwd(x, xq):
    return xq, None


def _ste_bwd(_, g):
    return g, None


_ste.defvjp(_ste_fwd, _ste_bwd)


def fake_quant(x: jax.Array, fmt: str | QFormat, *, axis: int = -1) -> jax.Array:
    """``dequantize(quantize(x))`` in the forward pass, the identity in the backward pass
    (straight-through estimator, Bengio et al. 2013): for quantization-aware training."""
    xq = dequantize(quantize(jax.lax.stop_gradient(x), fmt, axis=axis), x.dtype)
    return _ste(x, xq)


def fake_quant_tokens(x: jax.Array, fmt: str | QFormat) -> jax.Array:
    """Activations ``[..., K]`` quantize-dequantized per token (straight-through gradient):
    blocks along ``K`` and, for a two-level format (NVFP4), each token's own tensor scale
    (its amax / (6 * 448)), so a token's quantization does not depend on the other tokens of
    the call: padding, batch rows, and prefill vs cached decoding see the same numbers. What
    every W4A4 path quantizes activations with (QAT, `ActQuantWeight`, `TransformedWeight`,
    TwinQuant, the layer-level error of `transforms.w4a4_matmul`)."""
    return fake_quant(x.reshape(-1, 1, x.shape[-1]), fmt, axis=-1).reshape(x.shape).astype(x.dtype)
