"""Flat views of a model's parameters, the same for stacked (scanned) and unrolled layers.

Names are the parameter paths joined by dots with the layer index spelled out:
``embed``, ``layers.0.attn.q_proj.kernel``, ``final_norm.scale``. HF import/export
and per-layer methods (editing, quantization) work on this view, so they do not
care whether ``config.scan_layers`` is on.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, MutableMapping

import jax
import numpy as np
from flax import nnx

from jaxlm.models.layers.rope import RopeFrequencies
from jaxlm.models.transformer import Transformer, abstract_model


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def _walk(model: Transformer):
    """Yield (name, variable) over the model's Params and buffers (`RopeFrequencies`, present
    only in compressed models)."""
    state = nnx.state(model, nnx.Any(nnx.Param, RopeFrequencies))
    for path, var in nnx.to_flat_state(state):
        yield _path_name(path), var


@functools.lru_cache(maxsize=8)
def _abstract_split(config):
    return nnx.split(abstract_model(config))


def _abstract(config) -> Transformer:
    """A fresh abstract model (new Variables each call). Tracing the constructor of a real-size
    model takes seconds, so its split is cached per (hashable) config."""
    try:
        graphdef, state = _abstract_split(config)
    except TypeError:  # an unhashable config
        return abstract_model(config)
    return nnx.merge(graphdef, state, copy=True)


def flat_params(model: Transformer) -> dict[str, jax.Array]:
    """``{name: array}`` with one entry per layer even when layers are stacked."""
    config = model.config
    out: dict[str, jax.Array] = {}
    for name, var in _walk(model):
        value = var.get_value()
        if config.scan_layers and name.startswith("layers."):
            rest = name[len("layers."):]
            for i in range(config.n_layers):  # a structured weight (QArray) is sliced leaf by leaf, as scan does
                out[f"layers.{i}.{rest}"] = jax.tree.map(lambda a, i=i: a[i], value)
        else:
            out[name] = value
    return out


def param_shapes(config) -> dict[str, jax.ShapeDtypeStruct]:
    """Expected ``{name: ShapeDtypeStruct}`` of the flat view, without allocating."""
    return {name: shape for name, (shape, _) in _flat_specs(config).items()}


def param_axes(config) -> dict[str, tuple[str | None, ...] | None]:
    """Logical axes of each entry of the flat view (a stacked layer's entries: its axes
    without ``layers``), for placing flat arrays on a mesh (`jaxlm.sharding.param_sharding`)."""
    return {name: axes for name, (_, axes) in _flat_specs(config).items()}


def _flat_specs(config):
    out = {}
    for name, var in _walk(_abstract(config)):
        v = var.get_value()
        axes = var.get_metadata().get("out_sharding")
        if config.scan_layers and name.startswith("layers."):
            for i in range(config.n_layers):
                out[f"layers.{i}.{name[len('layers.'):]}"] = (
                    jax.ShapeDtypeStruct(v.shape[1:], v.dtype), None if axes is None else tuple(axes[1:]))
        else:
            out[name] = (jax.ShapeDtypeStruct(v.shape, v.dtype), None if axes is None else tuple(axes))
    return out


def model_from_flat(
    config,
    flat: Mapping[str, jax.Array | np.ndarray],
    *,
    place: Callable[[str, tuple[str | None, ...], np.ndarray], jax.Array] | None = None,
    release: bool = False,
) -> Transformer:
    """Build a `Transformer` from a flat ``{name: array}`` without random initialisation.

    Every expected name must be present with the expected shape (else ``KeyError`` /
    ``ValueError`` naming it); values are cast to the dtype initialisation gives each variable
    (``config.param_dtype`` for weights). ``place``
    (name, logical axes, array) -> device array lets the caller shard on load. ``release``:
    delete each entry from ``flat`` (a mutable mapping) once it is used, so a caller that
    hands over its only references holds one copy of the weights, not two (stacking layers
    makes new arrays).
    """
    if release and not isinstance(flat, MutableMapping):
        raise TypeError(f"release=True needs a mutable mapping, got {type(flat).__name__}")
    model = _abstract(config)
    graphdef, state = nnx.split(model)
    flat_state = nnx.to_flat_state(state)
    for path, var in flat_state:
        name = _path_name(path)
        if config.scan_layers and name.startswith("layers."):
            rest = name[len("layers."):]
            keys = [f"layers.{i}.{rest}" for i in range(config.n_layers)]
            parts = [_fetch(flat, k, var.shape[1:]) for k in keys]
            value = np.stack([np.asarray(p) for p in parts]) if isinstance(parts[0], np.ndarray) else jax.numpy.stack(parts)
            del parts
        else:
            keys = [name]
            value = _fetch(flat, name, var.shape)
        if release:
            for k in keys:
                del flat[k]
        # each variable's own dtype as initialisation makes it (config.param_dtype for weights;
        # float32 for RoPE tables and the sink logits, which the cast to weight_dtype rounded)
        value = value.astype(var.get_value().dtype)
        axes = var.get_metadata().get("out_sharding")
        var.set_value(place(name, axes, value) if place is not None else jax.numpy.asarray(value))
    return nnx.merge(graphdef, nnx.from_flat_state(flat_state))


def _fetch(flat, name, shape):
    if name not in flat:
        raise KeyError(f"missing parameter {name!r} (expected shape {tuple(shape)})")
    value = flat[name]
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"parameter {name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
        )
    return value


def init_params(config, names, *, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial values of just ``names`` (a jitted init whose other outputs XLA drops)."""
    names = list(names)

    @jax.jit
    def build():
        model = Transformer(config, rngs=nnx.Rngs(params=seed))
        flat = flat_params(model)
        return {n: flat[n] for n in names}

    return {k: np.asarray(v) for k, v in build().items()}
