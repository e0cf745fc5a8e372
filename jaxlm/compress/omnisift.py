"""OmniSIFT: modality-asymmetric token compression for omni models (Ding et al., arXiv
2602.04804; method card §7.7).

An audio-visual sequence (`jaxlm.models.omni.AudioVisual`) is cut into chunks of
``frames_per_chunk`` video frames plus the audio of the same span. Per chunk:

- **spatial pruning** of the first frame: drop ``k_v = floor(n * video_ratio)`` patches with
  the highest cosine similarity to the frame's mean feature (the most redundant);
- **temporal pruning** of each later frame: drop ``k_v`` patches with the highest cosine
  similarity to the co-located patch of the frame before it;
- **vision-guided audio selection** (`AudioSelector`): audio and the chunk's remaining video
  projected to ``selector_dim`` with LayerNorm, one cross-attention layer (audio queries,
  video keys/values), residual + LayerNorm, MLP ``d -> d/2 -> 1`` with SiLU, sigmoid; keep the
  top ``n_a - floor(n_a * audio_ratio)`` audio tokens. The straight-through estimator
  ``m = stop_gradient(hard - s) + s`` (`straight_through`) multiplies the audio embeddings, so the forward uses the
  hard mask and the gradient reaches the scores; dropped tokens are then removed.

Only the selector has parameters (the language model stays frozen). Removed tokens leave the
sequence with their three-axis positions, so the kept ones keep theirs. ``retention(rho)``
keeps a share ``rho`` of the media tokens; ``retention(1.0)`` drops nothing and is the
uncompressed model exactly. `random_keep` is the baseline that drops the same numbers of
tokens uniformly at random.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.models.omni import AUDIO, TEXT, VIDEO, OmniSequence


@dataclasses.dataclass(frozen=True)
class OmniSIFTConfig:
    """``video_ratio`` (r_v) of each frame's patches and ``audio_ratio`` (r_a) of each chunk's
    audio tokens are dropped (card defaults 0.5 and 0.3)."""

    video_ratio: float = 0.5
    audio_ratio: float = 0.3
    selector_dim: int = 64
    selector_heads: int = 4

    def __post_init__(self):
        for name in ("video_ratio", "audio_ratio"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"OmniSIFTConfig.{name}={v!r} must be in [0, 1)")
        if self.selector_dim <= 0 or self.selector_dim % self.selector_heads:
            raise ValueError(f"OmniSIFTConfig.selector_dim={self.selector_dim} must be > 0 and divisible by "
                             f"selector_heads={self.selector_heads}")

    @classmethod
    def retention(cls, rho: float, **kw) -> "OmniSIFTConfig":
        """Keep a share ``rho`` in (0, 1] of the video and of the audio tokens."""
        if not 0 < rho <= 1:
            raise ValueError(f"retention rho={rho!r} must be in (0, 1]")
        return cls(video_ratio=1 - rho, audio_ratio=1 - rho, **kw)


@dataclasses.dataclass(frozen=True)
class ClipLayout:
    """Where a batch's media sit (one layout for every row): ``frames [F, P]`` sequence index
    of each frame's patches, ``chunk_of_frame [F]``, ``audio [C, A]`` sequence index of each
    chunk's audio tokens, ``text [Nt]`` the text indices, ``length`` T."""

    frames: np.ndarray
    chunk_of_frame: np.ndarray
    audio: np.ndarray
    text: np.ndarray
    length: int

    @classmethod
    def of(cls, seq: OmniSequence, pad: int = 0) -> "ClipLayout":
        """The layout of ``seq`` left-padded by ``pad`` tokens (`batch_sequences`)."""
        kind, frame, cell, chunk = seq.kind, seq.frame, seq.cell, seq.chunk
        vid = np.flatnonzero(kind == VIDEO)
        if not len(vid) or (chunk[vid] < 0).any():
            raise ValueError("OmniSIFT needs an AudioVisual clip (video in chunks with their audio)")
        F = int(frame[vid].max()) + 1
        P = int(cell[vid].max()) + 1
        frames = np.full((F, P), -1, np.int64)
        frames[frame[vid], cell[vid]] = vid
        if (frames < 0).any():
            raise ValueError("every frame must have the same patch grid")
        chunk_of_frame = np.array([chunk[frames[f, 0]] for f in range(F)])
        aud = np.flatnonzero(kind == AUDIO)
        C = int(chunk_of_frame.max()) + 1
        per = [aud[chunk[aud] == c] for c in range(C)]
        if len({len(p) for p in per}) != 1:
            raise ValueError(f"every chunk must hold the same number of audio tokens, got {[len(p) for p in per]}")
        return cls(frames + pad, chunk_of_frame, np.stack(per) + pad, np.flatnonzero(kind == TEXT) + pad,
                   len(kind) + pad)

    def kept_length(self, config: OmniSIFTConfig) -> int:
        F, P = self.frames.shape
        C, A = self.audio.shape
        return (self.length - F * P - C * A + F * (P - math.floor(P * config.video_ratio))
                + C * (A - math.floor(A * config.audio_ratio)))


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    num = jnp.sum(a * b, -1)
    return num / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-12)


