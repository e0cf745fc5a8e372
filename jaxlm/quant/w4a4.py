"""W4A4 linear layers under a block transform (RTN / shared Hadamard / WUSH), as a weight
type: the unchanged model runs ``linear(x, TransformedWeight)``.

``TransformedWeight(T, W~, act_format)`` computes ``Q_a(T x) @ W~`` with ``W~ = T^{-T} W``
stored quantized (a `QArray`, or dense to check function preservation) and the
activations transformed blockwise and fake-quantized in ``act_format`` (``None``: not
quantized). Under the ``reference`` backend (CPU ``auto``) the jnp path runs
(`jnp_transformed_linear`); under ``kernel`` (GPU/TPU ``auto``) or ``interpret``, a W4A4 weight
the kernels support (`fused_w4a4_supported`) runs
`kernels_pallas.block_quant.transform_quantize` (per-block transform + activation
quantization in one pass, NVFP4 tensor scale computed as the jnp path does) and then
`kernels_pallas.w4a4.w4a4_matmul` on the stored weight codes; other formats fall back to
the jnp path. Verified in interpret mode (tests/quant/test_transformed_kernels.py); the
compiled GPU/TPU lowering has not run.

`transform_quantize_model(model, method, fmt, calibration)` builds the transforms of
every attention / MLP projection from calibration second moments
(`jaxlm.quant.calibrate.input_second_moments`) and returns a new model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.layers.linear import linear
from jaxlm.quant.backend import backend, resolved_backend
from jaxlm.quant.calibrate import INPUT_TAPS, input_second_moments
from jaxlm.quant.formats import (
    QArray,
    QFormat,
    fake_quant_tokens,
    get_format,
    int4,
    mxfp4,
    nvfp4,
    quantize,
)
from jaxlm.quant.gptq import INNER, gptq_transform_quantize
from jaxlm.quant.transforms import (
    hadamard_transform,
    identity_transform,
    transform_activations,
    transform_weights,
    wush_transform,
)
from kernels_pallas import block_quant
from kernels_pallas import w4a4 as w4a4_kernel

METHODS = ("rtn", "hadamard", "wush")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransformedWeight:
    T: jax.Array  # [C/B, B, B] per-block transform
    weight: QArray | jax.Array  # T^{-T} W, [C, R]
    act_format: QFormat | None = dataclasses.field(metadata=dict(static=True), default=None)


@linear.register(TransformedWeight)
def transformed_linear(x: jax.Array, w: TransformedWeight) -> jax.Array:
    """``Q_a(T x) @ W~``. Backend ``kernel``/``interpret`` (`jaxlm.quant.backend`) with a
    W4A4 weight the kernels support (`fused_w4a4_supported`): the fused Pallas path
    (`kernels_pallas.block_quant.transform_quantize` + `kernels_pallas.w4a4.w4a4_matmul`);
    otherwise, and always under ``reference``, the jnp path (`jnp_transformed_linear`)."""
    mode = resolved_backend()
    if mode != "reference" and fused_w4a4_supported(x, w):
        return _fused_w4a4(x, w, mode)
    return jnp_transformed_linear(x, w)


def jnp_transformed_linear(x: jax.Array, w: TransformedWeight) -> jax.Array:
    """The jnp path: transform, fake-quantize (straight-through), then ``linear`` (which runs
    a `QArray` weight through the W4A16 kernel or its reference, per the backend)."""
    xt = transform_activations(x, w.T)
    if w.act_format is not None:
        xt = fake_quant_tokens(xt, w.act_format)
    return linear(xt.astype(x.dtype), w.weight)


# ------------------------------------------------------------ fused kernel path

#: activation formats `kernels_pallas.block_quant` quantizes exactly as `formats.quantize`
#: does (QFormat equality compares every field, so a variant or a new format never matches)
KERNEL_ACT_FORMATS = (mxfp4("ocp"), mxfp4("ceil"), mxfp4("alpha3"), nvfp4())


def kernel_weight_format(fmt: QFormat) -> bool:
    """Weight formats the Pallas kernels decode (`kernels_pallas.formats.dequantize_packed_rows`)."""
    return fmt in KERNEL_ACT_FORMATS or (fmt.name == "int4" and fmt == int4(fmt.block))


def kernel_weight(q) -> bool:
    """A 2-D ``[K, N]`` `QArray` packed along K in a kernel format (the layout both the
    W4A16 and the W4A4 kernels read as stored: no conversion)."""
    return isinstance(q, QArray) and q.axis == -2 and q.ndim == 2 and kernel_weight_format(q.fmt)


def fused_w4a4_supported(x: jax.Array, w: TransformedWeight) -> bool:
    """Whether `transformed_linear` can run ``w`` through the fused W4A4 kernels: quantized
    activations in an MXFP4/NVFP4 format (`KERNEL_ACT_FORMATS`), a kernel `QArray` weight, a
    per-block ``T`` whose block is the activation block, ``x`` with >= 2 dims. Anything else
    (INT4 or other activation formats, dense weights, ...) runs the jnp path."""
    act = w.act_format
    return (
        act in KERNEL_ACT_FORMATS and kernel_weight(w.weight) and x.ndim >= 2
        and w.T.ndim == 3 and w.T.shape[1:] == (act.block, act.block)
        and w.T.shape[0] * act.block == x.shape[-1] == w.weight.shape[0]
    )


def _fmt_kw(fmt: QFormat) -> dict:
    return dict(element=fmt.element, block=fmt.block, scale_kind=fmt.scale_kind)


def _fused_w4a4_forward(x: jax.Array, w: TransformedWeight, mode: str) -> jax.Array:
    act, q = w.act_format, w.weight
    C, N = q.shape
    rows = x.reshape(-1, C)
    g_rows = None
    if act.two_level:
        # NVFP4's activation tensor scale, one per token and computed exactly as the jnp
        # path computes it (`fake_quant_tokens`: `quantize`'s amax of each row of T x).
        # Costs one extra jnp pass over T x (XLA keeps only the amax).
        xt_rows = transform_activations(x, w.T).reshape(-1, 1, C)
        g_rows = quantize(xt_rows, act, axis=-1).global_scale.reshape(-1)  # [M]
    interpret = mode == "interpret"
    xc, xs = block_quant.transform_quantize(
        rows, w.T, 1.0 if g_rows is None else g_rows, fmt=act.name, rule=act.rule, block=act.block,
        interpret=interpret,
    )
    # weight codes [C/2, N] / scales [C/B, N] as stored; the per-row activation scale is
    # applied to the float32 output (the kernel's epilogue takes one scalar)
    y = w4a4_kernel.w4a4_matmul(
        xc, xs, 1.0, q.codes, q.scales, q.global_scale.reshape(()), x_fmt=_fmt_kw(act), w_fmt=_fmt_kw(q.fmt),
        alpha=act.alpha * q.fmt.alpha, bk=math.lcm(256, act.block, q.fmt.block), interpret=interpret,
        compute_dtype=x.dtype, out_dtype=jnp.float32,
    )
    if g_rows is not None:
        y = y * g_rows[:, None]
    return y.astype(x.dtype).reshape(*x.shape[:-1], N)


def kernel_with_jnp_gradient(forward: Callable, jnp_path: Callable):
    """``forward(x, w, mode)`` (Pallas kernels) in the forward pass; the backward pass is the
    vjp of ``jnp_path(x, w)`` traced under the ``reference`` backend, so gradients equal the
    jnp path's: straight-through quantizers, zero cotangents for integer codes, true
    gradients for ``x`` and the float leaves (transforms, low-rank factors)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def fused(x, w, mode):
        return forward(x, w, mode)

    def fwd(x, w, mode):
        return forward(x, w, mode), (x, w)

    def bwd(mode, res, dy):
        with backend("reference"):
            _, vjp = jax.vjp(jnp_path, *res)
            return vjp(dy)

    fused.defvjp(fwd, bwd)
    return fused


