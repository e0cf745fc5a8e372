"""4-bit formats against independent references: ml_dtypes for E2M1 codes, a numpy
transcription of the microxcaling MX definition for MXFP4, the two-level NVFP4
definition (ml_dtypes E4M3), packing round trips and quantization error bounds."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlm.quant as Q
from kernels_pallas import formats as F

E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)


def _ml_codes(x):
    """E2M1 codes as ml_dtypes encodes them (one element per byte, low 4 bits)."""
    return np.asarray(x, np.float32).astype(E2M1).view(np.uint8) & 0xF


def test_every_e2m1_value_round_trips_like_ml_dtypes():
    all_codes = np.arange(16, dtype=np.uint8)
    values = all_codes.view(E2M1).astype(np.float32)  # ml_dtypes' decoding of every code
    np.testing.assert_array_equal(np.asarray(F.e2m1_decode(jnp.asarray(all_codes))), values)
    np.testing.assert_array_equal(np.asarray(F.e2m1_encode(jnp.asarray(values))), _ml_codes(values))


def test_random_e2m1_encoding_matches_ml_dtypes():
    rng = np.random.RandomState(0)
    x = np.concatenate([
        rng.randn(20000).astype(np.float32) * 2,
        rng.uniform(-6, 6, 20000).astype(np.float32),
        # exact midpoints between grid values: the ties-to-even cases
        np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32) * np.array([[1], [-1]], np.float32),
    ], axis=None)
    x = np.clip(x, -6, 6)  # ml_dtypes has no saturation rule to compare against beyond 6
    np.testing.assert_array_equal(np.asarray(F.e2m1_encode(jnp.asarray(x))), _ml_codes(x))
    # beyond the range we saturate to +-6
    np.testing.assert_array_equal(np.asarray(F.e2m1_decode(F.e2m1_encode(jnp.array([7.0, -100.0])))), [6.0, -6.0])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(half_k, n, seed):
    codes = np.random.RandomState(seed).randint(0, 16, (2 * half_k, n)).astype(np.uint8)
    for axis in (0, 1) if n % 2 == 0 else (0,):
        packed = F.pack_nibbles(jnp.asarray(codes), axis=axis)
        np.testing.assert_array_equal(F.unpack_nibbles(packed, axis=axis), codes)
    packed = np.asarray(F.pack_nibbles(jnp.asarray(codes), axis=0))
    np.testing.assert_array_equal(packed & 0xF, codes[0::2])  # even element -> low nibble
    np.testing.assert_array_equal(packed >> 4, codes[1::2])


def _mx_reference(x, block=32):
    """microxcaling `_shared_exponents` + `_quantize_mx` for fp4_e2m1 (emax 2), written from
    the definition: shared_exp = floor(log2 max|v|) - 2 (clamped to [-127, 127]), elements
    v / 2^shared_exp rounded to nearest-even on the E2M1 grid with saturation at 6."""
    x = np.asarray(x, np.float64).reshape(-1, block)
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    e = np.clip(e, -127, 127)
    scaled = np.clip(x / 2.0 ** e[:, None], -6, 6).astype(np.float32)
    q = scaled.astype(E2M1).astype(np.float64)  # RTNE on the E2M1 grid
    return (q * 2.0 ** e[:, None]).reshape(-1), e


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_mxfp4_ocp_rule_matches_microxcaling(scale):
    rng = np.random.RandomState(1)
    w = (rng.standard_t(3, (256, 64)) * scale).astype(np.float32)
    w[:32, 0] = 0.0  # an all-zero block
    q = Q.quantize(jnp.asarray(w), Q.mxfp4("ocp"), axis=-2)
    # reference along K (axis 0): transpose so blocks are contiguous
    ref, e = _mx_reference(w.T)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(q)).T.reshape(-1), ref.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q.scales).T.reshape(-1).astype(int) - 127, e.astype(int))


def test_pow2_and_floor_log2_are_exact():
    e = np.arange(-149, 128)
    np.testing.assert_array_equal(np.asarray(F.pow2(jnp.asarray(e))), np.ldexp(np.float32(1), e).astype(np.float32))
    x = np.concatenate([np.ldexp(np.float32(1), np.arange(-126, 128)).astype(np.float32),
                        np.nextafter(np.ldexp(np.float32(1), np.arange(-125, 128)).astype(np.float32), np.float32(0)),
                        np.random.RandomState(0).lognormal(0, 30, 2000).astype(np.float32)])
    x = x[np.isfinite(x) & (x >= np.finfo(np.float32).tiny)]  # normal floats
    np.testing.assert_array_equal(np.asarray(F.floor_log2(jnp.asarray(x))), np.frexp(x)[1] - 1)
    assert int(F.floor_log2(jnp.float32(1e-42))) < -126  # a subnormal: below every normal exponent


@pytest.mark.parametrize("k", [-110, -60, -20, 13, 40, 90, 115])
def test_mxfp4_ties_round_to_even_at_every_exponent(k):
    """Grid midpoints times 2^k round to even as in ml_dtypes, and an amax just below a power of
    two takes the lower exponent (the OCP spec's exact floor(log2 amax) - 2)."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, -5.0], np.float64)
    row = np.zeros(32)
    row[0] = 6.0
    row[1:11] = mids
    below = np.zeros(32)
    below[0] = np.nextafter(np.float32(2.0 ** 2), np.float32(0))  # amax just below 4
    below[1] = 0.3
    w = (np.stack([row, below]) * 2.0 ** k).astype(np.float32)
    q = Q.quantize(jnp.asarray(w), Q.mxfp4("ocp"), axis=-1)
    ref, e = _mx_reference(w)
    np.testing.assert_array_equal(np.asarray(Q.dequantize(q)).reshape(-1), ref.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1).astype(int) - 127, e.astype(int))
    for rule in ("ceil", "alpha3"):  # the exact exponent: ceil never clips the block maximum
        d = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), Q.mxfp4(rule), axis=-1)))
        assert np.all(np.abs(d).max(1) <= np.abs(w).max(1) * 1.5), rule


