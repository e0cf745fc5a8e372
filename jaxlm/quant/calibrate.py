"""Calibration statistics through the model's ``collect`` taps, streamed over batches.

`input_second_moments` returns ``H = E[x x^T]`` of the inputs of chosen linear layers
(``[L, C, C]`` per module, over valid tokens; sums in float32, divided once), the
statistic GPTQ / WUSH / A^3 transforms are built from. Nothing but the running sums is
kept, so the calibration set may be any length. A forward holds the taps of every layer at
once (``[L, B, T, C]`` per site), so each batch is run in slices of at most
``CALIBRATION_BYTES`` of float32 taps (Qwen3-0.6B shape, 64 x 64 tokens: 2.8 GiB in one
forward).
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


#: float32 tap bytes one calibration forward may hold (all layers and sites together)
CALIBRATION_BYTES = 2**29


def _row_slices(graphdef, state, tokens: np.ndarray, valid: np.ndarray, sites, budget: int):
    """``(tokens, valid)`` in slices of rows whose float32 taps fit in ``budget`` bytes; the last
    slice is padded with invalid rows to the same shape (one compilation)."""
    B, T = tokens.shape

    def taps(t, v):
        return nnx.merge(graphdef, state)(t, mask=v, collect=sites).collected

    shapes = jax.eval_shape(taps, jax.ShapeDtypeStruct((1, T), jnp.int32), jax.ShapeDtypeStruct((1, T), bool))
    row_bytes = 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    rows = int(min(B, max(1, budget // max(row_bytes, 1))))
    for start in range(0, B, rows):
        t, v = tokens[start:start + rows], valid[start:start + rows]
        if len(t) < rows and start:
            pad = rows - len(t)
            t = np.concatenate([t, np.zeros((pad, T), t.dtype)])
            v = np.concatenate([v, np.zeros((pad, T), bool)])
        yield t, v


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
    for tokens, valid, *_ in batches:  # (tokens, valid) or with targets, as `example_batches` gives
        tokens, valid = np.asarray(tokens, np.int32), np.asarray(valid, bool)
        for tok, val in _row_slices(graphdef, state, tokens, valid, sites, CALIBRATION_BYTES):
            s, t = _sums(graphdef, state, jnp.asarray(tok), jnp.asarray(val), sites=sites)
            sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
            n += float(t)
    if sums is None or n == 0:
        raise ValueError("input_second_moments: the calibration set has no valid tokens")
    return {m: sums[INPUT_TAPS[m]] / n for m in modules}


@functools.partial(jax.jit, static_argnames=("graphdef", "sites"))
def _taps(graphdef, state, tokens, valid, *, sites):
    out = nnx.merge(graphdef, state)(tokens, mask=valid, collect=sites)
    return {s: out.collected[s].astype(jnp.float32) for s in sites}


def input_samples(
    model, batches: Iterable[tuple[np.ndarray, np.ndarray]], modules: Sequence[str] = tuple(INPUT_TAPS), *,
    n: int = 512, seed: int = 0,
) -> dict[str, np.ndarray]:
    """``{module: X [L, n', C]}``: up to ``n`` input rows (valid tokens, the same rows for
    every layer and module, in the order of the calibration set) drawn uniformly without
    replacement over the whole set with a seeded generator; what objectives that need input
    samples, not only second moments, calibrate on (TwinQuant). Every valid row gets a
    uniform key and the ``n`` smallest keys are kept as the batches stream by (a bottom-n
    reservoir), so memory stays bounded by ``2 n`` rows."""
    bad = [m for m in modules if m not in INPUT_TAPS]
    if bad:
        raise ValueError(f"modules {bad} are invalid: calibratable modules are {sorted(INPUT_TAPS)}")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n={n!r} is invalid: must be a positive int")
    rng = np.random.default_rng(seed)
    sites = tuple(sorted({INPUT_TAPS[m] for m in modules}))
    graphdef, state = nnx.split(model)
    keys = np.empty(0)  # the kept rows' keys, their place in the whole set, and their inputs
    order = np.empty(0, np.int64)
    kept: dict[str, np.ndarray | None] = {s: None for s in sites}
    offset = 0
    for tokens, valid, *_ in batches:
        valid = np.asarray(valid, bool)
        rows = np.flatnonzero(valid.reshape(-1))
        new_keys = rng.random(len(rows))
        if len(rows) > n:  # only this batch's n smallest keys can be among the set's
            best = np.sort(np.argpartition(new_keys, n - 1)[:n])
            rows, new_keys = rows[best], new_keys[best]
        if len(rows):
            got = jax.device_get(_taps(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid),
                                       sites=sites))
            keys = np.concatenate([keys, new_keys])
            order = np.concatenate([order, offset + rows])
            for s in sites:
                x = got[s].reshape(got[s].shape[0], -1, got[s].shape[-1])[:, rows]  # [L, rows, C]
                kept[s] = x if kept[s] is None else np.concatenate([kept[s], x], axis=1)
            if len(keys) > n:
                best = np.argpartition(keys, n - 1)[:n]
                keys, order = keys[best], order[best]
                kept = {s: x[:, best] for s, x in kept.items()}
        offset += valid.size
    if not len(keys):
        raise ValueError("input_samples: the calibration set has no valid tokens")
    ordered = np.argsort(order, kind="stable")
    out = {s: x[:, ordered] for s, x in kept.items()}
    return {m: out[INPUT_TAPS[m]] for m in modules}
