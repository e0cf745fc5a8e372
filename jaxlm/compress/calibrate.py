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
