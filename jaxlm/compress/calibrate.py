"""Calibration statistics for A^3 (`jaxlm.compress.a3`), streamed through the model's taps.

One forward per batch collects what the requested components need, per layer, as float32
sums over the valid tokens; `a3_statistics` adds them over batches and divides once at
the end, so any number of batches gives the same moments as one big batch.

* ``attn_in`` ``[L, D+1, D+1]``: ``E[x x^T]`` of the attention input ``x`` (after the
  norm), augmented with a constant 1 so that q/k/v biases fold into the weights (A3-QK
  without RoPE).
* ``attn_z`` ``[L, K, D+1, D+1]``: ``E[z z^T]`` of the attention-weighted input
  ``z_g(i) = sum_j a_gij x_j`` (the model's real attention probabilities), augmented with
  ``sum_j a_gij`` (1 for softmax, the non-sink mass for the ``sink`` variant) so that
  ``attn_ctx_g = z_g W_V (+ b_V)`` exactly, averaged over the query heads ``g`` of each KV
  group (A3-OV); ``[L, N, D+1, D+1]``, one per query head, with ``per_head_z=True`` (needed
  by ``ov_group="average_refit"``; ``G`` times the memory).
* ``mlp_act`` ``[L, F, F]``: ``E[h h^T]`` of the SwiGLU hidden ``h = silu(gate x) * up x``,
  the down projection's input (A3-MLP).
* ``q_pair_energy`` ``[L, N, P]``, ``k_pair_energy`` ``[L, K, P]``: ``E||q_p||^2`` and
  ``E||k_p||^2`` of each RoPE frequency pair ``p = (c, c + H/2)`` (rotation-invariant).
* ``pair_score_energy`` ``[L, N, P]``: ``E[(q_p(i) . k_p(j))^2]`` over the causal
  (``j <= i``) pairs of valid tokens, with RoPE applied: the second moment of pair ``p``'s
  share of each attention score (A3-QK's "exact" pair score). Computed with prefix sums of
  ``k_p k_p^T`` (2x2), never the ``T x T`` score matrix. Sliding windows are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

COMPONENTS = ("qk", "ov", "mlp")


@struct.dataclass
class A3Statistics:
    """Per-layer second moments (means over tokens / token pairs; float32). Fields a
    component did not ask for are None."""

    n_tokens: float = struct.field(pytree_node=False)
    n_pairs: float = struct.field(pytree_node=False)
    attn_in: jax.Array | None = None  # [L, D+1, D+1]
    attn_z: jax.Array | None = None  # [L, K, D+1, D+1] group means, or [L, N, D+1, D+1] per head
    mlp_act: jax.Array | None = None  # [L, F, F]
    q_pair_energy: jax.Array | None = None  # [L, N, P]
    k_pair_energy: jax.Array | None = None  # [L, K, P]
    pair_score_energy: jax.Array | None = None  # [L, N, P]


def check_components(components: Iterable[str]) -> tuple[str, ...]:
    if isinstance(components, str):
        components = tuple(c.strip() for c in components.split(",") if c.strip())
    components = tuple(components)
    bad = [c for c in components if c not in COMPONENTS]
    if bad or not components:
        raise ValueError(f"components={components!r} is invalid: must be a non-empty subset of {COMPONENTS}")
    return tuple(c for c in COMPONENTS if c in components)


def _augment(x: jax.Array, last: jax.Array) -> jax.Array:
    return jnp.concatenate([x, last[..., None].astype(x.dtype)], axis=-1)


def _pairs(x: jax.Array) -> jax.Array:
    """``[..., H]`` rotate-half layout -> ``[..., H/2, 2]`` (the two members of each pair)."""
    half = x.shape[-1] // 2
    return jnp.stack([x[..., :half], x[..., half:]], axis=-1)


def _sites(components: tuple[str, ...]) -> tuple[str, ...]:
    sites = set()
    if "qk" in components:
        sites |= {"attn_in", "q_rot", "k_rot"}
    if "ov" in components:
        sites |= {"attn_in", "attn_probs"}
    if "mlp" in components:
        sites |= {"mlp_act"}
    return tuple(sorted(sites))


@functools.partial(jax.jit, static_argnames=("graphdef", "components", "per_head_z"))
def _batch_sums(graphdef, state, tokens, valid, *, components, per_head_z):
    model = nnx.merge(graphdef, state)
    got = model(tokens, mask=valid, collect=_sites(components)).collected
    m = valid.astype(jnp.float32)  # [B, T]
    out = {}
    if "qk" in components or "ov" in components:
        x = got["attn_in"].astype(jnp.float32)  # [L, B, T, D]
        if "qk" in components:
            xa = _augment(x, jnp.ones(x.shape[:-1])) * m[None, ..., None]
            out["attn_in"] = jnp.einsum("lbti,lbtj->lij", xa, xa)
        if "ov" in components:
            a = got["attn_probs"].astype(jnp.float32)  # [L, B, N, T, S]
            z = _augment(jnp.einsum("lbnts,lbsd->lbntd", a, x), a.sum(-1))
            z = z * m[None, :, None, :, None]
            zz = jnp.einsum("lbnti,lbntj->lnij", z, z)
            if not per_head_z:
                L, N = zz.shape[:2]
                K = model.config.n_kv_heads
                zz = zz.reshape(L, K, N // K, *zz.shape[2:]).mean(2)
            out["attn_z"] = zz
    if "qk" in components:
        q = _pairs(got["q_rot"].astype(jnp.float32)) * m[None, :, :, None, None, None]  # [L, B, T, N, P, 2]
        k = _pairs(got["k_rot"].astype(jnp.float32)) * m[None, :, :, None, None, None]  # [L, B, T, K, P, 2]
        out["q_pair_energy"] = jnp.einsum("lbtnpc->lnp", q * q)
        out["k_pair_energy"] = jnp.einsum("lbtkpc->lkp", k * k)
        kk = jnp.cumsum(jnp.einsum("lbtkpc,lbtkpe->lbtkpce", k, k), axis=2)  # sum_{j <= i} k_j k_j^T
        L, B, T, N, P, _ = q.shape
        K = k.shape[3]
        qg = q.reshape(L, B, T, K, N // K, P, 2)
        e = jnp.einsum("lbtkgpc,lbtkpce,lbtkgpe->lkgp", qg, kk, qg)
        out["pair_score_energy"] = e.reshape(L, N, P)
    if "mlp" in components:
        h = got["mlp_act"].astype(jnp.float32) * m[None, ..., None]
        out["mlp_act"] = jnp.einsum("lbti,lbtj->lij", h, h)
    n_tokens = m.sum()
    n_pairs = jnp.sum(m * jnp.cumsum(m, axis=1))  # valid causal (i, j) pairs, j <= i
    return out, n_tokens, n_pairs


def a3_statistics(model, batches: Iterable[tuple[np.ndarray, np.ndarray]],
                  components: Iterable[str] = COMPONENTS, *, per_head_z: bool = False) -> A3Statistics:
    """Stream ``(tokens [B, T], valid [B, T])`` batches (right-padded; extra entries such as
    loss masks are ignored) through ``model`` and return the moments ``components`` need
    (sums in float32, divided once). All layers are collected in one pass: memory is about
    ``L (D+1)^2 (1 + K) + L F^2`` floats (``N`` instead of ``K`` with ``per_head_z``)."""
    components = check_components(components)
    graphdef, state = nnx.split(model)
    sums, n_tokens, n_pairs = None, 0.0, 0.0
    for tokens, valid, *_ in batches:
        s, nt, npairs = _batch_sums(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool),
                                    components=components, per_head_z=per_head_z)
        sums = s if sums is None else jax.tree.map(jnp.add, sums, s)
        n_tokens += float(nt)
        n_pairs += float(npairs)
    if sums is None or n_tokens == 0:
        raise ValueError("a3_statistics: the calibration set has no valid tokens")
    per_pair = {"pair_score_energy"}
    means = {k: v / (n_pairs if k in per_pair else n_tokens) for k, v in sums.items()}
    return A3Statistics(n_tokens=n_tokens, n_pairs=n_pairs, **means)


# ------------------------------------------------ A3-QK RoPE refit: streamed normal equations
QK_REFIT_WEIGHTS = ("uniform", "attention")


@dataclasses.dataclass
class QKRefitSums:
    """Normal equations of one least-squares step of the RoPE pair refit for one layer: the
    step ``Delta [m, r]`` of one side's kept columns ``W' = W + V Delta`` (``W [D+1, r]`` the
    current columns, bias as the last row; ``V [D+1, m]`` the input basis of the step), with the
    other side fixed, as sums over the calibration token pairs (float64 sums of per-batch float32
    sums). ``Delta`` is flattened row-major (``m * r``).

    ``side="q"``: one block per query head ``n``: ``gram`` ``[K, m r, m r]`` shared by each KV
    group's query heads (uniform weights) or ``[N, ...]`` (attention weights), ``rhs [N, m r]``.
    ``side="k"``: ``gram [K, ...]``, ``rhs [K, ...]`` (a key serves its group's query heads).
    ``residual [N]``: ``sum w (s - s_cur)^2``, ``target [N]``: ``sum w s^2`` per query head, with
    ``s`` the full model's scores and ``s_cur`` the current kept pairs'. A step's weighted squared
    score error is ``residual - 2 Delta . rhs + Delta^T gram Delta`` (summed over the heads a
    block serves).
    """

    gram: np.ndarray
    rhs: np.ndarray
    residual: np.ndarray
    target: np.ndarray
    n_pairs: float


def _rot(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate the last axis of ``x [..., r]`` (rotate-half layout) by ``angles [..., r/2]``."""
    a = jnp.concatenate([angles, angles], axis=-1)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * jnp.cos(a) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(a)


def _rot_both(p: jax.Array, angles: jax.Array) -> jax.Array:
    """``R p R^T`` for ``p [..., r, r]`` and ``R = R(angles)`` (``angles [..., r/2]``)."""
    p = _rot(p, angles[..., None, :])  # rows: p R^T
    return jnp.swapaxes(_rot(jnp.swapaxes(p, -1, -2), angles[..., None, :]), -1, -2)


@functools.partial(jax.jit, static_argnames=("graphdef", "probs"))
def _refit_taps(graphdef, state, tokens, valid, *, probs):
    names = ("attn_in", "q_rot", "k_rot") + (("attn_probs",) if probs else ())
    got = nnx.merge(graphdef, state)(tokens, mask=valid, collect=names).collected
    return tuple(got[n] for n in names)


@functools.partial(jax.jit, static_argnames=("side", "weight"))
def _refit_layer_sums(x, q_full, k_full, probs, valid, wq, wk, freq, basis, *, side, weight):
    """One layer, one batch: ``x [B, T, D]`` layer input, ``q_full [B, T, N, H]`` /
    ``k_full [B, T, K, H]`` the full model's rotated queries / keys (the targets), ``probs``
    ``[B, N, T, S]`` or None, ``wq [N, D+1, r]`` / ``wk [K, D+1, r]`` the current kept columns,
    ``freq [K, r/2]`` their inverse frequencies, ``basis [D+1, m]`` the step's input basis."""
    f32 = jnp.float32
    m = valid.astype(f32)
    B, T, _ = x.shape
    N, K = q_full.shape[2], k_full.shape[2]
    G = N // K
    pos = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0).astype(f32)
    xa = _augment(x.astype(f32), jnp.ones((B, T), f32)) * m[..., None]  # [B, T, D+1]
    xb = xa @ basis.astype(f32)  # [B, T, m]
    ang = pos[:, :, None, None] * freq.astype(f32)[None, None]  # [B, T, K, r/2]
    qf = q_full.astype(f32).reshape(B, T, K, G, -1) * m[:, :, None, None, None]  # [B, T, K, G, H]
    kf = k_full.astype(f32) * m[:, :, None, None]  # [B, T, K, H]
    # the current kept queries / keys, rotated: s_cur(i, j) = qn(i) . kn(j)
    qn = _rot(jnp.einsum("btd,ndr->btnr", xa, wq.astype(f32)).reshape(B, T, K, G, -1), ang[:, :, :, None])
    kn = _rot(jnp.einsum("btd,kdr->btkr", xa, wk.astype(f32)), ang)  # [B, T, K, r]
    if weight == "attention":
        causal = jnp.tril(jnp.ones((T, T), f32))[None] * m[:, :, None] * m[:, None, :]  # [B, i, j]
        w = probs.astype(f32).reshape(B, K, G, T, T) * causal[:, None, None]  # [B, K, G, i, j]
        s = jnp.einsum("bikgh,bjkh->bkgij", qf, kf)  # the full model's scores
        res = w * (s - jnp.einsum("bikga,bjka->bkgij", qn, kn))  # weighted residual
        target = jnp.einsum("bkgij,bkgij->kg", w * s, s)
        residual = jnp.einsum("bkgij,bkgij->kg", res, s - jnp.einsum("bikga,bjka->bkgij", qn, kn))
    else:  # prefix sums over j <= i, never the T x T scores
        pre = lambda a: jnp.cumsum(a, axis=1)  # noqa: E731
        kk = pre(jnp.einsum("btkh,btke->btkhe", kf, kf))
        nf = pre(jnp.einsum("btka,btkh->btkah", kn, kf))  # sum_j kn(j) kf(j)^T
        nn = pre(jnp.einsum("btka,btkc->btkac", kn, kn))
        target = jnp.einsum("btkgh,btkhe,btkge->kg", qf, kk, qf)
        residual = (target - 2 * jnp.einsum("btkga,btkah,btkgh->kg", qn, nf, qf)
                    + jnp.einsum("btkga,btkac,btkgc->kg", qn, nn, qn))
    if side == "q":  # features xb_i (x) R(-t_i) kn(j): the score is q'(i)^T R(t_j - t_i) k'(j)
        if weight == "attention":
            mats = _rot_both(jnp.einsum("bkgij,bjka,bjkc->bikgac", w, kn, kn), -ang[:, :, :, None])
            y = jnp.einsum("bkgij,bjka->bikga", res, kn)
        else:
            mats = _rot_both(nn, -ang)[:, :, :, None]  # [B, T, K, 1, r, r]
            y = jnp.einsum("btkah,btkgh->btkga", nf, qf) - jnp.einsum("btkac,btkgc->btkga", nn, qn)
        y = _rot(y, -ang[:, :, :, None])  # [B, T, K, G, r]: sum_j w (s - s_cur) R(-t_i) kn(j)
        gram = jnp.einsum("bti,btj,btkgac->kgiajc", xb, xb, mats)
        rhs = jnp.einsum("bti,btkga->kgia", xb, y)
    else:  # keys: features xb_j (x) R(-t_j) qn(i), summed over i >= j and the group's heads
        if weight == "attention":
            p = jnp.einsum("bkgij,bikga,bikgc->bjkac", w, qn, qn)
            y = jnp.einsum("bkgij,bikga->bjka", res, qn)
        else:
            suf = lambda a: jnp.flip(jnp.cumsum(jnp.flip(a, 1), axis=1), 1)  # noqa: E731 (sum_{i >= j})
            p = suf(jnp.einsum("btkga,btkgc->btkac", qn, qn))
            y = (jnp.einsum("btkah,btkh->btka", suf(jnp.einsum("btkga,btkgh->btkah", qn, qf)), kf)
                 - jnp.einsum("btkac,btkc->btka", p, kn))
        y = _rot(y, -ang)  # [B, T, K, r]
        gram = jnp.einsum("bti,btj,btkac->kiajc", xb, xb, _rot_both(p, -ang))[:, None]
        rhs = jnp.einsum("bti,btka->kia", xb, y)[:, None]
    n_pairs = jnp.sum(m * jnp.cumsum(m, axis=1))
    return gram, rhs, residual, target, n_pairs