def spatial_redundancy(frame: jax.Array) -> jax.Array:
    """``[..., P, D] -> [..., P]``: cosine similarity of each patch to the frame's mean."""
    return _cosine(frame, jnp.mean(frame.astype(jnp.float32), axis=-2, keepdims=True))


def temporal_redundancy(frame: jax.Array, previous: jax.Array) -> jax.Array:
    """``[..., P, D] -> [..., P]``: cosine similarity of each patch to the co-located one before."""
    return _cosine(frame, previous)


def drop_highest(scores: jax.Array, n_drop: int) -> jax.Array:
    """Keep mask ``[..., N]``: all but the ``n_drop`` highest scores (among ties the earlier
    index is dropped first)."""
    if n_drop == 0:
        return jnp.ones(scores.shape, bool)
    order = jnp.argsort(-scores, axis=-1, stable=True)  # highest first, earlier index first among ties
    return jnp.argsort(order, axis=-1) >= n_drop  # each element's rank


def video_keep(video: jax.Array, layout: ClipLayout, config: OmniSIFTConfig) -> jax.Array:
    """``video [B, F, P, D]`` (each frame's patch embeddings) -> keep mask ``[B, F, P]``:
    spatial pruning of a chunk's first frame, temporal pruning of the later ones."""
    F, P = layout.frames.shape
    k = math.floor(P * config.video_ratio)
    keeps = []
    for f in range(F):
        first = f == 0 or layout.chunk_of_frame[f] != layout.chunk_of_frame[f - 1]
        score = spatial_redundancy(video[:, f]) if first else temporal_redundancy(video[:, f], video[:, f - 1])
        keeps.append(drop_highest(score, k))
    return jnp.stack(keeps, axis=1)


