"""Omni (video + audio + text) training as a run-harness algorithm (``algorithm.name = "omni"``).

The model is an `OmniModel` (`jaxlm.models.omni`): the harness's language model (``cfg.model``,
random init or ``init_from``) with a video and an audio encoder spliced in at placeholder
tokens, on Qwen2.5-Omni three-axis positions. Each training row is ``[BOS] clip question
answer [EOS]`` for a clip of the synthetic audio-visual task (`jaxlm.data.audiovisual`), laid
out by `build_sequence` (video chunks, each followed by the audio of its span); the loss is
the next-token cross-entropy of the answer and EOS, summed over the batch and divided by their
count (exact under gradient accumulation, `trainers.step.make_train_step`).

The encoders are parameters of the `TrainState` like the language model's, so checkpoints,
resume and divergence handling are the harness's own. Batch ``k`` is a function of
``(trainer.seed, k)`` (no iterator state to store); held-out clips come from a disjoint index
range. The final model is written by `save_omni` (``out_dir/model``: ``lm/`` a jaxlm checkpoint,
the encoders beside it); `load_omni` reads it back.

Evaluation: held-out answer loss, ``accuracy`` = greedy exact match of answer and EOS under
teacher forcing (every target is the argmax), and the accuracy per question type
(``accuracy/look``, ``accuracy/tone``, ``accuracy/move``).
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxlm.data.audiovisual import av_example
from jaxlm.models.omni import AudioVisual, OmniConfig, OmniModel, batch_sequences, build_sequence, save_omni
from jaxlm.sharding import model_shardings, place, to_host
from trainers.algorithm import ALGORITHMS, RunSetup
from trainers.config import ConfigError, OmniTrainConfig
from trainers.losses import token_nll
from trainers.optim import make_optimizer, param_names
from trainers.setup import check_batch_split, check_trainable
from trainers.step import TrainState, init_state, make_train_step

#: Clip indices at or above this are held out (training draws below it).
HELD_OUT = 1 << 30

Batch = dict[str, jax.Array]


def omni_config(cfg, tokenizer) -> OmniConfig:
    """The `OmniConfig` of run ``cfg``: placeholders default to the first two ids past the
    tokenizer's vocabulary, which ``model.vocab_size`` must hold."""
    a: OmniTrainConfig = cfg.algorithm
    video_id = tokenizer.vocab_size if a.video_token_id is None else a.video_token_id
    audio_id = tokenizer.vocab_size + 1 if a.audio_token_id is None else a.audio_token_id
    for name, v in (("video_token_id", video_id), ("audio_token_id", audio_id)):
        if v >= cfg.model.vocab_size:
            raise ConfigError(f"algorithm.{name}={v} does not fit model.vocab_size={cfg.model.vocab_size}: the "
                              f"placeholders need ids past the tokenizer's {tokenizer.vocab_size} (raise "
                              f"model.vocab_size to {max(video_id, audio_id) + 1} or set the ids)")
        if v < tokenizer.vocab_size:
            raise ConfigError(f"algorithm.{name}={v} is a token of the tokenizer (its ids are 0..."
                              f"{tokenizer.vocab_size - 1}); a placeholder must be an id text never encodes to")
    if video_id == audio_id:
        raise ConfigError(f"algorithm.video_token_id and audio_token_id are both {video_id}")
    t = a.task
    return OmniConfig(lm=cfg.model, patch_dim=t.patch_dim, audio_dim=t.audio_dim, video_token_id=video_id,
                      audio_token_id=audio_id, encoder_hidden=a.encoder_hidden)


def row_length(a: OmniTrainConfig, config: OmniConfig, tokenizer) -> int:
    """The longest row any clip of task ``a.task`` makes (BOS, media, question, answer, EOS):
    every batch is padded to it, so batches share one shape (one compilation; equal shapes
    on every process)."""
    t = a.task
    ex = av_example(t, 0, 0)
    clip = AudioVisual(ex["video"], ex["audio"], frames_per_chunk=a.frames_per_chunk, frame_ticks=a.frame_ticks,
                       audio_ticks=a.audio_ticks)
    media = len(build_sequence([clip], tokenizer, config).tokens)
    answers = list("LRUD") + list("WXYZ"[:t.n_shapes]) + [chr(65 + k) for k in range(t.n_labels)]
    longest = max(len(tokenizer.encode(q)) for q in t.questions) + max(len(tokenizer.encode(x)) for x in answers)
    return (tokenizer.bos_id is not None) + media + longest + 1


