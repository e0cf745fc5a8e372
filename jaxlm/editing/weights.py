"""Read and replace the kernels of one module at chosen layers, for stacked (scanned) and
unrolled models alike: the edited weights are one array ``[n, d_in, d_out]``."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def _keys(config, module: str, layers: Sequence[int]) -> dict[str, int | None]:
    parts = "".join(f"['{p}']" for p in module.split(".")) + "['kernel'].value"
    if config.scan_layers:
        return {"['layers']" + parts: None}
    return {f"['layers'][{i}]" + parts: j for j, i in enumerate(layers)}


def layer_kernels(state, config, module: str, layers: Sequence[int]) -> jax.Array:
    """``[n, d_in, d_out]``: the kernels of ``module`` at ``layers`` from a model state."""
    keys = _keys(config, module, layers)
    found: dict[int | None, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        k = jax.tree_util.keystr(path)
        if k in keys:
            found[keys[k]] = leaf
    if len(found) != len(keys):
        raise KeyError(f"module {module!r} has no kernel at layers {list(layers)} in this model")
    if config.scan_layers:
        return found[None][jnp.asarray(layers)]
    return jnp.stack([found[j] for j in range(len(layers))])


def with_layer_kernels(state, config, module: str, layers: Sequence[int], W: jax.Array):
    """A copy of ``state`` whose ``module`` kernels at ``layers`` are ``W [n, d_in, d_out]``."""
    keys = _keys(config, module, layers)
    idx = jnp.asarray(layers)

    def put(path, leaf):
        k = jax.tree_util.keystr(path)
        if k not in keys:
            return leaf
        if keys[k] is None:
            return leaf.at[idx].set(W.astype(leaf.dtype))
        return W[keys[k]].astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(put, state)
