"""An omni (video + audio + text) front end for the jaxlm transformer.

Media become embeddings spliced into the token sequence at placeholder tokens: each video
patch and each audio frame occupies one placeholder (``OmniConfig.video_token_id`` /
``audio_token_id``) whose embedding is replaced, in order, by its encoder output. Positions
are Qwen2.5-Omni-style three-axis (time, height, width) ids for ``rope="mrope"``
(`jaxlm.models.layers.rope.multimodal_rope`), built by `build_sequence`:

- text: ``s, s+1, ...`` on all three axes (the diagonal), so text alone is standard RoPE;
- a video frame ``f`` on a ``gh x gw`` patch grid: ``(s + f*frame_ticks, s + i, s + j)``;
- audio frame ``k``: ``s + k*audio_ticks`` on all three axes;
- after each media block, text resumes at (the largest id so far) + 1.

`AudioVisual` interleaves a clip's video and audio in time chunks of ``frames_per_chunk``
frames followed by the audio of the same span (Qwen2.5-Omni's "audio in video" layout, the
unit OmniSIFT compresses); frames and audio frames share one time axis (``frame_ticks`` per
video frame, ``audio_ticks`` per audio frame).

The language model is a plain `Transformer` taking ``embeds=``: its KV cache, sampler,
training step and checkpoint format are unchanged, and a sequence without media gives
bit-identical logits to the text model. `omni_generate` prefills media once and decodes text,
continuing the three-axis positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxlm.checkpoint import load_checkpoint, save_checkpoint
from jaxlm.fileio import atomic_directory, recover_directory
from jaxlm.models.config import ModelConfig
from jaxlm.models.transformer import ModelOutput, Transformer

TEXT, VIDEO, AUDIO = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class OmniConfig:
    """The language model and the media encoders. ``patch_dim``: values per video patch;
    ``audio_dim``: values per audio frame; ``encoder_hidden``: the encoders' MLP width."""

    lm: ModelConfig
    patch_dim: int
    audio_dim: int
    video_token_id: int
    audio_token_id: int
    encoder_hidden: int = 128

    def __post_init__(self):
        for name in ("patch_dim", "audio_dim", "encoder_hidden"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"OmniConfig.{name}={v!r} must be an int > 0")
        for name in ("video_token_id", "audio_token_id"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):  # True read as id 1
                raise ValueError(f"OmniConfig.{name}={v!r} must be an int token id")
            if not 0 <= v < self.lm.vocab_size:
                raise ValueError(f"OmniConfig.{name}={v!r} must be a token id in [0, {self.lm.vocab_size})")
            object.__setattr__(self, name, int(v))  # numpy ints stored as Python ints (JSON metadata)
        if self.video_token_id == self.audio_token_id:
            raise ValueError("OmniConfig.video_token_id and audio_token_id must differ")


class MediaEncoder(nnx.Module):
    """``[..., in_dim] -> [..., d_model]``: LayerNorm, Linear, GELU, Linear (a patch / frame
    embedding; the front end's modality encoder)."""

    def __init__(self, in_dim: int, hidden: int, d_model: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(in_dim, rngs=rngs)
        self.up = nnx.Linear(in_dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(self.norm(x))))


def splice(x: jax.Array, tokens: jax.Array, placeholder: int, media: jax.Array) -> jax.Array:
    """Replace the embedding of the k-th ``placeholder`` token of each row by ``media[b, k]``.
    ``x [B, T, D]``, ``tokens [B, T]``, ``media [B, M, D]``; placeholders past M keep ``x``
    (checked eagerly by `check_media`)."""
    chex.assert_rank(media, 3)
    is_ph = tokens == placeholder
    index = jnp.cumsum(is_ph, axis=1) - 1
    M = media.shape[1]
    if M == 0:
        return x
    gathered = jnp.take_along_axis(media, jnp.clip(index, 0, M - 1)[..., None], axis=1)
    return jnp.where((is_ph & (index < M))[..., None], gathered.astype(x.dtype), x)