def test_int4_scale_saturates_instead_of_nan_and_bad_blocks_are_named():
    w = np.full((1, 32), 1e6, np.float32)  # amax / 7 is beyond float16
    for fmt in (Q.int4(group=32), Q.int4(group=32, scale="rms")):
        assert np.isfinite(np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), fmt, axis=-1)))).all()
    for spec in ("e1m2:block=0", "e1m2:block=3", "e1m2:block=-16", "e1m2:block=abc"):
        with pytest.raises(ValueError, match="e1m2 block=.* is invalid: must be an even int >= 2"):
            Q.get_format(spec)


def test_mxfp4_rules_never_clip_except_ocp():
    rng = np.random.RandomState(2)
    w = rng.randn(512, 32).astype(np.float32)
    for rule in ("ceil", "alpha3"):
        d = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), Q.mxfp4(rule), axis=-2)))
        blocks_w, blocks_d = w.T.reshape(-1, 32), d.T.reshape(-1, 32)
        # the block maximum is never clipped: it is reproduced within half a grid step
        amax = np.abs(blocks_w).max(1)
        err_at_max = np.abs(np.abs(blocks_d).max(1) - amax)
        # scaled block maxima lie in (3, 6]: the largest gap there is 4 -> 6, so the max
        # moves by at most one scaled unit, i.e. by at most amax / 5 (bounded here by amax / 4)
        assert np.all(err_at_max <= amax / 4 + 1e-6), rule
    ocp = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), Q.mxfp4("ocp"), axis=-2)))
    assert np.abs(ocp).max() < np.abs(w).max()  # the spec rule saturates values above 6 * 2^e


