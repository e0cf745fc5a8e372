"""Calibration statistics through the model's ``collect`` taps, streamed over batches.

`input_second_moments` returns ``H = E[x x^T]`` of the inputs of chosen linear layers
(``[L, C, C]`` per module, over valid tokens; sums in float32, divided once), the
statistic GPTQ / WUSH / A^3 transforms are built from. Nothing but the running sums is
kept, so the calibration set may be any length.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: linear module -> the tap holding its input
INPUT_TAPS: dict[str, str] = {
    "attn.q_proj": "attn_in",
    "attn.k_proj": "attn_in",
    "attn.v_proj": "attn_in",
    "attn.o_proj": "attn_ctx",
    "mlp.gate_proj": "mlp_in",
    "mlp.up_proj": "mlp_in",
    "mlp.down_proj": "mlp_act",
}


@functools.partial(jax.jit, static_argnames=("graphdef", "sites"))
def _sums(graphdef, state, tokens, valid, *, sites):
    out = nnx.merge(graphdef, state)(tokens, mask=valid, collect=sites)
    m = valid.astype(jnp.float32)[None, ..., None]
    res = {}
    for s in sites:
        x = out.collected[s].astype(jnp.float32) * m
        res[s] = jnp.einsum("lbti,lbtj->lij", x, x)
    return res, valid.sum().astype(jnp.float32)


def input_second_moments(
    model, batches: Iterable[tuple[np.ndarray, np.ndarray]], modules: Sequence[str] = tuple(INPUT_TAPS)
) -> dict[str, jax.Array]:
    """``{module: H [L, C, C]}`` for each module in ``modules`` (modules sharing an input
    share the array)."""
    bad = [m for m in modules if m not in INPUT_TAPS]
    if bad:
        raise ValueError(f"modules {bad} are invalid: calibratable modules are {sorted(INPUT_TAPS)}")
    sites = tuple(sorted({INPUT_TAPS[m] for m in modules}))
    graphdef, state = nnx.split(model)
    sums, n = None, 0.0
    for tokens, valid in batches:
        s, t = _sums(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool), sites=sites)
        sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
        n += float(t)
    if sums is None or n == 0:
        raise ValueError("input_second_moments: the calibration set has no valid tokens")
    return {m: sums[INPUT_TAPS[m]] / n for m in modules}
