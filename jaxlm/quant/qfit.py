"""Q-FIT (ReQAT, aiha-lab/ReQAT ``optimize_pre_rope_scaling``): make keys friendlier to a
4-bit KV cache with two transforms that leave attention unchanged before quantization.

Per layer, from calibration pre-RoPE keys ``k [T, K, H]`` (rotate-half pairs ``(c, c+H/2)``):

* paired scale ``s[h, c] = s[h, c + H/2] = max(kmax[h, c], kmax[h, c + H/2])``,
  ``kmax = max_t |k|``; ``K' = K / s^a_s`` and ``Q' = Q s^a_s`` (the KV head's scale repeated
  over its GQA group), so ``q . k`` is unchanged, and equal scaling of a rotation pair
  commutes with RoPE: the scale is folded into the columns of ``W_q`` / ``W_k`` (and biases);
* shift ``m = mean_t k_t`` (pre-RoPE, unscaled, as the reference computes it) subtracted
  from the *post-RoPE* keys: ``q . (k - a_m m)`` changes every score of a query by the same
  amount, so softmax is unchanged. `fold_qfit` stores ``a_m m`` in the model's ``k_shift``
  parameter (``ModelConfig.k_shift``: subtracted before the KV fake quant and the cache write,
  so QAT, checkpoints and cached decoding carry it); `qfit_shift` applies it instead as an
  intervention at the ``k_rot`` tap;
* ``(a_s, a_m)`` by grid search over ``{0, 1/grid, ..., (grid-1)/grid}^2`` minimising the
  mean squared attention-output error with keys and values fake-quantized in ``fmt``
  (E1M2 / E4M3 / 16 in ReQAT). The reference computes this error without a causal mask;
  ``causal=True`` (default here) uses the model's own mask.
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.models.interventions import Intervention, layer_mask
from jaxlm.models.layers.rope import ROPE
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.quant.formats import fake_quant, get_format


@struct.dataclass
class QFitResult:
    scale: jax.Array  # [L, K, H] paired per-channel key scale s
    shift: jax.Array  # [L, K, H] key mean m
    alpha_s: jax.Array  # [L]
    alpha_m: jax.Array  # [L]
    error: jax.Array  # [L] attention-output MSE at the chosen alphas
    error_none: jax.Array  # [L] the same at alpha_s = alpha_m = 0 (no Q-FIT)


def _positions(valid):
    return jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)


def _attention(q, k, v, valid, causal: bool):
    """softmax(q k^T / sqrt(H)) v with GQA, over ``[B, T, *, H]`` inputs."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k) / np.sqrt(H)
    mask = valid[:, None, None, None, :]
    if causal:
        mask = mask & jnp.tril(jnp.ones((T, T), bool))[None, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v)
    return o.reshape(B, T, N, H)


