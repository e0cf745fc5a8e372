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

Only the selector has parameters (the language model stays frozen). `selector_loss` trains it
with one of two gradient estimators (``OmniSIFTConfig.estimator``):

- ``"ste"``, the paper's: the loss of the compressed forward, differentiated through the
  straight-through mask. Only kept tokens get a gradient, and in a pre-norm transformer
  rescaling a kept input embedding changes little (the first norm removes the scale), so the
  signal can be weak.
- ``"score_function"``: the selector's logits define a Plackett-Luce distribution over which
  audio tokens a chunk keeps; ``samples`` keep sets per clip are drawn by Gumbel top-k, each
  scored by the frozen model's loss, and the selector follows REINFORCE with a leave-one-out
  baseline (Williams 1992; Kool et al. 2019). Unbiased for the gradient of the expected loss
  of the hard selection. At inference both keep the top scores.

Removed tokens leave the
sequence with their three-axis positions, so the kept ones keep theirs. ``retention(rho)``
keeps a share ``rho`` of the media tokens; ``retention(1.0)`` drops nothing and is the
uncompressed model exactly. `random_keep` is the baseline that drops the same numbers of
tokens uniformly at random.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlm.models.omni import AUDIO, TEXT, VIDEO, OmniSequence


ESTIMATORS = ("ste", "score_function")


def dropped(n: int, ratio: float) -> int:
    """``floor(n * ratio)`` tokens dropped of ``n``, robust to the ratio's binary rounding
    (``1 - 0.9`` is 0.0999...98: 10 tokens at retention 0.9 must drop 1, not 0)."""
    return math.floor(n * ratio + 1e-9)


@dataclasses.dataclass(frozen=True)
class OmniSIFTConfig:
    """``video_ratio`` (r_v) of each frame's patches and ``audio_ratio`` (r_a) of each chunk's
    audio tokens are dropped (card defaults 0.5 and 0.3)."""

    video_ratio: float = 0.5
    audio_ratio: float = 0.3
    selector_dim: int = 64
    selector_heads: int = 4
    estimator: str = "ste"  # selector training: "ste" (the paper) or "score_function"
    samples: int = 4  # keep sets drawn per clip by the score-function estimator

    def __post_init__(self):
        for name in ("video_ratio", "audio_ratio"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"OmniSIFTConfig.{name}={v!r} must be in [0, 1)")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"OmniSIFTConfig.estimator={self.estimator!r} must be one of {ESTIMATORS}")
        for name in ("selector_dim", "selector_heads", "samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OmniSIFTConfig.{name}={v!r} must be an int >= 1")
        if self.estimator == "score_function" and self.samples < 2:
            raise ValueError(f"OmniSIFTConfig.samples={self.samples} must be >= 2 (the leave-one-out baseline "
                             "needs another sample)")
        if self.selector_dim <= 0 or self.selector_dim % self.selector_heads:
            raise ValueError(f"OmniSIFTConfig.selector_dim={self.selector_dim} must be > 0 and divisible by "
                             f"selector_heads={self.selector_heads}")

    @classmethod
    def retention(cls, rho: float, **kw) -> "OmniSIFTConfig":
        """Keep a share ``rho`` in (0, 1] of the video and of the audio tokens."""
        if not 0 < rho <= 1:
            raise ValueError(f"retention rho={rho!r} must be in (0, 1]")
        return cls(video_ratio=round(1 - rho, 12), audio_ratio=round(1 - rho, 12), **kw)


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
    video_id: int | None = None  # the placeholder ids at the media positions (`check`)
    audio_id: int | None = None

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
        pairs = frame[vid].astype(np.int64) * P + cell[vid]
        if len(np.unique(pairs)) != len(vid):  # a second clip reuses the first's frame ids: it overwrote them
            raise ValueError("OmniSIFT's layout takes one AudioVisual clip per sequence; this one has video tokens "
                             "that share a (frame, cell) position (several clips)")
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
                   len(kind) + pad, int(seq.tokens[vid[0]]), int(seq.tokens[aud[0]]) if len(aud) else None)

    def check(self, tokens, mask) -> None:
        """That every row of a batch (``tokens``, ``mask [B, T]``, host arrays) has its media
        where this layout says: rows left-padded to one width whose text differs after the clip
        put them elsewhere, and one layout would prune their text."""
        tokens, mask = np.asarray(tokens), np.asarray(mask, bool)
        if tokens.shape[1] != self.length:
            raise ValueError(f"the batch's rows have {tokens.shape[1]} tokens, the layout {self.length}")
        for name, idx, want in (("video", self.frames, self.video_id), ("audio", self.audio, self.audio_id)):
            if want is None or not idx.size:
                continue
            bad = np.flatnonzero(~((tokens[:, idx.ravel()] == want) & mask[:, idx.ravel()]).all(axis=1))
            if bad.size:
                raise ValueError(f"row {int(bad[0])} has no {name} placeholder at the layout's {name} positions: "
                                 "OmniSIFT's one ClipLayout needs every row's media at the same indices (build "
                                 "batches of rows with the same text around the clip, or one layout per row)")

    def kept_length(self, config: OmniSIFTConfig) -> int:
        F, P = self.frames.shape
        C, A = self.audio.shape
        return (self.length - F * P - C * A + F * (P - dropped(P, config.video_ratio))
                + C * (A - dropped(A, config.audio_ratio)))


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
    k = dropped(P, config.video_ratio)
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

    def logits(self, audio: jax.Array, video: jax.Array, video_mask: jax.Array) -> jax.Array:
        """``audio [B, A, D]``, ``video [B, V, D]`` with ``video_mask [B, V]`` -> the scores'
        logits ``[B, A]``."""
        a = self.audio_norm(self.audio_proj(audio.astype(jnp.float32)))
        v = self.video_norm(self.video_proj(video.astype(jnp.float32)))
        mask = video_mask[:, None, None, :]  # [B, 1, 1, V]: over heads and queries
        h = self.out_norm(a + self.attn(a, v, v, mask=mask))
        return self.mlp_out(jax.nn.silu(self.mlp_up(h)))[..., 0]

    def __call__(self, audio: jax.Array, video: jax.Array, video_mask: jax.Array) -> jax.Array:
        """Scores ``[B, A]`` in (0, 1): the sigmoid of `logits`."""
        return jax.nn.sigmoid(self.logits(audio, video, video_mask))


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