def test_nvfp4_two_level_scaling_matches_definition():
    rng = np.random.RandomState(3)
    w = (rng.randn(128, 48) * 0.7).astype(np.float32)
    q = Q.quantize(jnp.asarray(w), Q.nvfp4(), axis=-2)
    # definition: s_g = amax/(6*448); s_b = e4m3(amax_b/(6 s_g)); q = RTN(x/(s_b s_g)) in [-6, 6]
    s_g = np.float32(np.abs(w).max() / (6 * 448))
    blocks = w.T.reshape(-1, 16)
    s_b = (np.abs(blocks).max(1) / (6 * s_g)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = np.clip(blocks / (s_b[:, None] * s_g), -6, 6).astype(E2M1).astype(np.float32)
    ref = (codes * s_b[:, None] * s_g).reshape(48, 128).T
    np.testing.assert_allclose(np.asarray(q.global_scale).reshape(()), s_g, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(q.scales).astype(np.float32).T.reshape(-1), s_b)
    np.testing.assert_allclose(np.asarray(Q.dequantize(q)), ref, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "fmt, bound",
    [
        # worst case |x - Q(x)| relative to the block maximum: half the widest grid gap
        # (between 4 and 6) at the largest scale the rule allows
        (Q.mxfp4("ceil"), 1.0 / 6.0),  # range 6 * 2^e: half of the widest gap (2^e) = range / 6
        (Q.nvfp4(), 1.0 / 6.0 * 1.07),  # scale = amax / 6 (E4M3 rounding: +-6.25%)
        (Q.int4(32), 0.5 / 7.0 * 1.001),  # scale = amax / 7, error <= scale / 2
        (Q.e1m2(), 0.25 / 3.5 * 1.07),
    ],
)
def test_quantization_error_bounds(fmt, bound):
    rng = np.random.RandomState(4)
    w = rng.standard_t(4, (512, 64)).astype(np.float32)
    d = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), fmt, axis=-2)))
    blocks_w = w.T.reshape(-1, fmt.block)
    blocks_d = d.T.reshape(-1, fmt.block)
    amax = np.abs(blocks_w).max(1, keepdims=True)
    if fmt.name == "mxfp4":
        amax = 6.0 * 2.0 ** np.ceil(np.log2(amax / 6.0))  # the chosen power-of-two range
    assert np.all(np.abs(blocks_w - blocks_d) <= bound * amax + 1e-7)


def test_qarray_is_a_pytree_with_layers_and_bad_shapes_fail():
    w = jnp.asarray(np.random.RandomState(5).randn(3, 64, 16), jnp.float32)  # stacked layers
    q = Q.quantize(w, Q.mxfp4(), axis=-2)
    assert q.shape == (3, 64, 16) and q.codes.shape == (3, 32, 16) and q.scales.shape == (3, 2, 16)
    one = jax.tree.map(lambda a: a[1], q)  # what lax.scan does to stacked params
    np.testing.assert_array_equal(Q.dequantize(one), Q.dequantize(q)[1])
    with pytest.raises(ValueError, match="dimension 48 \\(axis -2\\) is not divisible by the quantization block 32"):
        Q.quantize(jnp.ones((48, 8)), "mxfp4")
    with pytest.raises(ValueError, match="unknown quantization format 'fp3'"):
        Q.get_format("fp3")
    with pytest.raises(ValueError, match="mxfp4 rule='round' is invalid"):
        Q.mxfp4("round")


def test_fake_quant_is_straight_through():
    x = jnp.asarray(np.random.RandomState(6).randn(4, 64), jnp.float32)
    y, vjp = jax.vjp(lambda x: Q.fake_quant(x, "nvfp4"), x)
    np.testing.assert_array_equal(y, Q.dequantize(Q.quantize(x, "nvfp4", axis=-1)))
    (g,) = vjp(jnp.ones_like(y) * 3.0)
    np.testing.assert_array_equal(g, 3.0)


@pytest.mark.parametrize("rule", ["ocp", "ceil", "alpha3"])
def test_mxfp4_block_with_nan_or_inf_decodes_to_nan(rule):
    """A non-finite block gets E8M0's NaN scale (byte 255, OCP MX v1.0): it dequantizes to NaN,
    as NVFP4 does, and the neighbouring blocks are untouched."""
    w = np.ones((2, 64), np.float32)
    w[0, 3], w[1, 40] = np.nan, np.inf
    q = Q.quantize(jnp.asarray(w), Q.mxfp4(rule), axis=-1)
    assert np.asarray(q.scales).tolist() == [[255, np.asarray(q.scales)[0, 1]], [np.asarray(q.scales)[1, 0], 255]]
    d = np.asarray(Q.dequantize(q))
    assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:]).all()
    np.testing.assert_array_equal(d[0, 32:], 1.0)
    np.testing.assert_array_equal(d[1, :32], 1.0)
    assert np.isnan(np.asarray(F.e8m0_decode(jnp.asarray([255], jnp.uint8)))).all()


