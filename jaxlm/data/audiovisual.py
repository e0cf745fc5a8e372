"""A synthetic audio-visual task: a moving textured square and a tone whose pitch encodes a
label.

Each clip has ``frames`` video frames on a ``grid x grid`` patch grid (each patch ``patch x
patch`` pixels, flattened: ``patch_dim = patch**2``) and ``audio_frames`` audio frames of
``window`` samples (``audio_dim = window``):

- video: a flat background of a per-clip grey level with pixel noise, and one bright square
  filling one cell, moving one cell per frame left, right, up or down; its pixels carry one
  of ``n_shapes`` textures (fixed patterns);
- audio: low noise, and a tone in ``tone_frames`` consecutive audio frames (placed at random)
  whose frequency is one of ``n_labels`` pitches.

Questions (the same number of tokens, so a batch shares one layout): ``move:`` asks the
direction (answer L, R, U or D), ``look:`` the square's texture (answer W, X, Y, Z, ...),
``tone:`` the pitch label (A, B, C, ...). ``questions`` picks which are asked. The answer
needs the moving square's patches or the tone's audio frames: the redundant background
patches and silent audio frames carry nothing, which is what token compression should drop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

DIRECTIONS = {"L": (0, -1), "R": (0, 1), "U": (-1, 0), "D": (1, 0)}
QUESTIONS = ("move:", "look:", "tone:")


@dataclasses.dataclass(frozen=True)
class AVTaskConfig:
    frames: int = 4
    grid: int = 4
    patch: int = 3
    audio_frames: int = 8
    window: int = 16
    tone_frames: int = 2
    n_labels: int = 4
    n_shapes: int = 4
    noise: float = 0.05
    questions: tuple[str, ...] = ("look:", "tone:")

    def __post_init__(self):
        for name in ("frames", "grid", "patch", "audio_frames", "tone_frames", "n_labels", "n_shapes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AVTaskConfig.{name}={v!r} must be an int >= 1")
        if isinstance(self.noise, bool) or not isinstance(self.noise, (int, float)) or not 0 <= self.noise < math.inf:
            raise ValueError(f"AVTaskConfig.noise={self.noise!r} must be a finite number >= 0 (NaN made every clip NaN)")
        if self.grid < self.frames:
            raise ValueError(f"AVTaskConfig.grid={self.grid} must be >= frames={self.frames} (the square moves one "
                             "cell per frame and stays on the grid)")
        if not 1 <= self.tone_frames <= self.audio_frames:
            raise ValueError(f"AVTaskConfig.tone_frames={self.tone_frames} must be in [1, audio_frames]")
        if not 2 <= self.n_labels <= 26 or not 2 <= self.n_shapes <= 4:
            raise ValueError(f"AVTaskConfig.n_labels={self.n_labels} must be in [2, 26] and n_shapes="
                             f"{self.n_shapes} in [2, 4]")
        bad = [q for q in self.questions if q not in QUESTIONS]
        if not self.questions or bad:
            raise ValueError(f"AVTaskConfig.questions={self.questions!r}: each must be one of {QUESTIONS}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 5:
            # pitches run from 1 to window/2 - 1 cycles per frame: at window <= 4 every label has pitch 1
            raise ValueError(f"AVTaskConfig.window={self.window!r} must be an int >= 5 (the 'tone:' labels' "
                             "pitches must differ and stay below Nyquist)")
        if self.patch < 2:  # a 1-pixel patch has one value: the shapes' textures are indistinguishable
            raise ValueError(f"AVTaskConfig.patch={self.patch} must be >= 2 (the 'look:' shapes differ in texture)")
        if "move:" in self.questions and self.frames < 2:
            raise ValueError(f"AVTaskConfig.frames={self.frames} must be >= 2 to ask 'move:' (one frame shows no motion)")

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch

    @property
    def audio_dim(self) -> int:
        return self.window

    def pitch(self, label: int) -> float:
        """Cycles per audio frame of label ``label`` (distinct, below Nyquist)."""
        return 1.0 + label * (self.window / 2 - 2) / max(self.n_labels - 1, 1)


def av_example(cfg: AVTaskConfig, index: int, seed: int = 0) -> dict[str, Any]:
    """Clip ``index``: ``video [F, grid, grid, patch_dim]``, ``audio [Na, window]``, the
    ``question``, the one-character ``answer``, and the ground truth (``direction``, ``label``,
    ``shape``, ``cells`` [(row, col)] per frame, ``tone_at`` the first tone frame)."""
    rng = np.random.default_rng([seed, index, 17])
    g, F = cfg.grid, cfg.frames
    direction = "LRUD"[int(rng.integers(4))]
    dr, dc = DIRECTIONS[direction]
    span = F - 1
    r0 = int(rng.integers(max(0, -dr * span), g - max(0, dr * span)))
    c0 = int(rng.integers(max(0, -dc * span), g - max(0, dc * span)))
    cells = [(r0 + f * dr, c0 + f * dc) for f in range(F)]
    grey = float(rng.uniform(0.1, 0.4))
    video = grey + cfg.noise * rng.normal(size=(F, g, g, cfg.patch_dim))
    shape = int(rng.integers(cfg.n_shapes))
    texture = shape_texture(cfg, shape)
    for f, (r, c) in enumerate(cells):
        video[f, r, c] = texture + cfg.noise * rng.normal(size=cfg.patch_dim)
    label = int(rng.integers(cfg.n_labels))
    tone_at = int(rng.integers(cfg.audio_frames - cfg.tone_frames + 1))
    audio = cfg.noise * rng.normal(size=(cfg.audio_frames, cfg.window))
    t = np.arange(cfg.window) / cfg.window
    phase = float(rng.uniform(0, 2 * np.pi))
    for k in range(tone_at, tone_at + cfg.tone_frames):
        audio[k] += np.sin(2 * np.pi * cfg.pitch(label) * (t + k) + phase)
    question = cfg.questions[int(rng.integers(len(cfg.questions)))]
    answer = {"move:": direction, "look:": "WXYZ"[shape], "tone:": chr(65 + label)}[question]
    return {"video": video.astype(np.float32), "audio": audio.astype(np.float32), "question": question,
            "answer": answer, "direction": direction, "shape": shape, "label": label, "cells": cells,
            "tone_at": tone_at}


def shape_texture(cfg: AVTaskConfig, shape: int) -> np.ndarray:
    """The square's pixels for texture ``shape``: bright (1.0) with stripes, checks or a
    border at 0.6, flattened to ``patch_dim``."""
    i, j = np.meshgrid(np.arange(cfg.patch), np.arange(cfg.patch), indexing="ij")
    dark = [i % 2 == 0, j % 2 == 0, (i + j) % 2 == 0, (i == 0) | (j == 0)][shape]
    return np.where(dark, 0.6, 1.0).reshape(-1)