@functools.partial(jax.jit, static_argnames=("config", "fmt", "grid", "causal"))
def _layer_search(q, k, v, valid, *, config, fmt, grid, causal):
    rope = ROPE[config.rope]
    pos = _positions(valid)
    H = k.shape[-1]
    m = valid.astype(jnp.float32)[..., None, None]
    kmax = jnp.max(jnp.abs(k) * m, axis=(0, 1))  # [K, H]
    half = jnp.maximum(kmax[:, : H // 2], kmax[:, H // 2:])
    s = jnp.concatenate([half, half], axis=-1)
    s = jnp.where(s > 0, s, 1.0)
    shift = jnp.sum(k * m, axis=(0, 1)) / jnp.maximum(jnp.sum(m), 1.0)  # [K, H]
    rep = q.shape[2] // k.shape[2]
    ref = _attention(rope(q, pos, config), rope(k, pos, config), v, valid, causal)
    vq = fake_quant(v, fmt, axis=-1)

    def err(a_s, a_m):
        f = s**a_s
        qs = q * jnp.repeat(f, rep, axis=0)
        ks = rope(k / f, pos, config) - a_m * shift
        out = _attention(rope(qs, pos, config), fake_quant(ks, fmt, axis=-1), vq, valid, causal)
        d = (out - ref) * valid[..., None, None]
        return jnp.sum(d * d) / jnp.maximum(jnp.sum(valid), 1.0)

    alphas = jnp.arange(grid, dtype=jnp.float32) / grid
    errs = jax.vmap(lambda a: jax.vmap(lambda b: err(a, b))(alphas))(alphas)  # [a_s, a_m]
    best = jnp.argmin(errs)
    i, j = best // grid, best % grid
    return s, shift, alphas[i], alphas[j], errs[i, j], errs[0, 0]


def qfit_calibrate(model, batches: Iterable[tuple[np.ndarray, np.ndarray]], *, fmt="e1m2", grid: int = 20,
                   causal: bool = True) -> QFitResult:
    """Q-FIT's scales, shifts and alphas per layer from right-padded ``(tokens, valid)``
    calibration batches (concatenated; keep the calibration set small)."""
    if isinstance(grid, (bool, np.bool_)) or not isinstance(grid, (int, np.integer)) or grid < 1:
        raise ValueError(f"grid={grid!r} is invalid: must be a positive int (alphas 0, 1/grid, ..., (grid-1)/grid)")
    grid = int(grid)
    fmt = get_format(fmt)
    c = model.config
    if c.qk_head_dim != c.head_dim or c.v_head_dim != c.head_dim:
        raise ValueError(f"qfit_calibrate: compressed heads (qk_head_dim={c.qk_head_dim}, v_head_dim="
                         f"{c.v_head_dim}, head_dim={c.head_dim}) are not supported")
    if c.per_layer_kv:
        raise ValueError(f"qfit_calibrate: per-layer head widths (layer_qk_head_dims={c.layer_qk_head_dims}, "
                         f"layer_v_head_dims={c.layer_v_head_dims}) are not supported")
    if c.head_dim % 2 or c.head_dim % fmt.block:
        raise ValueError(f"head_dim={c.head_dim} must be even and a multiple of the {fmt.name} block {fmt.block}")
    pairs = [(b[0], b[1]) for b in batches]  # (tokens, valid) or (tokens, valid, targets)
    if not pairs:
        raise ValueError("qfit_calibrate: no calibration batches")
    toks, vals = zip(*pairs)
    tokens, valid = jnp.asarray(np.concatenate(toks)), jnp.asarray(np.concatenate(vals), bool)
    if not bool(valid.any()):
        raise ValueError("qfit_calibrate: the calibration set has no valid tokens")
    out = model(tokens, mask=valid, collect=("q", "k", "v"))
    res = [
        _layer_search(out.collected["q"][i].astype(jnp.float32), out.collected["k"][i].astype(jnp.float32),
                      out.collected["v"][i].astype(jnp.float32), valid, config=c, fmt=fmt, grid=grid, causal=causal)
        for i in range(c.n_layers)
    ]
    return QFitResult(*(jnp.stack(x) for x in zip(*res)))


def apply_qfit(model, result: QFitResult):
    """A new model with ``s^a_s`` folded into ``W_q`` (times) and ``W_k`` (divided) columns
    and biases; pair it with `qfit_shift` at inference. Models with qk-norm are refused (the
    norm's shared per-channel weight cannot carry a per-head scale)."""
    c = model.config
    if c.qk_norm:
        raise ValueError("apply_qfit: qk_norm models are not supported (the scale would pass through the norm)")
    graphdef, state = nnx.split(model)
    f = result.scale ** result.alpha_s[:, None, None]  # [L, K, H]
    fq = jnp.repeat(f, c.n_heads // c.n_kv_heads, axis=1).reshape(c.n_layers, -1)  # [L, N*H]
    fk = f.reshape(c.n_layers, -1)

    def fold(path, leaf):
        name = jax.tree_util.keystr(path)
        if "['attn']" not in name or not name.startswith("['layers']"):
            return leaf
        factor = fq if "['q_proj']" in name else fk if "['k_proj']" in name else None
        if factor is None:
            return leaf
        op = jnp.multiply if "['q_proj']" in name else jnp.divide
        if c.scan_layers:
            return op(leaf, factor[:, None, :] if leaf.ndim == 3 else factor).astype(leaf.dtype)
        layer = int(name.split("['layers'][")[1].split("]")[0])
        return op(leaf, factor[layer]).astype(leaf.dtype)

    new = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fold, state))
    new.tokenizer = getattr(model, "tokenizer", None)
    return new


def qfit_shift(result: QFitResult) -> Intervention:
    """The post-RoPE key shift ``k <- k - a_m m`` at every layer (an `Intervention` at
    ``k_rot``; pass it with the model's other interventions)."""
    L = result.shift.shape[0]
    return Intervention(vector=-(result.alpha_m[:, None, None] * result.shift), alpha=jnp.ones((), jnp.float32),
                        layers=layer_mask(None, L), site="k_rot", kind="add")


def fold_qfit(model, result: QFitResult):
    """A new model with Q-FIT applied in its weights: ``s^a_s`` folded into ``W_q`` / ``W_k``
    (`apply_qfit`) and the shift ``a_m m`` stored in each layer's ``k_shift`` parameter
    (config ``k_shift=True``; the model's other config fields, e.g. ``kv_quant``, are kept).
    Before quantization it computes the original function (softmax is shift-invariant), so
    ``attention="sink"`` (a fixed sink logit the shift does not move) is refused."""
    c = model.config
    if c.k_shift:
        raise ValueError("fold_qfit: the model already has ModelConfig.k_shift=True; fit Q-FIT on a model "
                         "without a key shift")
    if c.attention == "sink":
        raise ValueError("fold_qfit: ModelConfig.attention='sink' is not shift-invariant (the sink logit "
                         "does not move with q . m)")
    L = c.n_layers
    if result.shift.shape != (L, c.n_kv_heads, c.qk_head_dim):
        raise ValueError(f"fold_qfit: result.shift has shape {tuple(result.shift.shape)}, expected "
                         f"{(L, c.n_kv_heads, c.qk_head_dim)} for this model")
    flat = flat_params(apply_qfit(model, result))
    m = result.alpha_m[:, None, None] * result.shift
    flat.update({f"layers.{i}.attn.k_shift": m[i] for i in range(L)})
    new = model_from_flat(c.replace(k_shift=True), flat)
    new.tokenizer = getattr(model, "tokenizer", None)
    return new