def check_media(tokens, video, audio, config: OmniConfig) -> None:
    """Clear errors for media of the wrong shape or count (host arrays / concrete values)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    for name, arr, dim, ph in (("video", video, config.patch_dim, config.video_token_id),
                               ("audio", audio, config.audio_dim, config.audio_token_id)):
        need = int((tokens == ph).sum(1).max(initial=0))
        if arr is None:
            if need:
                raise ValueError(f"the tokens hold {need} {name} placeholders but no {name} was given")
            continue
        shape = tuple(np.shape(arr))
        if len(shape) != 3 or shape[0] != tokens.shape[0] or shape[2] != dim:
            raise ValueError(f"{name} must be [B={tokens.shape[0]}, N, {dim}], got shape {shape}")
        if shape[1] < need:
            raise ValueError(f"{name} has {shape[1]} entries per row but a row holds {need} {name} placeholders")


class OmniModel(nnx.Module):
    """A `Transformer` with video and audio encoders (see the module docstring)."""

    def __init__(self, config: OmniConfig, *, rngs: nnx.Rngs, tokenizer=None):
        self.config = config
        self.lm = Transformer(config.lm, rngs=rngs, tokenizer=tokenizer)
        d = config.lm.d_model
        self.video_encoder = MediaEncoder(config.patch_dim, config.encoder_hidden, d, rngs=rngs)
        self.audio_encoder = MediaEncoder(config.audio_dim, config.encoder_hidden, d, rngs=rngs)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def encode_media(self, video: jax.Array | None, audio: jax.Array | None):
        dt = self.config.lm.compute_dtype
        v = None if video is None else self.video_encoder(jnp.asarray(video, jnp.float32)).astype(dt)
        a = None if audio is None else self.audio_encoder(jnp.asarray(audio, jnp.float32)).astype(dt)
        return v, a

    def embed(self, tokens: jax.Array, video_embeds: jax.Array | None, audio_embeds: jax.Array | None) -> jax.Array:
        """Token embeddings with the encoded media spliced in at their placeholders."""
        c = self.config
        x = jnp.take(self.lm.embed[...], tokens, axis=0).astype(c.lm.compute_dtype)
        if video_embeds is not None:
            x = splice(x, tokens, c.video_token_id, video_embeds)
        if audio_embeds is not None:
            x = splice(x, tokens, c.audio_token_id, audio_embeds)
        return x

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *, video: jax.Array | None = None,
                 audio: jax.Array | None = None, mask: jax.Array | None = None, cache=None) -> ModelOutput:
        """Logits of ``tokens [B, T]`` with ``video [B, Nv, patch_dim]`` and ``audio
        [B, Na, audio_dim]`` at their placeholders, at ``positions [B, T, 3]`` (or [B, T])."""
        if not isinstance(tokens, jax.core.Tracer):
            check_media(tokens, video, audio, self.config)
        v, a = self.encode_media(video, audio)
        return self.lm(tokens, positions, cache=cache, mask=mask, embeds=self.embed(tokens, v, a))


def build_omni(config: OmniConfig, *, seed: int = 0, tokenizer=None) -> OmniModel:
    return OmniModel(config, rngs=nnx.Rngs(params=seed), tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------
# Sequences and three-axis positions


@dataclasses.dataclass(frozen=True)
class Video:
    """``frames [F, gh, gw, patch_dim]``: one patch vector per grid cell per frame."""

    frames: np.ndarray
    frame_ticks: int = 1

    def __post_init__(self):
        _check_ticks("Video", "frame_ticks", self.frame_ticks)


@dataclasses.dataclass(frozen=True)
class Audio:
    """``frames [Na, audio_dim]``."""

    frames: np.ndarray
    audio_ticks: int = 1

    def __post_init__(self):
        _check_ticks("Audio", "audio_ticks", self.audio_ticks)


def _check_ticks(owner: str, name: str, v) -> None:
    """Ticks per frame on the time axis: an int >= 1 (fewer would move positions backwards)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{owner}.{name}={v!r} is invalid: must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class AudioVisual:
    """A clip: video frames and audio frames on one time axis (``frame_ticks`` per video
    frame, ``audio_ticks`` per audio frame), interleaved in chunks of ``frames_per_chunk``
    frames, each followed by the audio frames whose time falls in its span."""

    video: np.ndarray
    audio: np.ndarray
    frames_per_chunk: int = 2
    frame_ticks: int = 2
    audio_ticks: int = 1

    def __post_init__(self):
        for name in ("frames_per_chunk", "frame_ticks", "audio_ticks"):
            _check_ticks("AudioVisual", name, getattr(self, name))
        if not len(self.video):  # the audio is placed inside the video's chunks: there would be none
            raise ValueError("AudioVisual.video has no frames, so its audio would have no chunk to go in; "
                             "give audio alone as Audio(frames)")


