"""The model-level W4A4 weight types through the Pallas kernels: `TransformedWeight` (fused
per-block transform + activation quantization, `kernels_pallas.block_quant`, then
`kernels_pallas.w4a4`) and `LowRankTransformedWeight` (the low-rank branch plus that W4A4
residual; weight-only: the fused `kernels_pallas.lowrank_w4a16`), against the jnp path
(``Q.backend("reference")``).

As in tests/quant/test_kernels.py, the base class runs the compiled kernels (``kernel``
backend) where a GPU/TPU is present and the ``Interpret`` subclass runs the same tests in
interpret mode on CPU. Tiny shapes: ``C = 128`` inputs, ``R = 64`` outputs, M in {1, 7, 16}
plus a ``[2, 5, C]`` batch (one NVFP4 activation tensor scale per sequence).

Tolerances. Both paths quantize the activations identically: the codes and scales are
compared bit for bit. What remains is float32 arithmetic order (the kernels multiply the
exact 4-bit values and apply the tensor scales and alphas to the float32 accumulator; the
jnp path multiplies the dequantised values), so float32 outputs agree to 1e-5 of the
output's max magnitude (measured <= 7e-7). In bfloat16 the jnp path rounds every
dequantised NVFP4 activation (times its tensor scale) to bfloat16 before the matmul, the
kernel does not (those values are exact in its bf16 compute), and the low-rank branch uses
``A^{-1} P`` rounded to bf16 instead of ``P``: a few bf16 roundings, so 2^-6 of the output
scale (measured <= 0.0056). On an accelerator the compiled in-kernel transform may run at
reduced (TF32) precision; the compiled variant then allows 1% of the activation codes to
differ and 2^-6 of the output scale (that variant runs only where a GPU or TPU is present)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
import jaxlm.quant as Q
from jaxlm.models.layers.linear import linear
from jaxlm.quant import twinquant as tq
from jaxlm.quant.transforms import (
    hadamard_transform, identity_transform, transform_activations, transform_weights, wush_transform,
)
from jaxlm.quant.w4a4 import (
    TransformedWeight, fused_w4a4_supported, jnp_transformed_linear, kernel_weight_format,
    transform_quantize_model,
)
from kernels_pallas import block_quant

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
C, R, RANK = 128, 64, 8
MS = (1, 7, 16)
FORMATS = {"mxfp4": Q.mxfp4("ocp"), "mxfp4_alpha3": Q.mxfp4("alpha3"), "nvfp4": Q.nvfp4()}
METHODS = ("rtn", "hadamard", "wush")
LINEAR_CASES = [(f, m) for f in ("mxfp4", "nvfp4") for m in METHODS] + [("mxfp4_alpha3", "wush")]


def _outliers(rng, shape):
    """Gaussian rows with 6 of the C channels 10x larger (the case the transforms are for)."""
    scale = np.ones(C)
    scale[np.random.RandomState(7).choice(C, 6, replace=False)] = 10.0
    return rng.randn(*shape) * scale


@pytest.fixture(scope="module")
def layer():
    rng = np.random.RandomState(0)
    X = _outliers(rng, (512, C))
    W = rng.randn(C, R) * 0.1
    inputs = [jnp.asarray(_outliers(rng, (M, C)), jnp.float32) for M in MS]
    inputs.append(jnp.asarray(_outliers(rng, (2, 5, C)), jnp.float32))
    return dict(W=W, H=X.T @ X / len(X), inputs=inputs)


def _transform(layer, method, block):
    if method == "rtn":
        return identity_transform(C, block)
    if method == "hadamard":
        return hadamard_transform(C, block)
    return wush_transform(layer["H"], layer["W"], block)


@functools.partial(jax.jit, static_argnames=("fmt",))
def _quantize_weight(W, fmt):
    return Q.quantize(W, fmt, axis=-2)  # jitted: one compile per format instead of eager op-by-op


def _transformed_weight(layer, method, fmt, act="same"):
    T = _transform(layer, method, fmt.block)
    q = _quantize_weight(transform_weights(jnp.asarray(layer["W"], jnp.float32), T), fmt)
    return TransformedWeight(T, q, fmt if act == "same" else act)


def _lowrank_weight(layer, fmt, act):
    """TwinQuant's decomposition with the SVD subspace and the (non-orthogonal) WUSH
    transform, so the kernel's ``A^{-1} P`` is a real solve; no optimisation needed here."""
    U = np.linalg.svd(layer["W"], full_matrices=False)[0][:, :RANK]
    d = jax.jit(tq.decompose)(jnp.asarray(layer["W"], jnp.float32), jnp.asarray(U, jnp.float32),
                              _transform(layer, "wush", fmt.block))
    return tq.LowRankTransformedWeight(d.P, d.L, TransformedWeight(d.T, _quantize_weight(d.residual, fmt), act))


@jax.jit
def _linear_all(xs, w):
    """``linear(x, w)`` for every input in one compiled call (one compile per weight
    structure and backend: the backend is part of the jit cache key)."""
    return [linear(x, w) for x in xs]