def audio_logits(selector: AudioSelector, embeds: jax.Array, layout: ClipLayout, config: OmniSIFTConfig
                 ) -> tuple[jax.Array, jax.Array]:
    """The video keep mask ``[B, F, P]`` (spatial + temporal pruning) and the selector's logits
    ``[B, C, A]`` for each chunk's audio tokens, attending to the chunk's kept video."""
    B, T, _ = embeds.shape
    chex.assert_equal(T, layout.length)
    F, P = layout.frames.shape
    video = embeds[:, jnp.asarray(layout.frames)]  # [B, F, P, D]
    vkeep = video_keep(video, layout, config)
    audio = embeds[:, jnp.asarray(layout.audio)]  # [B, C, A, D]
    logits = []
    for c in range(layout.audio.shape[0]):
        frames = np.flatnonzero(layout.chunk_of_frame == c)
        v = video[:, frames].reshape(B, len(frames) * P, -1)
        vm = vkeep[:, frames].reshape(B, len(frames) * P)
        logits.append(selector.logits(audio[:, c], v, vm))
    return vkeep, jnp.stack(logits, 1)


def _keep_mask(B: int, layout: ClipLayout, vkeep: jax.Array, akeep: jax.Array) -> jax.Array:
    keep = jnp.ones((B, layout.length), bool)
    return keep.at[:, jnp.asarray(layout.frames)].set(vkeep).at[:, jnp.asarray(layout.audio)].set(akeep)


def _check_concrete(layout: ClipLayout, tokens, mask) -> None:
    """`ClipLayout.check` when the batch is known (not traced: under jit, call it on the host)."""
    if not isinstance(tokens, jax.core.Tracer) and not isinstance(mask, jax.core.Tracer):
        layout.check(tokens, mask)


def compress(selector: AudioSelector, embeds: jax.Array, positions: jax.Array, mask: jax.Array, tokens: jax.Array,
             layout: ClipLayout, config: OmniSIFTConfig) -> Compressed:
    """OmniSIFT on a batch with one `ClipLayout`: ``embeds [B, T, D]`` (the spliced inputs),
    ``positions [B, T, 3]``, ``mask``/``tokens [B, T]`` -> the kept tokens."""
    _check_concrete(layout, tokens, mask)
    B = embeds.shape[0]
    A = layout.audio.shape[1]
    vkeep, logits = audio_logits(selector, embeds, layout, config)
    scores = jax.nn.sigmoid(logits)
    # keep the highest scores, ranked by their logits (a saturated sigmoid would tie them)
    akeep = drop_highest(-logits, dropped(A, config.audio_ratio))
    keep = _keep_mask(B, layout, vkeep, akeep)
    scale = jnp.ones(keep.shape, jnp.float32).at[:, jnp.asarray(layout.audio)].set(straight_through(scores, akeep))
    out = _gather(keep, embeds, positions, mask, tokens, layout.kept_length(config), scale)
    return Compressed(*out, scores)


