"""Pallas kernels against their jnp references, JAX-style: a base class runs the compiled
kernels where an accelerator is present; the ``Interpret`` subclasses run the same tests in
interpret mode on CPU. M in {1, 7, 16, 128}, aligned and unaligned N/K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm.quant as Q
from kernels_pallas import block_quant, lowrank_w4a16, w4a16, w4a4
from kernels_pallas.formats import walsh_hadamard

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
MS = (1, 7, 16, 128)
SHAPES = {"aligned": (256, 256), "unaligned": (160, 200)}  # (K, N); 160 = 5 blocks of 32
FORMATS = {"mxfp4": Q.mxfp4("ocp"), "mxfp4_alpha3": Q.mxfp4("alpha3"), "nvfp4": Q.nvfp4(), "int4_g32": Q.int4(32)}


@pytest.fixture(scope="module")
def weights():
    rng = np.random.RandomState(0)
    return {name: jnp.asarray(rng.randn(*shape) * 0.5, jnp.float32) for name, shape in SHAPES.items()}


def _kw(fmt):
    return dict(element=fmt.element, block=fmt.block, scale_kind=fmt.scale_kind, alpha=fmt.alpha)


def _close(out, ref, rtol):
    """Same math, different accumulation order: agreement relative to the output scale."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    scale = np.abs(ref).max() + 1e-30
    assert np.abs(out - ref).max() <= rtol * scale, (np.abs(out - ref).max(), scale)


