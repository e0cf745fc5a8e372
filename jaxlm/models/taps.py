"""Named per-layer tensors a forward pass can return through ``collect=(...)``.

``Taps`` is handed down the block; each sublayer offers its intermediates with
``value = taps.put(name, value)`` and only the requested names are kept. The
returned value is the (possibly identical) tensor the layer continues with, which
is the hook interventions such as steering attach to.
"""

from __future__ import annotations

from typing import Iterable

import jax

#: name -> what it is (per layer; stacked to ``[n_layers, ...]`` in the output).
COLLECTABLE: dict[str, str] = {
    "hidden": "block output (residual stream after the layer) [B, T, D]",
    "attn_in": "normed input to the q/k/v projections [B, T, D]",
    "q": "queries before RoPE, after qk-norm [B, T, N, H]",
    "k": "keys before RoPE, after qk-norm [B, T, K, H]",
    "q_rot": "queries after RoPE (what the scores use) [B, T, N, H]",
    "k_rot": "keys after RoPE (what the KV cache stores) [B, T, K, H]",
    "v": "values [B, T, K, H]",
    "attn_probs": "attention probabilities, float32 [B, N, T, S]",
    "attn_ctx": "attention output before o_proj (input to o_proj) [B, T, N*H]",
    "attn_out": "o_proj output added to the residual [B, T, D]",
    "mlp_in": "normed input to the MLP [B, T, D]",
    "mlp_act": "input to the MLP down projection [B, T, F]",
    "mlp_out": "MLP output added to the residual [B, T, D]",
    "mlp_beta": "meta_swiglu gate slopes beta, float32 [B, T, F] (only with a condition)",
}


def check_collect(names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        names = (names,)
    names = frozenset(names)
    unknown = sorted(names - COLLECTABLE.keys())
    if unknown:
        raise ValueError(f"collect={unknown} is invalid: collectable names are {sorted(COLLECTABLE)}")
    return names


class Taps:
    """Keeps the requested tensors of one layer and applies the interventions
    (`jaxlm.models.interventions.Intervention`) aimed at a site; ``layer`` is the traced layer index."""

    def __init__(self, names: frozenset[str], interventions: tuple = (), layer: jax.Array | None = None):
        self.names = names
        self.values: dict[str, jax.Array] = {}
        self.interventions = interventions
        self.layer = layer

    def put(self, name: str, value: jax.Array) -> jax.Array:
        for iv in self.interventions:
            if iv.site == name:
                value = iv.apply(value, self.layer)
        if name in self.names:
            self.values[name] = value
        return value