def qk_refit_sums(model, batches: Iterable[tuple[np.ndarray, np.ndarray]], kept: dict, *, side: str,
                  weight: str = "uniform") -> dict[int, QKRefitSums]:
    """Stream ``batches`` through ``model`` (the uncompressed one: its layer inputs and full rotated
    queries / keys are the inputs and targets) and accumulate, for each layer in ``kept``
    (``{layer: (wq [N, D+1, r], wk [K, D+1, r], freq [K, r/2], basis [D+1, m])}``: the current
    kept columns with biases as the last row, their inverse frequencies and the step's input
    basis), the normal equations of the least-squares step of one side (``"q"`` or ``"k"``) with
    the other side fixed, over the causal token pairs ``j <= i`` of each sequence, weighted
    equally (``"uniform"``: the score error) or by the model's attention probabilities
    (``"attention"``). Memory: ``(m r)^2`` floats per KV group (per query head with attention
    weights) and layer; no activations are kept across batches."""
    if side not in ("q", "k"):
        raise ValueError(f"side={side!r} is invalid: must be 'q' or 'k'")
    if weight not in QK_REFIT_WEIGHTS:
        raise ValueError(f"weight={weight!r} is invalid: must be one of {QK_REFIT_WEIGHTS}")
    graphdef, state = nnx.split(model)
    acc: dict[int, list] = {}
    for tokens, valid, *_ in batches:
        tokens, valid = jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool)
        taps = _refit_taps(graphdef, state, tokens, valid, probs=weight == "attention")
        for layer, (wq, wk, freq, basis) in kept.items():
            probs = taps[3][layer] if weight == "attention" else None
            got = _refit_layer_sums(taps[0][layer], taps[1][layer], taps[2][layer], probs, valid,
                                    *(jnp.asarray(a, jnp.float32) for a in (wq, wk, freq, basis)),
                                    side=side, weight=weight)
            got = [np.asarray(a, np.float64) for a in got[:4]] + [float(got[4])]
            acc[layer] = got if layer not in acc else [a + b for a, b in zip(acc[layer], got)]
    if not acc:
        raise ValueError("qk_refit_sums: no batches (or no layers in kept)")
    out = {}
    for layer, (gram, rhs, residual, target, n_pairs) in acc.items():
        # gram [K, G or 1, m, r, m, r], rhs [K, G (side q) or 1 (side k), m, r], residual / target [K, G]
        K, g, d, r = gram.shape[:4]
        out[layer] = QKRefitSums(gram=gram.reshape(K * g, d * r, d * r), rhs=rhs.reshape(-1, d * r),
                                 residual=residual.reshape(-1), target=target.reshape(-1), n_pairs=n_pairs)
    return out