class TestKernels:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _backend(self):
        if not self.INTERPRET and not ON_ACCELERATOR:
            # JAX's own convention: on CPU the compiled kernels cannot run, the Interpret
            # subclass below runs the same tests.
            pytest.skip("compiled Pallas kernels need a GPU/TPU; CPU runs TestKernelsInterpret")

    @pytest.mark.parametrize("fmt_name", sorted(FORMATS))
    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_w4a16_matches_reference(self, weights, fmt_name, shape):
        fmt = FORMATS[fmt_name]
        q = Q.quantize(weights[shape], fmt, axis=-2)
        K = SHAPES[shape][0]
        for M in MS:
            x = jnp.asarray(np.random.RandomState(M).randn(M, K), jnp.float32)
            args = (x, q.codes, q.scales, q.global_scale.reshape(()))
            out = w4a16.w4a16_matmul(*args, **_kw(fmt), interpret=self.INTERPRET, out_dtype=jnp.float32)
            ref = w4a16.reference(*args, **_kw(fmt), out_dtype=jnp.float32)
            assert out.shape == (M, SHAPES[shape][1])
            _close(out, ref, 1e-5)
            # and the reference is the dense product with the dequantised weight
            _close(ref, x @ Q.dequantize(q), 1e-5)

    def test_w4a16_bf16_activations(self, weights):
        q = Q.quantize(weights["aligned"], Q.mxfp4(), axis=-2)
        x = jnp.asarray(np.random.RandomState(9).randn(16, 256), jnp.bfloat16)
        args = (x, q.codes, q.scales, q.global_scale.reshape(()))
        out = w4a16.w4a16_matmul(*args, **_kw(q.fmt), interpret=self.INTERPRET)
        assert out.dtype == jnp.bfloat16
        _close(out, w4a16.reference(*args, **_kw(q.fmt)), 2**-7)  # one bf16 rounding of the output

    @pytest.mark.parametrize("rank", [32, 64])
    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_lowrank_matches_reference(self, weights, rank, shape):
        K, N = SHAPES[shape]
        rng = np.random.RandomState(rank)
        q = Q.quantize(weights[shape], Q.mxfp4(), axis=-2)
        P = jnp.asarray(rng.randn(K, rank) * 0.1, jnp.float32)
        Lt = jnp.asarray(rng.randn(rank, N) * 0.1, jnp.float32)
        for M in MS:
            x = jnp.asarray(rng.randn(M, K), jnp.float32)
            args = (x, q.codes, q.scales, q.global_scale.reshape(()), P, Lt)
            out = lowrank_w4a16.lowrank_w4a16_matmul(*args, **_kw(q.fmt), interpret=self.INTERPRET, out_dtype=jnp.float32)
            _close(out, lowrank_w4a16.reference(*args, **_kw(q.fmt), out_dtype=jnp.float32), 1e-5)
        # bf16 activations: the rank-r intermediate z = x P is rounded to bf16 by design (a
        # 16-bit branch), and a different accumulation order may round it the other way;
        # bound: one bf16 half-ulp of z carried through Lt.
        x = jnp.asarray(rng.randn(16, K), jnp.bfloat16)
        args = (x, q.codes, q.scales, q.global_scale.reshape(()), P, Lt)
        out = lowrank_w4a16.lowrank_w4a16_matmul(*args, **_kw(q.fmt), interpret=self.INTERPRET, out_dtype=jnp.float32)
        ref = lowrank_w4a16.reference(*args, **_kw(q.fmt), out_dtype=jnp.float32)
        z = np.asarray(jnp.dot(x, P.astype(x.dtype), preferred_element_type=jnp.float32))
        bound = (np.abs(z) * 2.0**-8) @ np.abs(np.asarray(Lt)) + 1e-5 * np.abs(np.asarray(ref)).max()
        assert np.all(np.abs(np.asarray(out) - np.asarray(ref)) <= bound)

    @pytest.mark.parametrize("transform", ["none", "hadamard", "per_block"])
    @pytest.mark.parametrize("fmt,rule", [("mxfp4", "ocp"), ("mxfp4", "ceil"), ("nvfp4", "none")])
    def test_transform_quantize_matches_reference(self, transform, fmt, rule):
        K, B = 256, (32 if fmt == "mxfp4" else 16)
        rng = np.random.RandomState(1)
        t = {"none": None, "hadamard": jnp.asarray(walsh_hadamard(B)),
             "per_block": jnp.asarray(rng.randn(K // B, B, B) * 0.3, jnp.float32)}[transform]
        for M in MS:
            x = jnp.asarray(rng.randn(M, K), jnp.float32)
            got = block_quant.transform_quantize(x, t, 0.01, fmt=fmt, rule=rule, interpret=self.INTERPRET)
            want = block_quant.reference(x, t, fmt=fmt, rule=rule, global_scale=0.01)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint8), np.asarray(want[1]).view(np.uint8))

    def test_per_block_hadamard_is_bit_identical_to_shared(self):
        H = jnp.asarray(walsh_hadamard(32))
        for M in MS:
            x = jnp.asarray(np.random.RandomState(M).standard_t(3, (M, 512)), jnp.float32)
            shared = block_quant.transform_quantize(x, H, interpret=self.INTERPRET)
            per_block = block_quant.transform_quantize(x, jnp.broadcast_to(H, (16, 32, 32)), interpret=self.INTERPRET)
            np.testing.assert_array_equal(shared[0], per_block[0])
            np.testing.assert_array_equal(shared[1], per_block[1])

    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_w4a4_matches_reference(self, weights, shape):
        K, N = SHAPES[shape]
        q = Q.quantize(weights[shape], Q.mxfp4(), axis=-2)
        f = dict(element="e2m1", block=32, scale_kind="e8m0")
        for M in MS:
            x = jnp.asarray(np.random.RandomState(M).randn(M, K), jnp.float32)
            xc, xs = block_quant.transform_quantize(x, None, interpret=self.INTERPRET)
            out = w4a4.w4a4_matmul(xc, xs, 1.0, q.codes, q.scales, 1.0, x_fmt=f, w_fmt=f, interpret=self.INTERPRET)
            ref = w4a4.reference(xc, xs, 1.0, q.codes, q.scales, 1.0, x_fmt=f, w_fmt=f)
            _close(out, ref, 1e-5)
            # W4A4 vs the exact product: both operands carry ~10% RTN error
            exact = x @ weights[shape]
            assert np.linalg.norm(np.asarray(ref - exact)) <= 0.25 * np.linalg.norm(np.asarray(exact))


class TestKernelsInterpret(TestKernels):
    INTERPRET = True



@pytest.mark.parametrize("matmul", ["w4a16", "lowrank"])
def test_mismatched_operands_are_refused(matmul):
    """A weight for another K, or a block the K tile does not hold whole, is an error naming
    the shapes (the low-rank kernel once read x[:, :64] against a K = 64 weight)."""
    x = jnp.ones((2, 128), jnp.float32)
    q = Q.quantize(jnp.ones((64, 16), jnp.float32), "nvfp4", axis=0)
    kw = _kw(q.fmt)

    def call(x, q, **extra):
        args = (x, q.codes, q.scales, q.global_scale.reshape(()))
        if matmul == "lowrank":
            args += (jnp.zeros((x.shape[1], 2)), jnp.zeros((2, q.codes.shape[1])))
            return lowrank_w4a16.lowrank_w4a16_matmul(*args, **{**kw, **extra}, interpret=True)
        return w4a16.w4a16_matmul(*args, **{**kw, **extra}, interpret=True)

    with pytest.raises(ValueError, match=r"codes \(32, 16\) / scales \(4, 16\) do not match x \(2, 128\)"):
        call(x, q)
    with pytest.raises(ValueError, match="bk=24 must be a multiple of the block 16"):
        call(jnp.ones((2, 64), jnp.float32), q, bk=24)


def test_no_rows_give_empty_outputs():
    """M = 0 (an empty batch) returns empty results (a zero-size grid failed to slice)."""
    q = Q.quantize(jnp.ones((64, 8), jnp.float32), "mxfp4", axis=0)
    out = w4a16.w4a16_matmul(jnp.zeros((0, 64), jnp.float32), q.codes, q.scales, q.global_scale.reshape(()),
                             **_kw(q.fmt), interpret=True)
    assert out.shape == (0, 8)
    codes, scales = block_quant.transform_quantize(jnp.zeros((0, 64), jnp.float32), interpret=True)
    assert codes.shape == (0, 32) and scales.shape == (0, 2)
    fmt = dict(element="e2m1", block=32, scale_kind="e8m0")
    out = w4a4.w4a4_matmul(codes, scales, 1.0, q.codes, q.scales, 1.0, x_fmt=fmt, w_fmt=fmt, interpret=True)
    assert out.shape == (0, 8) and out.dtype == jnp.float32
    out = lowrank_w4a16.lowrank_w4a16_matmul(jnp.zeros((0, 64), jnp.bfloat16), q.codes, q.scales,
                                             q.global_scale.reshape(()), jnp.ones((64, 2)), jnp.ones((2, 8)),
                                             **_kw(q.fmt), interpret=True)
    assert out.shape == (0, 8) and out.dtype == jnp.bfloat16


def test_w4a4_operands_for_another_k_are_refused():
    """Activations and a weight of different K (or scales for another block) are an error
    naming the shapes: the kernel read the padded weight, or half of it, silently."""
    fmt = dict(element="e2m1", block=32, scale_kind="e8m0")
    x = Q.quantize(jnp.ones((2, 128), jnp.float32), "mxfp4", axis=-1)
    for w in (Q.quantize(jnp.ones((64, 8), jnp.float32), "mxfp4", axis=-2),
              Q.quantize(jnp.ones((256, 8), jnp.float32), "mxfp4", axis=-2)):
        with pytest.raises(ValueError, match=r"operands do not match: activation codes \(2, 64\)"):
            w4a4.w4a4_matmul(x.codes, x.scales, 1.0, w.codes, w.scales, 1.0, x_fmt=fmt, w_fmt=fmt, interpret=True)
    w = Q.quantize(jnp.ones((128, 8), jnp.float32), "mxfp4", axis=-2)
    with pytest.raises(ValueError, match="operands do not match"):
        w4a4.w4a4_matmul(x.codes, x.scales[:, :2], 1.0, w.codes, w.scales, 1.0, x_fmt=fmt, w_fmt=fmt, interpret=True)


def test_a_rank_zero_low_rank_branch_is_refused():
    q = Q.quantize(jnp.ones((64, 16), jnp.float32), "nvfp4", axis=0)
    args = (jnp.ones((2, 64), jnp.float32), q.codes, q.scales, q.global_scale.reshape(()))
    with pytest.raises(ValueError, match="rank r=0"):
        lowrank_w4a16.lowrank_w4a16_matmul(*args, jnp.zeros((64, 0)), jnp.zeros((0, 16)), **_kw(q.fmt),
                                           interpret=True)