def _run(mode, w, xs):
    """Outputs under ``mode``, and whether the trace of ``linear`` contains a Pallas call."""
    with Q.backend(mode):
        return _linear_all(xs, w), "pallas_call" in str(jax.make_jaxpr(linear)(xs[0], w))


@functools.partial(jax.jit, static_argnames=("fmt", "interpret"))
def _codes_all(xs, T, *, fmt, interpret):
    out = []
    for x in xs:
        want = Q.quantize(transform_activations(x, T), fmt, axis=-1)
        got = block_quant.transform_quantize(x, T, want.global_scale.reshape(()), fmt=fmt.name, rule=fmt.rule,
                                             block=fmt.block, interpret=interpret)
        out.append((got, (want.codes, want.scales)))
    return out


@functools.partial(jax.jit, static_argnames=("lowrank",))
def _grads(x, w, lowrank=False):
    g = jax.grad(lambda x, w: jnp.sum(linear(x, w) ** 2), argnums=(0, 1), allow_int=True)(x, w)
    return (g[0], g[1].P, g[1].L, g[1].T) if lowrank else (g[0], g[1].T)


def _close(out, ref, rtol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    scale = np.abs(ref).max()
    assert np.abs(out - ref).max() <= rtol * scale, (np.abs(out - ref).max() / scale, rtol)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


class TestTransformedKernels:
    MODE = "kernel"
    CODE_MISMATCH = 0.01  # compiled: the in-kernel transform may run at TF32 precision
    F32_RTOL = 2.0**-6

    @pytest.fixture(autouse=True)
    def _backend(self):
        if self.MODE == "kernel" and not ON_ACCELERATOR:
            # as in test_kernels.py (JAX's convention): compiled Pallas kernels cannot run on CPU;
            # the Interpret subclass runs every test here in Pallas interpret mode
            pytest.skip("compiled Pallas kernels need a GPU/TPU; CPU runs TestTransformedKernelsInterpret")

    @pytest.mark.parametrize("fmt_name", sorted(FORMATS))
    def test_activation_codes_equal_the_jnp_quantizer(self, layer, fmt_name):
        """The fused transform + quantize gives the codes and scales of
        ``quantize(transform_activations(x, T))`` (same NVFP4 tensor scale), for RTN,
        Hadamard and WUSH transforms and M in {1, 7, 16}."""
        fmt = FORMATS[fmt_name]
        for method in METHODS:
            T = _transform(layer, method, fmt.block)
            for got, want in _codes_all(layer["inputs"][: len(MS)], T, fmt=fmt, interpret=self.MODE == "interpret"):
                for g, w in zip(got, want):
                    assert g.shape == w.shape
                    assert np.mean(_bits(g) != _bits(w)) <= self.CODE_MISMATCH, method

    def test_per_row_global_scales(self):
        """A per-row NVFP4 tensor scale quantizes each row as a scalar scale would."""
        x = jnp.asarray(np.random.RandomState(3).randn(7, C), jnp.float32)
        g = jnp.asarray([0.01, 0.02, 0.005, 0.01, 1.0, 0.03, 0.002], jnp.float32)
        H = hadamard_transform(C, 16)
        got = block_quant.transform_quantize(x, H, g, fmt="nvfp4", interpret=self.MODE == "interpret")
        reference = jax.jit(block_quant.reference, static_argnames=("fmt",))
        for i in range(7):
            want = reference(x[i:i + 1], H, fmt="nvfp4", global_scale=g[i])
            np.testing.assert_array_equal(got[0][i:i + 1], want[0])
            np.testing.assert_array_equal(_bits(got[1][i:i + 1]), _bits(want[1]))
        with pytest.raises(ValueError, match="one per row"):
            block_quant.reference(x, H, fmt="nvfp4", global_scale=g[:3])

    @pytest.mark.parametrize("fmt_name,method", LINEAR_CASES)
    def test_transformed_linear_matches_jnp_path(self, layer, fmt_name, method):
        w = _transformed_weight(layer, method, FORMATS[fmt_name])
        # the alpha3 rule only adds the 1/3 x 1/3 output factor: one input (a compile less)
        xs = layer["inputs"][-1:] if fmt_name == "mxfp4_alpha3" else layer["inputs"]
        ref, ref_pallas = _run("reference", w, xs)
        out, out_pallas = _run(self.MODE, w, xs)
        assert out_pallas and not ref_pallas  # the kernels ran; the reference is jnp only
        for x, o, r in zip(xs, out, ref):
            assert o.shape == (*x.shape[:-1], R) and o.dtype == x.dtype
            _close(o, r, self.F32_RTOL)

    def test_transformed_linear_bf16_and_gradients(self, layer):
        w = _transformed_weight(layer, "wush", Q.nvfp4())
        xs = [x.astype(jnp.bfloat16) for x in layer["inputs"][2:]]
        for o, r in zip(_run(self.MODE, w, xs)[0], _run("reference", w, xs)[0]):
            assert o.dtype == jnp.bfloat16
            _close(o, r, 2.0**-6)
        # straight-through in the activation quantizer, as the jnp path: d/dx and d/dT agree
        grads = {}
        for mode in ("reference", self.MODE):
            with Q.backend(mode):
                grads[mode] = _grads(layer["inputs"][-1], w)
        for a, b in zip(grads[self.MODE], grads["reference"]):
            _close(a, b, self.F32_RTOL)

    def test_unsupported_weights_run_the_jnp_path(self, layer):
        """INT4 activations, a variant format, a dense weight or a transform block other than
        the activation block cannot run the fused W4A4 kernels: the jnp path runs, unchanged."""
        x = layer["inputs"][1]
        nv = _transformed_weight(layer, "hadamard", Q.nvfp4())
        dense = dataclasses.replace(nv, weight=Q.dequantize(nv.weight))
        unsupported = [
            dataclasses.replace(nv, act_format=Q.int4(16)),
            dataclasses.replace(nv, act_format=dataclasses.replace(Q.nvfp4(), two_level=False)),
            dense,
            dataclasses.replace(nv, T=hadamard_transform(C, 32)),
        ]
        assert fused_w4a4_supported(x, nv)
        assert not any(fused_w4a4_supported(x, w) for w in unsupported)
        # weights: the kernels decode MXFP4, NVFP4 and absmax INT4; not e.g. an RMS-scaled
        # midrise INT4 (a variant of the int4 format) or E1M2
        assert kernel_weight_format(Q.int4(32)) and kernel_weight_format(Q.mxfp4("ceil"))
        assert not kernel_weight_format(dataclasses.replace(Q.int4(32), element="int4m", rule="rms"))
        assert not kernel_weight_format(Q.e1m2())
        out, pallas = _run(self.MODE, dense, [x])
        assert not pallas
        np.testing.assert_array_equal(out[0], jax.jit(jnp_transformed_linear)(x, dense))

    @pytest.mark.parametrize("fmt_name,act", [("nvfp4", "w4a4"), ("mxfp4", "w4a16")])
    def test_lowrank_matches_jnp_path(self, layer, fmt_name, act):
        """W4A4: the jnp low-rank branch plus the fused W4A4 residual (the residual kernels
        are covered format by format above); weight-only: the fused low-rank + W4A16 kernel
        (NVFP4 weight-only: `test_lowrank_weight_only_bf16_and_gradients`)."""
        fmt = FORMATS[fmt_name]
        w = _lowrank_weight(layer, fmt, fmt if act == "w4a4" else None)
        xs = layer["inputs"]
        ref, _ = _run("reference", w, xs)
        out, out_pallas = _run(self.MODE, w, xs)
        assert out_pallas
        for x, o, r in zip(xs, out, ref):
            assert o.shape == (*x.shape[:-1], R)
            _close(o, r, self.F32_RTOL)

    def test_lowrank_weight_only_bf16_and_gradients(self, layer):
        """The fused low-rank kernel: bf16 activations and factors (as a bf16 model stores
        them), and gradients in x, P, L, T equal to the jnp path's."""
        w = _lowrank_weight(layer, Q.nvfp4(), None)
        wb = dataclasses.replace(w, P=w.P.astype(jnp.bfloat16), L=w.L.astype(jnp.bfloat16))
        xs = [x.astype(jnp.bfloat16) for x in layer["inputs"][2:]]
        for o, r in zip(_run(self.MODE, wb, xs)[0], _run("reference", wb, xs)[0]):
            _close(o, r, 2.0**-6)
        grads = {}
        for mode in ("reference", self.MODE):
            with Q.backend(mode):
                grads[mode] = _grads(layer["inputs"][-1], w, lowrank=True)
        for a, b in zip(grads[self.MODE], grads["reference"]):
            _close(a, b, self.F32_RTOL)

    def test_wush_nvfp4_model_generates_same_through_kernels_and_reference(self):
        """A tiny model quantized with WUSH + NVFP4 (W4A4 in all 7 projections of both
        scanned layers, every projection [64, 64] so the quantizer compiles once): greedy
        generation (prefill [B, T, C], then [B, 1, C] decode steps: per-sequence NVFP4
        activation scales) is identical through the kernels and the jnp path."""
        cfg = jaxlm.ModelConfig.tiny(d_model=64, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                                     scan_layers=True)
        model = jaxlm.build_model(cfg, seed=0)
        rng = np.random.RandomState(0)
        calibration = [(rng.randint(3, 259, (4, 32)), np.ones((4, 32), bool))]
        qmodel = transform_quantize_model(model, "wush", "nvfp4", calibration)
        prompts = [[1, 50, 60, 70, 80], [1, 70]]
        out = {}
        for mode in ("reference", self.MODE):
            with Q.backend(mode):
                out[mode] = jaxlm.generate(qmodel, prompts, max_new_tokens=6, temperature=0)
        np.testing.assert_array_equal(out[self.MODE].tokens, out["reference"].tokens)
        assert out["reference"].tokens.shape == (2, 6)


class TestTransformedKernelsInterpret(TestTransformedKernels):
    MODE = "interpret"
    CODE_MISMATCH = 0.0  # bit-identical codes and scales
    F32_RTOL = 1e-5