def clip_rows(a: OmniTrainConfig, config: OmniConfig, tokenizer, indices, seed: int,
              width: int | None = None) -> dict[str, np.ndarray]:
    """The rows of clips ``indices``: left-padded (to ``width`` tokens if given) ``tokens``,
    ``positions [B, T, 3]``, ``mask`` (real tokens), ``video``, ``audio`` and ``target`` (the
    answer and EOS tokens, the ones the loss predicts), plus ``question_type [B]`` (an index
    into ``a.task.questions``)."""
    seqs, n_targets, qtypes = [], [], []
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for i in indices:
        ex = av_example(a.task, int(i), seed)
        answer = list(tokenizer.encode(ex["answer"])) + [tokenizer.eos_id]
        clip = AudioVisual(ex["video"], ex["audio"], frames_per_chunk=a.frames_per_chunk,
                           frame_ticks=a.frame_ticks, audio_ticks=a.audio_ticks)
        seqs.append(build_sequence([bos, clip, ex["question"], answer], tokenizer, config))
        n_targets.append(len(answer))
        qtypes.append(a.task.questions.index(ex["question"]))
    batch = batch_sequences(seqs, tokenizer.pad_id if tokenizer.pad_id is not None else 0)
    T = batch["tokens"].shape[1]
    if width is not None:
        if T > width:
            raise ValueError(f"a row of {T} tokens is longer than width={width}")
        pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        for k, fill in (("tokens", pad_id), ("positions", 0), ("mask", False)):
            v = batch[k]
            batch[k] = np.pad(v, [(0, 0), (width - T, 0)] + [(0, 0)] * (v.ndim - 2), constant_values=fill)
        T = width
    batch["target"] = np.arange(T)[None, :] >= T - np.asarray(n_targets)[:, None]
    batch["question_type"] = np.asarray(qtypes, np.int32)
    return batch