class AudioSelector(nnx.Module):
    """The vision-guided audio selector (see the module docstring): scores in (0, 1)."""

    def __init__(self, d_model: int, config: OmniSIFTConfig, *, rngs: nnx.Rngs):
        d = config.selector_dim
        self.heads = config.selector_heads
        self.video_proj = nnx.Linear(d_model, d, rngs=rngs)
        self.video_norm = nnx.LayerNorm(d, rngs=rngs)
        self.audio_proj = nnx.Linear(d_model, d, rngs=rngs)
        self.audio_norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(self.heads, d, qkv_features=d, out_features=d, decode=False, rngs=rngs)
        self.out_norm = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_up = nnx.Linear(d, max(d // 2, 1), rngs=rngs)
        self.mlp_out = nnx.Linear(max(d // 2, 1), 1, rngs=rngs)

    def __call__(self, audio: jax.Array, video: jax.Array, video_mask: jax.Array) -> jax.Array:
        """``audio [B, A, D]``, ``video [B, V, D]`` with ``video_mask [B, V]`` -> scores ``[B, A]``."""
        a = self.audio_norm(self.audio_proj(audio.astype(jnp.float32)))
        v = self.video_norm(self.video_proj(video.astype(jnp.float32)))
        mask = video_mask[:, None, None, :]  # [B, 1, 1, V]: over heads and queries
        h = self.out_norm(a + self.attn(a, v, v, mask=mask))
        return jax.nn.sigmoid(self.mlp_out(jax.nn.silu(self.mlp_up(h)))[..., 0])


def straight_through(scores: jax.Array, keep: jax.Array) -> jax.Array:
    """The hard 0/1 mask forward (exactly: ``hard + (s - stop_gradient(s))``, the card's
    ``(hard - s).detach() + s`` without its rounding), the soft score's gradient."""
    hard = keep.astype(scores.dtype)
    return hard + (scores - jax.lax.stop_gradient(scores))


@struct.dataclass
class Compressed:
    """The kept tokens, in sequence order: ``index [B, T']`` into the input, ``embeds``,
    ``positions``, ``mask``, ``tokens``; ``audio_scores [B, C, A]`` (None for random)."""

    index: jax.Array
    embeds: jax.Array
    positions: jax.Array
    mask: jax.Array
    tokens: jax.Array
    audio_scores: jax.Array | None

    def inputs(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(tokens, positions, mask, embeds)`` for the language model."""
        return self.tokens, self.positions, self.mask, self.embeds


def _gather(keep: jax.Array, embeds, positions, mask, tokens, n_keep: int, scale=None) -> tuple:
    index = jnp.argsort(~keep, axis=1, stable=True)[:, :n_keep]  # kept indices, ascending
    x = embeds if scale is None else embeds * scale[..., None].astype(embeds.dtype)
    take = lambda a: jnp.take_along_axis(a, index.reshape(index.shape + (1,) * (a.ndim - 2)), axis=1)
    return index, take(x), take(positions), take(mask), take(tokens)


def compress(selector: AudioSelector, embeds: jax.Array, positions: jax.Array, mask: jax.Array, tokens: jax.Array,
             layout: ClipLayout, config: OmniSIFTConfig) -> Compressed:
    """OmniSIFT on a batch with one `ClipLayout`: ``embeds [B, T, D]`` (the spliced inputs),
    ``positions [B, T, 3]``, ``mask``/``tokens [B, T]`` -> the kept tokens."""
    B, T, _ = embeds.shape
    chex.assert_equal(T, layout.length)
    F, P = layout.frames.shape
    C, A = layout.audio.shape
    video = embeds[:, jnp.asarray(layout.frames)]  # [B, F, P, D]
    vkeep = video_keep(video, layout, config)
    audio = embeds[:, jnp.asarray(layout.audio)]  # [B, C, A, D]
    n_drop_a = math.floor(A * config.audio_ratio)
    scores, akeep = [], []
    for c in range(C):
        frames = np.flatnonzero(layout.chunk_of_frame == c)
        v = video[:, frames].reshape(B, len(frames) * P, -1)
        vm = vkeep[:, frames].reshape(B, len(frames) * P)
        s = selector(audio[:, c], v, vm)
        scores.append(s)
        akeep.append(drop_highest(-s, n_drop_a))  # keep the highest scores
    scores = jnp.stack(scores, 1)
    akeep = jnp.stack(akeep, 1)
    keep = jnp.ones((B, T), bool)
    keep = keep.at[:, jnp.asarray(layout.frames)].set(vkeep)
    keep = keep.at[:, jnp.asarray(layout.audio)].set(akeep)
    scale = jnp.ones((B, T), jnp.float32).at[:, jnp.asarray(layout.audio)].set(straight_through(scores, akeep))
    out = _gather(keep, embeds, positions, mask, tokens, layout.kept_length(config), scale)
    return Compressed(*out, scores)


def random_keep(rng: jax.Array, embeds, positions, mask, tokens, layout: ClipLayout, config: OmniSIFTConfig
                ) -> Compressed:
    """The baseline: the same numbers of patches per frame and audio tokens per chunk dropped
    uniformly at random."""
    B, T, _ = embeds.shape
    F, P = layout.frames.shape
    C, A = layout.audio.shape
    kv, ka = jax.random.split(rng)
    vkeep = drop_highest(jax.random.uniform(kv, (B, F, P)), math.floor(P * config.video_ratio))
    akeep = drop_highest(jax.random.uniform(ka, (B, C, A)), math.floor(A * config.audio_ratio))
    keep = jnp.ones((B, T), bool).at[:, jnp.asarray(layout.frames)].set(vkeep).at[:, jnp.asarray(layout.audio)].set(akeep)
    return Compressed(*_gather(keep, embeds, positions, mask, tokens, layout.kept_length(config)), None)