_fused_w4a4 = kernel_with_jnp_gradient(_fused_w4a4_forward, jnp_transformed_linear)


def _transform(method: str, H, W, block: int) -> jax.Array:
    C = W.shape[0]
    if method == "rtn":
        return identity_transform(C, block)
    if method == "hadamard":
        return hadamard_transform(C, block)
    return wush_transform(np.asarray(H), np.asarray(W), block)


@functools.partial(jax.jit, static_argnames=("fmt", "dtype"))
def _transform_and_quantize(W, T, *, fmt: QFormat | None, dtype):
    """``T^{-T} W`` quantized in ``fmt`` (None: cast back to ``dtype``), one compiled program per
    shape. Run eagerly, its few dozen small ops each compile and dispatch on their own: RTN
    NVFP4 on a two-layer Qwen3-0.6B-shaped model spent 137 of 217 s compiling them."""
    Wt = transform_weights(W.astype(jnp.float32), T)
    return quantize(Wt, fmt, axis=-2) if fmt is not None else Wt.astype(dtype)


def transform_quantize_model(
    model,
    method: str,
    fmt: str | QFormat,
    calibration: Iterable[tuple[np.ndarray, np.ndarray]] | None,
    *,
    modules: tuple[str, ...] = tuple(INPUT_TAPS),
    quantize_weights: bool = True,
    quantize_activations: bool = True,
    inner: str = "rtn",
):
    """A new model whose ``modules`` run W4A4 under ``method``'s transforms.
    ``calibration``: ``(tokens, valid)`` batches (needed by ``wush`` and ``inner="gptq"``).
    ``inner``: how the transformed weights are rounded, ``"rtn"`` (each block on its own) or
    ``"gptq"`` (WUSH's GPTQ mode, arXiv 2512.00956: error feedback through the Cholesky
    factor of the input second moment, `jaxlm.quant.gptq`; with ``method="rtn"`` plain GPTQ).
    ``quantize_weights=quantize_activations=False`` keeps everything in float32: the
    transformed model then computes the original function (a test of exactness)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    if inner not in INNER:
        raise ValueError(f"inner={inner!r} is invalid: must be one of {INNER}")
    fmt = get_format(fmt)
    H = None
    if method == "wush" or inner == "gptq":
        if calibration is None:
            need = "wush" if method == "wush" else "inner='gptq'"
            raise ValueError(f"{need} needs calibration batches (second moments of the layer inputs)")
        H = jax.device_get(input_second_moments(model, calibration, modules))

    def build(module, layer, W):
        if inner == "gptq":
            Hl = np.asarray(H[module][layer])
            T, weight = gptq_transform_quantize(Hl, W, fmt if quantize_weights else None, method, block=fmt.block)
            weight = weight if quantize_weights else weight.astype(W.dtype)
            return TransformedWeight(T, weight, fmt if quantize_activations else None)
        T = _transform(method, None if H is None else H[module][layer], W, fmt.block)
        weight = _transform_and_quantize(W, T, fmt=fmt if quantize_weights else None, dtype=jnp.dtype(W.dtype))
        return TransformedWeight(T, weight, fmt if quantize_activations else None)

    return map_projections(model, modules, build)


def map_projections(model, modules: Sequence[str], build: Callable[[str, int, jax.Array], Any]):
    """A new model with each ``layers.(i.)?<module>.kernel`` (unrolled or scan-stacked
    layers) replaced by ``build(module, layer, W)`` for ``module`` in ``modules``; stacked
    kernels are split per layer and the built weights (pytrees) stacked again."""
    c = model.config
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    pattern = re.compile(r"^layers\.(?:(\d+)\.)?(" + "|".join(re.escape(m) for m in modules) + r")\.kernel(\.|$)")

    def one(path, leaf):
        name = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        m = pattern.match(name)
        if m is None:
            return leaf
        if m.group(3):  # a leaf inside a structured weight (QArray codes, a transform...)
            raise ValueError(f"parameter {name[:m.end() - 1]} is already quantized/transformed (its leaf "
                             f"{name[m.end():].lstrip('.')}); quantize the float model")
        module = m.group(2)
        if m.group(1) is not None:
            return build(module, int(m.group(1)), leaf)
        built = [build(module, layer, leaf[layer]) for layer in range(c.n_layers)]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *built)

    new = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(one, pure))
    new.tokenizer = getattr(model, "tokenizer", None)
    return new