def answer_nll(model: OmniModel, batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(nll [B, T], predicted [B, T], valid [B, T])`` at each position whose next token is a
    target: the cross-entropy of that token, the argmax prediction, and where it counts."""
    chex.assert_rank(batch["tokens"], 2)
    chex.assert_rank(batch["positions"], 3)
    out = model(batch["tokens"], batch["positions"], video=batch["video"], audio=batch["audio"], mask=batch["mask"])
    tokens = batch["tokens"]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    valid = jnp.concatenate([batch["target"][:, 1:], jnp.zeros_like(batch["target"][:, :1])], axis=1)
    nll = jnp.where(valid, token_nll(out.logits, targets), 0.0)
    return nll, jnp.argmax(out.logits, -1), valid


def make_omni_loss_fn(graphdef):
    """``loss(params, batch, side) -> (nll sum, target count)`` for `make_train_step`."""

    def loss_fn(params, batch, side):
        del side
        nll, _, valid = answer_nll(nnx.merge(graphdef, params), batch)
        return jnp.sum(nll), jnp.sum(valid, dtype=jnp.float32)

    return loss_fn


@ALGORITHMS.register("omni")
class OmniTraining:
    """Answer cross-entropy on synthetic audio-visual clips; encoders and language model in one state."""

    unit = "step"

    def __init__(self, setup: RunSetup):
        cfg, mesh = setup.cfg, setup.mesh
        self.cfg, self.mesh, self.tokenizer = cfg, mesh, setup.tokenizer
        t, a = cfg.trainer, cfg.algorithm
        check_batch_split(cfg, mesh)
        self.config = omni_config(cfg, setup.tokenizer)
        self._width = row_length(a, self.config, setup.tokenizer)
        if self._width > cfg.model.max_seq_len:
            raise ConfigError(f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the task's rows "
                              f"({self._width} tokens: media, question and answer)")
        model = OmniModel(self.config, rngs=nnx.Rngs(params=t.seed), tokenizer=setup.tokenizer)
        model.lm = setup.model  # random init or init_from's weights
        self.graphdef, state = nnx.split(model)
        self._params = place(nnx.to_pure_dict(state), nnx.to_pure_dict(model_shardings(model, mesh)))
        self.tx, schedule = make_optimizer(cfg.optimizer, t.steps)
        check_trainable(cfg, list(jax.tree.leaves(param_names(self._params))))
        self._step = make_train_step(self.graphdef, self.tx, schedule, grad_accum=t.grad_accum,
                                     loss_fn=make_omni_loss_fn(self.graphdef))
        self._batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        graphdef = self.graphdef

        @jax.jit
        def eval_fn(params, batch):
            nll, predicted, valid = answer_nll(nnx.merge(graphdef, params), batch)
            targets = jnp.concatenate([batch["tokens"][:, 1:], jnp.zeros_like(batch["tokens"][:, :1])], axis=1)
            exact = jnp.all((predicted == targets) | ~valid, axis=-1)
            return {"nll": jnp.sum(nll, -1), "count": jnp.sum(valid, -1), "exact": exact, "predicted": predicted}

        self._eval_fn = eval_fn
        bs = cfg.data.batch_size
        n_eval = -(-a.eval_examples // bs) * bs
        self._eval_indices = [np.arange(HELD_OUT + i, HELD_OUT + i + bs) for i in range(0, n_eval, bs)]

    # -- data ------------------------------------------------------------------------------

    def _local_rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """This process's share of the global rows ``indices``."""
        n, p = jax.process_count(), jax.process_index()
        rows = len(indices) // n
        return clip_rows(self.cfg.algorithm, self.config, self.tokenizer, indices[p * rows:(p + 1) * rows],
                         self.cfg.trainer.seed, width=self._width)

    def place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over ``data`` x ``fsdp``."""
        return {k: jax.make_array_from_process_local_data(self._batch_sharding, np.asarray(v))
                for k, v in batch.items() if k != "question_type"}

    def batch(self, state: TrainState, k: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        rng = np.random.default_rng([self.cfg.trainer.seed, k, 31])
        return self._local_rows(rng.integers(0, HELD_OUT, self.cfg.data.batch_size)), {}

    def tokens(self, batch: dict[str, np.ndarray]) -> float:
        local = int(batch["mask"].sum())
        if jax.process_count() == 1:
            return float(local)
        return float(np.asarray(multihost_utils.process_allgather(np.int64(local))).sum())

    # -- steps -----------------------------------------------------------------------------

    def init_state(self) -> TrainState:
        state = init_state(self._params, self.tx, self.cfg.trainer.seed)
        return state.replace(step=jax.device_put(state.step, self._replicated),
                             rng=jax.device_put(state.rng, self._replicated))

    def step(self, state: TrainState, batch: dict[str, np.ndarray]) -> tuple[TrainState, dict[str, Any]]:
        state, metrics = self._step(state, (self.place(batch), None))
        return state, to_host(metrics)

    def evaluate(self, state: TrainState, k: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        questions = self.cfg.algorithm.task.questions
        nll = count = 0.0
        exact_by_q = {q: [] for q in questions}
        samples: list[dict[str, Any]] = []
        for indices in self._eval_indices:
            local = self._local_rows(indices)
            out = to_host(self._eval_fn(state.params, self.place(local)))
            rows = clip_rows(self.cfg.algorithm, self.config, self.tokenizer, indices, self.cfg.trainer.seed,
                             width=self._width) if jax.process_count() > 1 else local
            nll += float(out["nll"].sum())
            count += float(out["count"].sum())
            for b, q in enumerate(rows["question_type"]):
                exact_by_q[questions[q]].append(bool(out["exact"][b]))
            for b in range(min(len(indices), self.cfg.trainer.eval_generate - len(samples))):
                # the target at position t is predicted at t - 1
                where = np.flatnonzero(rows["target"][b]) - 1
                samples.append({"prompt": questions[rows["question_type"][b]],
                                "answer": self.tokenizer.decode(rows["tokens"][b][where + 1].tolist()),
                                "completion": self.tokenizer.decode(out["predicted"][b][where].tolist()),
                                "correct": bool(out["exact"][b])})
        every = [x for v in exact_by_q.values() for x in v]
        result = {"loss": nll / max(count, 1.0), "accuracy": float(np.mean(every))}
        for q, v in exact_by_q.items():
            if v:
                result[f"accuracy/{q.rstrip(':')}"] = float(np.mean(v))
        return result, samples

    # -- state besides the TrainState, and the final model -----------------------------------

    def data_state(self) -> dict[str, Any]:
        return {}  # batch k is a function of (trainer.seed, k)

    def load_data_state(self, data_state: dict[str, Any]) -> None:
        pass

    def final_model(self, state: TrainState) -> OmniModel:
        model = nnx.merge(self.graphdef, state.params)
        model.lm.tokenizer = self.tokenizer
        return model

    def save_model(self, state: TrainState, path) -> None:
        """``path``: the omni checkpoint (`save_omni`), replaced whole."""
        save_omni(self.final_model(state), path, overwrite=True)