def plackett_luce_logprob(logits: jax.Array, order: jax.Array) -> jax.Array:
    """``log P(order)`` of drawing the indices ``order [..., k]`` in that order, without
    replacement, with probabilities proportional to ``exp(logits [..., N])`` (Plackett-Luce):
    ``sum_j logits[o_j] - logsumexp(logits over the indices not yet drawn)``."""
    N = logits.shape[-1]
    drawn = jnp.zeros(logits.shape, bool)
    total = jnp.zeros(logits.shape[:-1], jnp.float32)
    for j in range(order.shape[-1]):
        o = order[..., j]
        total = total + jnp.take_along_axis(logits, o[..., None], -1)[..., 0] \
            - jax.nn.logsumexp(jnp.where(drawn, -jnp.inf, logits), axis=-1)
        drawn = drawn | (jnp.arange(N) == o[..., None])
    return total


def gumbel_top_k(rng: jax.Array, logits: jax.Array, k: int, samples: int) -> jax.Array:
    """``samples`` draws of ``k`` indices without replacement from the Plackett-Luce
    distribution of ``logits [..., N]`` (the top k of logits + Gumbel noise, in the order
    drawn; Kool et al. 2019): ``[samples, ..., k]``."""
    noise = jax.random.gumbel(rng, (samples,) + logits.shape)
    return jnp.argsort(-(logits[None] + noise), axis=-1, stable=True)[..., :k]


def selector_loss(selector: AudioSelector, row_loss: Callable[[Compressed], jax.Array], embeds: jax.Array,
                  positions: jax.Array, mask: jax.Array, tokens: jax.Array, layout: ClipLayout,
                  config: OmniSIFTConfig, rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(objective, mean loss)`` to train the selector with ``config.estimator``; the gradient
    of ``objective`` with respect to the selector is the estimator's. ``row_loss`` maps the
    compressed inputs to the frozen model's loss per row ``[B]``.

    ``"ste"``: the objective is the mean loss of `compress`. ``"score_function"``: per chunk,
    ``config.samples`` keep sets are drawn (`gumbel_top_k`, needs ``rng``) and scored; the
    objective is ``mean_s (L_s - mean_{s' != s} L_s') * log P(set_s)`` with the advantage held
    constant, whose expected gradient is that of the expected loss. The model's loss gets no
    gradient there (only the log-probabilities do)."""
    if config.estimator == "ste":
        loss = jnp.mean(row_loss(compress(selector, embeds, positions, mask, tokens, layout, config)))
        return loss, loss
    if rng is None:
        raise ValueError('selector_loss with estimator="score_function" needs rng')
    B = embeds.shape[0]
    A = layout.audio.shape[1]
    K = config.samples
    n_keep = A - dropped(A, config.audio_ratio)
    vkeep, logits = audio_logits(selector, embeds, layout, config)
    order = gumbel_top_k(rng, jax.lax.stop_gradient(logits), n_keep, K)  # [K, B, C, n_keep]
    akeep = (order[..., None] == jnp.arange(A)).any(-2)  # [K, B, C, A]
    frozen = jax.lax.stop_gradient(embeds)

    def sample_loss(ak):
        keep = _keep_mask(B, layout, vkeep, ak)
        return row_loss(Compressed(*_gather(keep, frozen, positions, mask, tokens, layout.kept_length(config)), None))

    losses = jax.lax.stop_gradient(jax.lax.map(sample_loss, akeep))  # [K, B]
    chex.assert_shape(losses, (K, B))
    advantage = losses - (losses.sum(0, keepdims=True) - losses) / (K - 1)
    logp = plackett_luce_logprob(logits[None], order).sum(-1)  # [K, B]: the chunks are independent
    return jnp.mean(advantage * logp), jnp.mean(losses)


def random_keep(rng: jax.Array, embeds, positions, mask, tokens, layout: ClipLayout, config: OmniSIFTConfig
                ) -> Compressed:
    """The baseline: the same numbers of patches per frame and audio tokens per chunk dropped
    uniformly at random."""
    _check_concrete(layout, tokens, mask)
    B = embeds.shape[0]
    F, P = layout.frames.shape
    C, A = layout.audio.shape
    kv, ka = jax.random.split(rng)
    vkeep = drop_highest(jax.random.uniform(kv, (B, F, P)), dropped(P, config.video_ratio))
    akeep = drop_highest(jax.random.uniform(ka, (B, C, A)), dropped(A, config.audio_ratio))
    keep = _keep_mask(B, layout, vkeep, akeep)
    return Compressed(*_gather(keep, embeds, positions, mask, tokens, layout.kept_length(config)), None)