@dataclasses.dataclass(frozen=True)
class OmniSequence:
    """One row: ``tokens [T]``, ``positions [T, 3]``, the media in placeholder order
    (``video [Nv, patch_dim]``, ``audio [Na, audio_dim]``), and per token its ``kind`` (0 text,
    1 video, 2 audio), ``frame`` (video frame or the audio frame's chunk, -1 for text),
    ``cell`` (the patch's grid index, -1 otherwise) and ``chunk`` (-1 for text)."""

    tokens: np.ndarray
    positions: np.ndarray
    video: np.ndarray
    audio: np.ndarray
    kind: np.ndarray
    frame: np.ndarray
    cell: np.ndarray
    chunk: np.ndarray


def build_sequence(pieces: Sequence[str | list[int] | Video | Audio | AudioVisual], tokenizer, config: OmniConfig
                   ) -> OmniSequence:
    """Tokens, three-axis positions and media of ``pieces`` in order (text is encoded without
    BOS; pass a ``[bos]`` id list first if the model wants one)."""
    toks, pos, kind, frame, cell, chunk = [], [], [], [], [], []
    video_rows, audio_rows = [], []
    s = 0  # the next free position id

    def push(t, p, k, f=-1, c=-1, ch=-1):
        toks.append(t)
        pos.append(p)
        kind.append(k)
        frame.append(f)
        cell.append(c)
        chunk.append(ch)

    def frames_block(frames, start, t0, ticks, ch, f0):
        F, gh, gw, dim = frames.shape
        if dim != config.patch_dim:
            raise ValueError(f"video patches have {dim} values, OmniConfig.patch_dim={config.patch_dim}")
        top = start
        for f in range(F):
            t = start + t0 + f * ticks
            for i in range(gh):
                for j in range(gw):
                    push(config.video_token_id, (t, start + i, start + j), VIDEO, f0 + f, i * gw + j, ch)
                    video_rows.append(frames[f, i, j])
                    top = max(top, t, start + i, start + j)
        return top

    for piece in pieces:
        if isinstance(piece, (str, list)):
            ids = tokenizer.encode(piece) if isinstance(piece, str) else [int(t) for t in piece]
            for k, t in enumerate(ids):
                push(t, (s + k,) * 3, TEXT)
            s += len(ids)
        elif isinstance(piece, Video):
            frames = np.asarray(piece.frames, np.float32)
            if frames.ndim != 4:
                raise ValueError(f"Video.frames must be [F, gh, gw, patch_dim], got shape {frames.shape}")
            s = frames_block(frames, s, 0, piece.frame_ticks, -1, 0) + 1
        elif isinstance(piece, Audio):
            frames = np.asarray(piece.frames, np.float32)
            if frames.ndim != 2 or frames.shape[1] != config.audio_dim:
                raise ValueError(f"Audio.frames must be [Na, audio_dim={config.audio_dim}], got shape {frames.shape}")
            for k in range(len(frames)):
                push(config.audio_token_id, (s + k * piece.audio_ticks,) * 3, AUDIO)
                audio_rows.append(frames[k])
            s += (len(frames) - 1) * piece.audio_ticks + 1 if len(frames) else 0
        elif isinstance(piece, AudioVisual):
            video = np.asarray(piece.video, np.float32)
            audio = np.asarray(piece.audio, np.float32)
            if video.ndim != 4 or audio.ndim != 2 or audio.shape[1] != config.audio_dim:
                raise ValueError(f"AudioVisual needs video [F, gh, gw, {config.patch_dim}] and audio "
                                 f"[Na, {config.audio_dim}], got {video.shape} and {audio.shape}")
            start, top = s, s
            F, fpc = len(video), piece.frames_per_chunk
            span = fpc * piece.frame_ticks
            a_time = np.arange(len(audio)) * piece.audio_ticks
            for ch, f0 in enumerate(range(0, F, fpc)):
                top = max(top, frames_block(video[f0:f0 + fpc], start, f0 * piece.frame_ticks, piece.frame_ticks,
                                            ch, f0))
                last = ch == (F - 1) // fpc
                sel = np.flatnonzero((a_time >= ch * span) & ((a_time < (ch + 1) * span) | last))
                for k in sel:
                    t = start + int(a_time[k])
                    push(config.audio_token_id, (t,) * 3, AUDIO, ch, -1, ch)
                    audio_rows.append(audio[k])
                    top = max(top, t)
            s = top + 1
        else:
            raise TypeError(f"a piece must be text, token ids, Video, Audio or AudioVisual, got {type(piece).__name__}")
    as_media = lambda rows, dim: np.asarray(rows, np.float32).reshape(len(rows), dim)
    return OmniSequence(np.asarray(toks, np.int32), np.asarray(pos, np.int32).reshape(-1, 3),
                        as_media(video_rows, config.patch_dim), as_media(audio_rows, config.audio_dim),
                        np.asarray(kind, np.int8), np.asarray(frame, np.int32), np.asarray(cell, np.int32),
                        np.asarray(chunk, np.int32))


