"""W4A4 linear layers under a block transform (RTN / shared Hadamard / WUSH), as a weight
type: the unchanged model runs ``linear(x, TransformedWeight)``.

``TransformedWeight(T, W~, act_format)`` computes ``Q_a(T x) @ W~`` with ``W~ = T^{-T} W``
stored quantized (a `QArray`, or dense to check function preservation) and the
activations transformed blockwise and fake-quantized in ``act_format`` (``None``: not
quantized). The jnp path runs everywhere; on GPU/TPU the activation transform + quantize
is what `kernels_pallas.block_quant.transform_quantize` fuses.

`transform_quantize_model(model, method, fmt, calibration)` builds the transforms of
every attention / MLP projection from calibration second moments
(`jaxlm.quant.calibrate.input_second_moments`) and returns a new model.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.layers.linear import linear
from jaxlm.quant.calibrate import INPUT_TAPS, input_second_moments
from jaxlm.quant.formats import QArray, QFormat, fake_quant, get_format, quantize
from jaxlm.quant.transforms import (
    hadamard_transform, identity_transform, transform_activations, transform_weights, wush_transform,
)

METHODS = ("rtn", "hadamard", "wush")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransformedWeight:
    T: jax.Array  # [C/B, B, B] per-block transform
    weight: QArray | jax.Array  # T^{-T} W, [C, R]
    act_format: QFormat | None = dataclasses.field(metadata=dict(static=True), default=None)


@linear.register(TransformedWeight)
def transformed_linear(x: jax.Array, w: TransformedWeight) -> jax.Array:
    xt = transform_activations(x, w.T)
    if w.act_format is not None:
        xt = fake_quant(xt, w.act_format, axis=-1)
    return linear(xt.astype(x.dtype), w.weight)


def _transform(method: str, H, W, block: int) -> jax.Array:
    C = W.shape[0]
    if method == "rtn":
        return identity_transform(C, block)
    if method == "hadamard":
        return hadamard_transform(C, block)
    return wush_transform(np.asarray(H), np.asarray(W), block)


def transform_quantize_model(
    model,
    method: str,
    fmt: str | QFormat,
    calibration: Iterable[tuple[np.ndarray, np.ndarray]] | None,
    *,
    modules: tuple[str, ...] = tuple(INPUT_TAPS),
    quantize_weights: bool = True,
    quantize_activations: bool = True,
):
    """A new model whose ``modules`` run W4A4 under ``method``'s transforms.
    ``calibration``: ``(tokens, valid)`` batches (needed by ``wush``).
    ``quantize_weights=quantize_activations=False`` keeps everything in float32: the
    transformed model then computes the original function (a test of exactness)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    fmt = get_format(fmt)
    H = None
    if method == "wush":
        if calibration is None:
            raise ValueError("wush needs calibration batches (second moments of the layer inputs)")
        H = jax.device_get(input_second_moments(model, calibration, modules))

    def build(module, layer, W):
        T = _transform(method, None if H is None else H[module][layer], W, fmt.block)
        Wt = transform_weights(jnp.asarray(W, jnp.float32), T)
        weight = quantize(Wt, fmt, axis=-2) if quantize_weights else Wt.astype(W.dtype)
        return TransformedWeight(T, weight, fmt if quantize_activations else None)

    return map_projections(model, modules, build)


def map_projections(model, modules: Sequence[str], build: Callable[[str, int, jax.Array], Any]):
    """A new model with each ``layers.(i.)?<module>.kernel`` (unrolled or scan-stacked
    layers) replaced by ``build(module, layer, W)`` for ``module`` in ``modules``; stacked
    kernels are split per layer and the built weights (pytrees) stacked again."""
    c = model.config
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    pattern = re.compile(r"^layers\.(?:(\d+)\.)?(" + "|".join(re.escape(m) for m in modules) + r")\.kernel$")

    def one(path, leaf):
        name = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        m = pattern.match(name)
        if m is None:
            return leaf
        module = m.group(2)
        if m.group(1) is not None:
            return build(module, int(m.group(1)), leaf)
        built = [build(module, layer, leaf[layer]) for layer in range(c.n_layers)]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *built)

    new = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(one, pure))
    new.tokenizer = getattr(model, "tokenizer", None)
    return new