@pytest.mark.parametrize("fmt", ["int4:group=32", "int4:group=32,scale=rms"])
def test_int4_group_with_nan_or_inf_decodes_to_nan(fmt):
    """As MXFP4 / NVFP4: a group holding inf or NaN decodes to NaN and its neighbours are
    untouched (an inf was clamped into a finite scale: the group read [458528, 0, 0, ...]);
    a huge finite group still saturates to finite values."""
    w = np.ones((3, 64), np.float32)
    w[0, 3], w[1, 40], w[2, 0] = np.inf, np.nan, 1e20
    d = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(w), fmt, axis=-1)))
    assert np.isnan(d[0, :32]).all() and np.isnan(d[1, 32:]).all()
    assert np.isfinite(d[0, 32:]).all() and np.isfinite(d[1, :32]).all() and np.isfinite(d[2]).all()
    np.testing.assert_allclose(d[0, 32:], 1.0, rtol=0.2)
    assert d[2, 0] > 1e4  # saturated at float16's range, finite


@pytest.mark.parametrize("amax", [1e-35, 3e-36, 1e-37])
def test_nvfp4_of_a_tiny_finite_tensor_stays_finite(amax):
    """Below ~3e-35 the tensor scale amax / 2688 is subnormal and XLA:CPU flushes it to 0: every
    block scale became inf and the whole tensor NaN. It is held at float32's smallest normal;
    the definition then gives s_b = e4m3(amax_b / (6 s_g)) and the usual E2M1 codes."""
    rng = np.random.RandomState(0)
    w = (rng.uniform(-1, 1, (32, 2)) * amax / 0.999).astype(np.float32)
    q = Q.quantize(jnp.asarray(w), Q.nvfp4(), axis=-2)
    d = np.asarray(Q.dequantize(q))
    assert np.isfinite(d).all()
    s_g = np.float32(max(np.float64(np.abs(w).max()) / 2688, np.finfo(np.float32).tiny))
    np.testing.assert_allclose(np.asarray(q.global_scale).reshape(()), s_g, rtol=1e-6)
    assert np.abs(d - w).max() <= 0.25 * np.abs(w).max()
    from jaxlm.quant.formats import fake_quant_tokens

    assert np.isfinite(np.asarray(fake_quant_tokens(jnp.asarray(w[:, 0][None]), "nvfp4"))).all()
    with pytest.raises(ValueError, match="global_scale must be finite and > 0"):
        Q.quantize(jnp.asarray(w), Q.nvfp4(), axis=-2, global_scale=0.0)
    with pytest.raises(ValueError, match=r"format options \['rule'\] given with a QFormat"):  # dropped silently
        Q.get_format(Q.mxfp4(), rule="ceil")


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nvfp4_non_finite_value_spoils_only_its_block(bad):
    """The tensor scale is the finite amax / (6 * 448); a block holding a NaN or inf gets
    E4M3's NaN scale and decodes to NaN; every other block equals the definition on the
    tensor without the bad value (ml_dtypes E4M3 / E2M1)."""
    rng = np.random.RandomState(7)
    w = rng.randn(64, 8).astype(np.float32)
    w[20, 5] = bad  # block 1 (rows 16..31) of column 5
    q = Q.quantize(jnp.asarray(w), Q.nvfp4(), axis=-2)
    d = np.asarray(Q.dequantize(q))
    bad_block = np.zeros_like(w, bool)
    bad_block[16:32, 5] = True
    assert np.isnan(d[bad_block]).all() and np.isfinite(d[~bad_block]).all()
    finite = np.where(np.isfinite(w), w, 0.0)
    s_g = np.float32(np.abs(finite).max() / (6 * 448))
    np.testing.assert_allclose(np.asarray(q.global_scale).reshape(()), s_g, rtol=1e-7)
    blocks = w.T.reshape(8, 4, 16)
    s_b = (np.abs(blocks).max(-1) / (6 * s_g)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    codes = np.clip(blocks / (s_b[..., None] * s_g), -6, 6).astype(E2M1).astype(np.float32)
    ref = (codes * s_b[..., None] * s_g).reshape(8, 64).T
    np.testing.assert_allclose(d[~bad_block], ref[~bad_block], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("rule", ["ocp", "ceil", "alpha3"])
def test_mxfp4_near_the_dtypes_maximum_saturates(rule):
    """ceil / alpha3 round values near float16's maximum up to 65536 (inf in float16); a float32
    block of amax >= 2^127 scaled by the subnormal 2^-127 (flushed to 0 on CPU) became zero.
    Both now stay finite, of the right sign, within one E2M1 step of the input."""
    x16 = jnp.asarray([[65504.0, -65504.0] + [1.0] * 30], jnp.float16)
    d16 = np.asarray(Q.dequantize(Q.quantize(x16, Q.mxfp4(rule), axis=-1)), np.float32)
    assert np.isfinite(d16).all() and d16[0, 0] >= 49152 and d16[0, 1] <= -49152
    x32 = jnp.asarray([[3e38, -2e38] + [5e37] * 30], jnp.float32)
    d32 = np.asarray(Q.dequantize(Q.quantize(x32, Q.mxfp4(rule), axis=-1)))
    assert np.isfinite(d32).all() and d32[0, 0] >= 2e38 and d32[0, 1] <= -1e38
    np.testing.assert_allclose(d32[0, 2:], 5e37, rtol=0.5)  # not flushed to zero


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
def test_mxfp4_at_the_smallest_scale_decodes_its_normal_values(rule):
    """A block of amax ~3e-38 (normal float32) gets E8M0 byte 0, scale 2^-127, which is
    subnormal: multiplied by it, the block decoded to zeros on CPU (dense dequantize and the
    W4A16 reference both). Codes times 2^-127 that are normal floats must come back as the OCP
    definition gives them (those that are subnormal themselves flush, as any float32 math on
    this backend does)."""
    from jaxlm.quant.linear import quantized_linear

    w = np.full((1, 32), 1e-38, np.float32)
    w[0, 0], w[0, 1] = 3e-38, -3e-38
    q = Q.quantize(jnp.asarray(w), Q.mxfp4(rule), axis=-1)
    assert int(np.asarray(q.scales).ravel()[0]) == 0
    x = w.astype(np.float64)  # OCP: e = floor(log2(amax)) - 2, clamped to E8M0's range
    e = max(np.floor(np.log2(np.abs(x).max())) - 2, -127)
    ref = (np.clip(x / 2.0 ** e, -6, 6).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
           * 2.0 ** e)
    normal = np.abs(ref) >= np.finfo(np.float32).tiny
    d = np.asarray(Q.dequantize(q), np.float64)
    assert normal[0, :2].all()
    np.testing.assert_array_equal(d[normal], ref[normal].astype(np.float32))
    y = quantized_linear(jnp.asarray([[1.0, -1.0] + [0.0] * 30], jnp.float32), Q.quantize(jnp.asarray(w.T), Q.mxfp4(rule), axis=-2))
    assert float(np.asarray(y)[0, 0]) == pytest.approx(2 * ref[0, 0], rel=1e-6)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "e1m2"])
def test_empty_arrays_quantize_to_empty_arrays(fmt):
    """No rows (an empty batch) or no columns: empty codes and scales, and back (a reshape by -1
    of a zero-size array raised ZeroDivisionError)."""
    for shape, axis in (((0, 64), -1), ((64, 0), -2), ((64, 0), -1), ((2, 0, 64), -1)):
        q = Q.quantize(jnp.zeros(shape, jnp.float32), fmt, axis=axis)
        assert Q.dequantize(q).shape == shape
