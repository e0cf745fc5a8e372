"""Scalar reward models on a jaxlm backbone, and CSRM's joint objective ("Configurable Reward
Model for Balanced Safety Alignment", Jiang et al. 2026, arXiv 2605.30487; method card B.7,
whose loss is [INFERRED]).

`RewardModel`: the backbone's final hidden state at the last real token through a linear
head gives the score ``s``; a learnt offset ``b`` makes ``sigmoid(s - b)`` the calibrated
P(compliant). Losses (`csrm_loss`):

    L = L_BT + lambda L_cal,   L_BT = -log sigmoid(s(c, x, y+) - s(c, x, y-)),
    L_cal = BCE(sigmoid(s(c, x, y) - b), compliant(c, x, y)).

``lambda = 0`` is the plain Bradley-Terry reward model (the uncalibrated baseline). The step
is a pure ``(state, batch) -> (state, metrics)``; `train_reward_model` runs it over
(points, pairs) batches drawn from `jaxlm.data.safety.augment` or any such lists.

`save_reward_model` / `load_reward_model` write and read a reward model directory (the
backbone as a jaxlm checkpoint, the head and offset as safetensors). A saved reward model is a
GRPO reward: ``rewards=("reward_model",)`` with ``GRPOConfig.reward_model=<dir>`` scores each
``prompt + completion`` (``reward_model_output``: the raw score or ``sigmoid(s - b)``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from jaxlm.eval.scoring import encode_prompts
from jaxlm.fileio import atomic_directory, read_json
from trainers.rl.rewards import REWARDS, question_and_answer

HEAD_FILE = "head.safetensors"
META_FILE = "reward_model.json"


class RewardModel(nnx.Module):
    """``score(tokens, mask) -> [B]``: a linear head on the backbone's last real position."""

    def __init__(self, backbone, *, rngs: nnx.Rngs):
        self.lm = backbone
        d = backbone.config.d_model
        self.head = nnx.Linear(d, 1, rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        self.offset = nnx.Param(jnp.zeros((), jnp.float32))

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        hidden = self.lm.backbone(tokens, positions, mask=mask).hidden
        # the last real position of each row, left- or right-padded (the last column of a
        # right-padded row is padding)
        last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)
        h = hidden[jnp.arange(hidden.shape[0]), last].astype(jnp.float32)
        return self.head(h)[:, 0]

    def p_compliant(self, scores: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(scores - self.offset[...])


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
    """``mean(-log sigmoid(s+ - s-))``."""
    return jnp.mean(jax.nn.softplus(-(chosen - rejected)))


def calibration_loss(scores: jax.Array, offset: jax.Array, labels: jax.Array) -> jax.Array:
    """Binary cross-entropy of ``sigmoid(s - b)`` against 0/1 ``labels``."""
    z = scores - offset
    return jnp.mean(jax.nn.softplus(z) - labels * z)


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    calibration_weight: float = 1.0  # lambda; 0 = Bradley-Terry only
    learning_rate: float = 1e-3
    steps: int = 300
    batch_pairs: int = 16
    batch_points: int = 16
    seed: int = 0
    warmup_steps: int = 0  # linear warmup from 0 to learning_rate
    min_lr_ratio: float = 1.0  # cosine decay after warmup to min_lr_ratio * learning_rate; 1 = constant

    def learning_rate_schedule(self) -> optax.Schedule:
        """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the peak
        over the remaining steps (constant when ``min_lr_ratio`` is 1)."""
        return optax.warmup_cosine_decay_schedule(
            0.0 if self.warmup_steps else self.learning_rate, self.learning_rate, self.warmup_steps,
            max(self.steps, self.warmup_steps + 1), end_value=self.min_lr_ratio * self.learning_rate)

    def __post_init__(self):
        if not self.calibration_weight >= 0 or not math.isfinite(self.calibration_weight):
            raise ValueError(f"RewardModelConfig.calibration_weight={self.calibration_weight} must be a finite number >= 0")
        if not self.learning_rate > 0 or not math.isfinite(self.learning_rate):
            raise ValueError(f"RewardModelConfig.learning_rate={self.learning_rate} must be a finite number > 0")
        for name in ("steps", "batch_pairs", "batch_points", "warmup_steps"):  # 2.5 failed in the loop, unnamed
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup_steps" else 1):
                raise ValueError(f"RewardModelConfig.{name}={v!r} must be an int >= {0 if name == 'warmup_steps' else 1}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"RewardModelConfig.warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"RewardModelConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


def _width(model: "RewardModel", ids: Sequence[Sequence[int]]) -> int:
    """The padded width of ``ids``: the longest rounded up to 16, at most the backbone's
    ``max_seq_len``; a longer input is an error naming it."""
    limit = model.lm.config.max_seq_len
    longest = max(map(len, ids))
    if longest > limit:
        i = max(range(len(ids)), key=lambda j: len(ids[j]))
        raise ValueError(f"text {i} has {longest} tokens, more than the reward model's ModelConfig.max_seq_len={limit}")
    return min(-(-longest // 16) * 16, limit)


def _encode(tokenizer, texts: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    ids = encode_prompts(tokenizer, texts)
    if max(map(len, ids)) > width:
        raise ValueError(f"an input of {max(map(len, ids))} tokens exceeds the width {width}")
    tokens = np.full((len(ids), width), getattr(tokenizer, "pad_id", None) or 0, np.int32)
    mask = np.zeros((len(ids), width), bool)
    for r, row in enumerate(ids):
        tokens[r, width - len(row):] = row
        mask[r, width - len(row):] = True
    return tokens, mask


def csrm_loss(model: RewardModel, batch: dict, calibration_weight: float) -> tuple[jax.Array, dict]:
    n = batch["chosen"].shape[0]
    scores = model(jnp.concatenate([batch["chosen"], batch["rejected"], batch["points"]]),
                   jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"], batch["points_mask"]]))
    s_pos, s_neg, s_pt = scores[:n], scores[n:2 * n], scores[2 * n:]
    bt = bradley_terry_loss(s_pos, s_neg)
    cal = calibration_loss(s_pt, model.offset[...], batch["labels"])
    loss = bt + calibration_weight * cal
    return loss, {"loss": loss, "bt": bt, "calibration": cal, "pair_accuracy": jnp.mean(s_pos > s_neg)}


@functools.partial(jax.jit, static_argnames=("graphdef", "opt", "calibration_weight"))
def reward_model_step(graphdef, params, opt_state, batch, *, opt, calibration_weight: float):
    """One optimizer step on `csrm_loss`: ``(params, opt_state, batch) -> (..., metrics)``."""

    def loss_fn(p):
        return csrm_loss(nnx.merge(graphdef, p), batch, calibration_weight)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics


def train_reward_model(model: RewardModel, points: Sequence[tuple[str, bool]], pairs: Sequence[tuple[str, str]],
                       config: RewardModelConfig = RewardModelConfig(), *, width: int | None = None
                       ) -> tuple[RewardModel, list[dict]]:
    """Train on random batches of ``pairs`` (preferred, rejected) and ``points`` (text,
    compliant); returns the trained model and the metrics every 50 steps."""
    if not points or not pairs:
        raise ValueError("train_reward_model needs at least one point and one pair")
    tok = model.tokenizer
    fits = _width(model, encode_prompts(tok, [p[0] for p in points] + [q for p in pairs for q in p]))
    if width is None:
        width = fits
    elif isinstance(width, bool) or not isinstance(width, (int, np.integer)) or not 1 <= width <= model.lm.config.max_seq_len:
        raise ValueError(f"width={width!r} is invalid: must be an int in [1, ModelConfig.max_seq_len="
                         f"{model.lm.config.max_seq_len}]")
    bad = [i for i, p in enumerate(points) if not (isinstance(p[1], (bool, np.bool_)) or p[1] in (0, 1))]
    if bad:
        raise ValueError(f"point {bad[0]} has label {points[bad[0]][1]!r}: a point's label is compliant or not "
                         "(a bool, or 0 / 1)")
    pt_tokens, pt_mask = _encode(tok, [p[0] for p in points], width)
    labels = np.asarray([float(p[1]) for p in points], np.float32)
    ch_tokens, ch_mask = _encode(tok, [p[0] for p in pairs], width)
    rj_tokens, rj_mask = _encode(tok, [p[1] for p in pairs], width)
    opt = optax.adamw(config.learning_rate_schedule(), weight_decay=0.0)
    graphdef, params = nnx.split(model, nnx.Param)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    opt_state = opt.init(params)
    rng = np.random.default_rng(config.seed)
    log = []
    for step in range(config.steps):
        pi = rng.integers(len(pairs), size=config.batch_pairs)
        qi = rng.integers(len(points), size=config.batch_points)
        batch = {"chosen": ch_tokens[pi], "chosen_mask": ch_mask[pi], "rejected": rj_tokens[pi],
                 "rejected_mask": rj_mask[pi], "points": pt_tokens[qi], "points_mask": pt_mask[qi],
                 "labels": labels[qi]}
        params, opt_state, metrics = reward_model_step(graphdef, params, opt_state, batch, opt=opt,
                                                       calibration_weight=float(config.calibration_weight))
        if step % 50 == 0 or step == config.steps - 1:
            log.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
    return nnx.merge(graphdef, params, rest), log


def score_texts(model: RewardModel, texts: Sequence[str], *, batch_size: int = 64) -> np.ndarray:
    """Scores ``[N]`` of texts, ``batch_size`` at a time."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
    if not len(texts):
        return np.zeros(0, np.float32)
    width = _width(model, encode_prompts(model.tokenizer, texts))
    tokens, mask = _encode(model.tokenizer, texts, width)
    graphdef, state = nnx.split(model)
    out = []
    for start in range(0, len(texts), batch_size):
        out.append(np.asarray(_score(graphdef, state, jnp.asarray(tokens[start:start + batch_size]),
                                     jnp.asarray(mask[start:start + batch_size]))))
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, tokens, mask):
    return nnx.merge(graphdef, state)(tokens, mask)


def save_reward_model(model: RewardModel, path, *, overwrite: bool = False) -> Path:
    """Write ``model`` to the directory ``path``: ``backbone/`` (a jaxlm checkpoint, with its
    tokenizer), ``head.safetensors`` (head kernel and bias, the calibration offset) and
    ``reward_model.json``. The directory appears complete or not at all."""
    from safetensors.numpy import save_file

    path = Path(path).absolute()
    head = {"head.kernel": np.asarray(model.head.kernel[...], np.float32),
            "head.bias": np.asarray(model.head.bias[...], np.float32),
            "offset": np.asarray(model.offset[...], np.float32).reshape(1)}
    with atomic_directory(path, overwrite=overwrite) as staging:
        save_checkpoint(model.lm, staging / "backbone")
        save_file(head, str(staging / HEAD_FILE))
        (staging / META_FILE).write_text(json.dumps({"format": "jaxlm.reward_model", "version": 1}) + "\n")
    return path


def load_reward_model(path) -> RewardModel:
    """Read a directory written by `save_reward_model` (`CheckpointError` naming what is
    missing or does not fit)."""
    from safetensors.numpy import load_file

    path = Path(path).absolute()
    meta = path / META_FILE
    if not meta.exists():
        raise CheckpointError(f"{path} is not a reward model directory (no {META_FILE}); write one with "
                              "save_reward_model")
    fmt = read_json(meta, what="reward model metadata").get("format")
    if fmt != "jaxlm.reward_model":
        raise CheckpointError(f"{meta} has format={fmt!r}, expected 'jaxlm.reward_model'")
    if not (path / HEAD_FILE).exists():
        raise CheckpointError(f"{path}/{HEAD_FILE} is missing: the reward model's head was not saved")
    backbone = load_checkpoint(path / "backbone")
    head = load_file(str(path / HEAD_FILE))
    d = backbone.config.d_model
    for key, shape in (("head.kernel", (d, 1)), ("head.bias", (1,)), ("offset", (1,))):
        if key not in head:
            raise CheckpointError(f"{path}/{HEAD_FILE} lacks {key!r}")
        if tuple(head[key].shape) != shape:
            raise CheckpointError(f"{path}/{HEAD_FILE}: {key} has shape {tuple(head[key].shape)}, the backbone "
                                  f"(d_model={d}) needs {shape}")
    model = RewardModel(backbone, rngs=nnx.Rngs(0))
    model.head.kernel[...] = jnp.asarray(head["head.kernel"])
    model.head.bias[...] = jnp.asarray(head["head.bias"])
    model.offset[...] = jnp.asarray(head["offset"][0])
    return model


def directory_stamp(path: str) -> tuple[int, int]:
    """``(inode, mtime)`` of a directory: it changes when a directory is rewritten (an atomic
    save swaps a new directory in), so a model cached by ``(path, stamp)`` is never stale."""
    st = Path(path).stat()
    return st.st_ino, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _cached_reward_model(path: str, stamp: tuple[int, int]) -> RewardModel:
    return load_reward_model(path)


REWARD_MODEL_OUTPUTS = ("score", "probability")


@REWARDS.register("reward_model")
def reward_model_reward(prompts, completions, *, config=None, examples=None, **_) -> np.ndarray:
    """A trained reward model's judgment of ``prompt + completion`` (an example's prefix, e.g.
    CAMEL's forced verdict, read as the policy read it, before the completion): the raw score ``s``
    (``config.reward_model_output="score"``) or ``sigmoid(s - b)`` ("probability", CSRM's
    calibrated P(compliant)). The model is read once per directory (and again if the directory
    is rewritten) and kept."""
    path = getattr(config, "reward_model", None)
    if path is None:
        raise ValueError("the reward 'reward_model' needs GRPOConfig.reward_model=<directory written by "
                         "save_reward_model>")
    output = getattr(config, "reward_model_output", "probability")
    if output not in REWARD_MODEL_OUTPUTS:
        raise ValueError(f"GRPOConfig.reward_model_output={output!r} is invalid: must be one of {REWARD_MODEL_OUTPUTS}")
    path = str(Path(path).absolute())
    if not Path(path).is_dir():
        raise ValueError(f"GRPOConfig.reward_model={path!r} is not a directory (write one with save_reward_model)")
    model = _cached_reward_model(path, directory_stamp(path))
    questions, answers = question_and_answer(prompts, completions, examples)
    scores = score_texts(model, [q + a for q, a in zip(questions, answers)])
    if output == "score":
        return scores.astype(np.float32)
    return np.asarray(model.p_compliant(jnp.asarray(scores)), np.float32)
