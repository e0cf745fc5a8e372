"""Rotary position embeddings (Su et al. 2021, RoFormer eq. 34) and their frequency scalings.

Two registries:
- ``ROPE_SCALING`` maps ``RopeScaling.kind`` to ``fn(inv_freq, scaling) -> inv_freq``
  (``none``, ``linear`` position interpolation, ``llama3``).
- ``ROPE`` maps ``ModelConfig.rope`` to ``fn(x, positions, config) -> x`` applied to
  per-head queries/keys ``[B, T, N, H]`` (``default``: rotate-half layout as in HF
  Llama/Qwen/Mistral checkpoints; ``none``: no positional rotation, NoPE).

Compressed query/key heads (A^3-QK, `jaxlm.compress.a3`) keep a subset of each KV head's
frequency pairs; their original inverse frequencies live in the attention layer as a
`RopeFrequencies` variable ``[n_kv_heads, qk_head_dim/2]`` and `rotate_per_head` applies them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.registry import Registry

ROPE_SCALING: Registry = Registry("rope scaling")
ROPE: Registry = Registry("rope")


@ROPE_SCALING.register("none")
def _no_scaling(inv_freq: np.ndarray, scaling) -> np.ndarray:
    return inv_freq


@ROPE_SCALING.register("linear")
def _linear_scaling(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Position interpolation (Chen et al. 2023): positions / factor == inv_freq / factor."""
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)


@ROPE_SCALING.register("llama3")
def _llama3_scaling(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling (Grattafiori et al. 2024, sec. 3.2)."""
    low_wavelen = scaling.original_max_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def inv_frequencies(config) -> np.ndarray:
    """``theta^(-2i/d)`` for ``i < head_dim/2``, float32, then the configured scaling."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.int64).astype(np.float32) / config.head_dim
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    return ROPE_SCALING[config.rope_scaling.kind](inv_freq, config.rope_scaling)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def rotation_tables(angles: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``(cos, signed_sin)`` of ``angles [..., H/2]`` in the rotate-half layout ``[..., H]``:
    ``[cos, cos]`` and ``[-sin, sin]``, in ``dtype``. The half-width ``cos``/``sin`` are
    materialised (``optimization_barrier``): left to fusion, XLA recomputes both for every
    element of every tensor they rotate (each head, each gradient)."""
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
    cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    return cos.astype(dtype), sin.astype(dtype)


def rotate_with_tables(x: jax.Array, cos: jax.Array, signed_sin: jax.Array) -> jax.Array:
    """``x * cos + rotate_half(x) * sin`` as ``x * cos + swap_halves(x) * signed_sin`` (the
    same products: the sign moves from ``x`` to the table), so no negated copy of ``x``."""
    H = x.shape[-1]
    swapped = jnp.flip(x.reshape(*x.shape[:-1], 2, H // 2), axis=-2).reshape(x.shape)
    return x * cos + swapped * signed_sin


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, N, H]`` by per-pair ``angles [B, T, H/2]`` (rotate-half layout)."""
    cos, signed_sin = rotation_tables(angles[:, :, None, :], x.dtype)  # [B, T, 1, H]
    return rotate_with_tables(x, cos, signed_sin)


class RopeFrequencies(nnx.Variable):
    """Per-head RoPE inverse frequencies of a compressed attention layer ``[K, qk_head_dim/2]``
    (float32). A buffer, not a parameter: the forward stops its gradient, the trainer's
    weight decay skips it, and HF export refuses models that have one."""


def rotate_per_head(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, N, H]`` (rotate-half layout) with per-head inverse frequencies
    ``inv_freq [N, H/2]``; two-axis positions use their sequential coordinate."""
    if positions.ndim == 3:
        positions = positions[..., 0]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq.astype(jnp.float32)  # [B, T, N, H/2]
    return rotate_with_tables(x, *rotation_tables(angles, x.dtype))


@ROPE.register("default")
def apply_rope(x: jax.Array, positions: jax.Array, config) -> jax.Array:
    """Rotate ``x [B, T, N, H]`` by angles ``positions [B, T] * inv_freq`` (rotate-half layout).
    Two-axis positions ``[B, T, 2]`` use their sequential coordinate ``[..., 0]``."""
    if positions.ndim == 3:
        positions = positions[..., 0]
    inv_freq = jnp.asarray(inv_frequencies(config))
    return rotate(x, positions.astype(jnp.float32)[..., None] * inv_freq)


def graph_pair_mask(config) -> np.ndarray:
    """Which frequency pairs the graph coordinate drives: ``graph_rope_pairs`` of them (default
    half), the lowest frequencies (``graph_rope_band="low"``) or the highest."""
    n = config.head_dim // 2
    g = n // 2 if config.graph_rope_pairs is None else config.graph_rope_pairs
    mask = np.zeros(n, bool)
    if g:
        if config.graph_rope_band == "low":
            mask[n - g:] = True  # inv_freq decreases with the pair index
        else:
            mask[:g] = True
    return mask


@ROPE.register("graph")
def graph_rope(x: jax.Array, positions: jax.Array, config) -> jax.Array:
    """Graph-over-Tokens RoPE (Weaver, ICML 2026; the card's 2-D reading, 3.3 [INF]): with
    positions ``[B, T, 2]`` = (position inside the token's node, the node's graph coordinate,
    e.g. hop distance from the query node), one group of frequency pairs rotates by the first
    and the other group by the second, so ``q.k`` depends on both differences (as M-RoPE).
    With ``[B, T]`` positions, or equal coordinates, it is standard RoPE."""
    if positions.ndim == 2:
        return apply_rope(x, positions, config)
    inv_freq = jnp.asarray(inv_frequencies(config))
    coords = jnp.where(jnp.asarray(graph_pair_mask(config)), positions[..., 1:2], positions[..., 0:1])
    return rotate(x, coords.astype(jnp.float32) * inv_freq)


def mrope_sections(config) -> tuple[int, int, int]:
    """Frequency pairs per axis (time, height, width) of ``rope="mrope"``."""
    if config.mrope_section is not None:
        return tuple(config.mrope_section)
    n = config.head_dim // 2
    t = n // 4
    h = (n - t) // 2
    return t, h, n - t - h


@ROPE.register("mrope")
def multimodal_rope(x: jax.Array, positions: jax.Array, config) -> jax.Array:
    """Multimodal RoPE (Qwen2-VL, Wang et al. 2024, sec. 2.1; Qwen2.5-Omni's TMRoPE): positions
    ``[B, T, 3]`` = (time, height, width); the frequency pairs are split in order into
    ``mrope_section`` groups and group ``a`` rotates by axis ``a``. Text tokens carry equal
    coordinates (the diagonal), where this is standard RoPE exactly; ``[B, T]`` positions are
    standard RoPE."""
    if positions.ndim == 2:
        return apply_rope(x, positions, config)
    if positions.shape[-1] != 3:
        raise ValueError(f"rope='mrope' takes positions [B, T, 3] (time, height, width), got {positions.shape}")
    axis = np.repeat(np.arange(3), mrope_sections(config))  # [H/2]
    coords = jnp.take(positions, jnp.asarray(axis), axis=-1)  # [B, T, H/2]
    return rotate(x, coords.astype(jnp.float32) * jnp.asarray(inv_frequencies(config)))


@ROPE.register("none")
def no_rope(x: jax.Array, positions: jax.Array, config) -> jax.Array:
    return x