def batch_sequences(seqs: Sequence[OmniSequence], pad_id: int) -> dict[str, np.ndarray]:
    """Left-padded ``tokens``, ``positions``, ``mask`` and media of equal-layout or ragged rows
    (media padded with zeros at the end; the placeholders decide which are used)."""
    B = len(seqs)
    T = max(len(s.tokens) for s in seqs)
    nv = max(len(s.video) for s in seqs)
    na = max(len(s.audio) for s in seqs)
    pv, pa = seqs[0].video.shape[1], seqs[0].audio.shape[1]
    out = {"tokens": np.full((B, T), pad_id, np.int32), "positions": np.zeros((B, T, 3), np.int32),
           "mask": np.zeros((B, T), bool), "video": np.zeros((B, nv, pv), np.float32),
           "audio": np.zeros((B, na, pa), np.float32)}
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        out["tokens"][b, T - n:] = s.tokens
        out["positions"][b, T - n:] = s.positions
        out["mask"][b, T - n:] = True
        out["video"][b, : len(s.video)] = s.video
        out["audio"][b, : len(s.audio)] = s.audio
    return out


# ----------------------------------------------------------------------------------------
# Checkpoints: the language model in the jaxlm format, the encoders beside it

ENCODERS_FILE, OMNI_FILE = "encoders.safetensors", "omni.json"


def save_omni(model: OmniModel, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """``path/lm`` (a jaxlm checkpoint of the language model, loadable on its own with
    `jaxlm.load_checkpoint`), ``path/encoders.safetensors`` and ``path/omni.json``, written
    beside ``path`` and swapped in whole (`jaxlm.fileio.atomic_directory`): a kill leaves the
    complete old or the complete new checkpoint."""
    path = Path(path).absolute()
    flat = {}
    for name in ("video_encoder", "audio_encoder"):
        leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(getattr(model, name), nnx.Param)))[0]
        for key, value in leaves:
            flat[name + "." + ".".join(str(getattr(k, "key", k)) for k in key)] = np.asarray(jax.device_get(value))
    meta = {k: getattr(model.config, k) for k in ("patch_dim", "audio_dim", "video_token_id", "audio_token_id",
                                                   "encoder_hidden")}
    with atomic_directory(path, overwrite=overwrite) as staging:
        save_checkpoint(model.lm, staging / "lm")
        save_file(flat, str(staging / ENCODERS_FILE))
        (staging / OMNI_FILE).write_text(json.dumps(meta, indent=1))
    return path


def is_omni_checkpoint(path: str | os.PathLike) -> bool:
    """``path`` holds what `save_omni` writes."""
    path = Path(path)
    recover_directory(path)
    return all((path / need).exists() for need in ("lm", ENCODERS_FILE, OMNI_FILE))


def load_omni(path: str | os.PathLike) -> OmniModel:
    """The `OmniModel` `save_omni` wrote (its tokenizer from ``path/lm``)."""
    path = Path(path)
    recover_directory(path)
    for need in ("lm", ENCODERS_FILE, OMNI_FILE):
        if not (path / need).exists():
            raise FileNotFoundError(f"{path} is not an omni checkpoint: {need} is missing")
    lm = load_checkpoint(path / "lm")
    config = OmniConfig(lm=lm.config, **json.loads((path / OMNI_FILE).read_text()))
    model = OmniModel(config, rngs=nnx.Rngs(params=0), tokenizer=lm.tokenizer)
    model.lm = lm
    stored = load_file(str(path / ENCODERS_FILE))
    for name in ("video_encoder", "audio_encoder"):
        module = getattr(model, name)
        state = nnx.to_pure_dict(nnx.state(module, nnx.Param))
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        values = []
        for key, value in leaves:
            k = name + "." + ".".join(str(getattr(p, "key", p)) for p in key)
            if k not in stored or stored[k].shape != np.shape(value):
                raise ValueError(f"{path / ENCODERS_FILE}: {k} is missing or has the wrong shape")
            values.append(jnp.asarray(stored[k]))
        nnx.update(module, jax.tree_util.tree_unflatten(treedef, values))
    return model
