"""Supervised fine-tuning as a run-harness algorithm (``algorithm.name = "sft"``): next-token
cross-entropy on the trained tokens of `jaxlm.data` batches, each token weighted by the
configured token-weight function (`trainers.losses.TOKEN_WEIGHTS`), with exact gradient
accumulation (`trainers.step.make_train_step`). ``algorithm.distill`` runs a frozen teacher
beside the student in the same step (`trainers.distill`); ``algorithm.pear`` reweights each
token toward the RL policy (`trainers.pear`).

``data.batch_size`` is global: each process loads its share of every batch and the rows are
split over the mesh's ``data`` x ``fsdp`` devices. A checkpoint stores the data iterator's
position, so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

import jaxlm
from jaxlm.data.files import DataError
from jaxlm.data.pipeline import eval_batches, eval_examples, train_dataset
from jaxlm.eval import task_accuracy
from jaxlm.sharding import model_shardings, place, to_host
from trainers.algorithm import ALGORITHMS, RunSetup
from trainers.config import ConfigError
from trainers.distill import on_policy
from trainers.distill.loss import make_distill_loss_fn
from trainers.evaluate import heldout_metrics
from trainers.losses import TOKEN_WEIGHTS
from trainers.optim import make_optimizer, param_names
from trainers.schedule.scheduler import UnitScheduler
from trainers.setup import check_batch_split, check_same_tokenizer, check_trainable
from trainers.step import TrainState, init_state, make_eval_loss, make_loss_fn, make_train_step


def required_fields(algo) -> tuple[str, ...]:
    """Per-token data columns the SFT configuration reads (PEAR's log-probs, stored top-K)."""
    fields: tuple[str, ...] = ()
    if algo.pear is not None:
        fields += algo.pear.fields
    d = algo.distill
    if d is not None and d.teacher_logprobs == "offline":
        fields += ("teacher_topk_ids", "teacher_topk_logprobs") + (("teacher_logprobs",) if d.tpa_weight else ())
    return fields


def load_teacher(path: str, student, tokenizer):
    """The frozen teacher, checked to share the student's vocabulary (same size and, when it
    carries a tokenizer, the same ids for a probe text)."""
    teacher = jaxlm.load_model(path)
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    if tv != sv:
        raise ConfigError(f"algorithm.distill.teacher={path!r} has vocab_size={tv} but the student has {sv}: "
                          "distillation compares next-token distributions over one shared vocabulary")
    check_same_tokenizer(getattr(teacher, "tokenizer", None), tokenizer, f"algorithm.distill.teacher={path!r}")
    return teacher


def check_eval_budget(examples, tokenizer, max_new_tokens: int, max_seq_len: int) -> None:
    """The held-out prompts (encoded as `generate` encodes them) plus ``max_new_tokens`` must
    fit the model, checked before training (not at the first evaluation, after the steps)."""
    longest, where = max((len(tokenizer.encode(e["prompt"], add_bos=True)) if isinstance(e["prompt"], str)
                          else len(e["prompt"]), i) for i, e in enumerate(examples))
    if longest + max_new_tokens > max_seq_len:
        raise ConfigError(
            f"held-out example {where}'s prompt has {longest} tokens + trainer.eval_max_new_tokens={max_new_tokens} "
            f"= {longest + max_new_tokens} > model.max_seq_len={max_seq_len}: lower trainer.eval_max_new_tokens "
            f"(at most {max_seq_len - longest} here) or set trainer.eval_generate=0")


@ALGORITHMS.register("sft")
class SFT:
    """SFT on ``cfg.data``: one optimizer step per harness step."""

    unit = "step"

    def __init__(self, setup: RunSetup):
        cfg, mesh = setup.cfg, setup.mesh
        t, a = cfg.trainer, cfg.algorithm
        self.cfg, self.mesh, self.tokenizer = cfg, mesh, setup.tokenizer
        check_batch_split(cfg, mesh)
        self.graphdef, state = nnx.split(setup.model)
        self._params = place(nnx.to_pure_dict(state), nnx.to_pure_dict(model_shardings(setup.model, mesh)))
        self.tx, schedule = make_optimizer(cfg.optimizer, t.steps)
        check_trainable(cfg, list(jax.tree.leaves(param_names(self._params))))

        local = dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size // jax.process_count())
        data = train_dataset(local, setup.tokenizer, shard_index=jax.process_index(), shard_count=jax.process_count())
        self.batches = iter(data)  # a grain iterator: get_state / set_state
        self._batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        self._replicated = NamedSharding(mesh, PartitionSpec())

        window = setup.model.config.sliding_window
        self._teacher, teacher_graphdef, loss_fn = None, None, None
        d = a.distill
        if d is not None and d.teacher_logprobs != "offline":
            teacher = load_teacher(d.teacher, setup.model, setup.tokenizer)
            teacher_graphdef, tstate = nnx.split(teacher)
            self._teacher = place(nnx.to_pure_dict(tstate), nnx.to_pure_dict(model_shardings(teacher, mesh)))
        if d is not None and d.top_k > setup.model.config.vocab_size and (
                d.teacher_logprobs == "topk" or d.divergence == "tail_aware"):
            raise ConfigError(f"algorithm.distill.top_k={d.top_k} is more than the vocabulary "
                              f"(model.vocab_size={setup.model.config.vocab_size})")
        if d is not None and d.on_policy and jax.process_count() > 1:
            raise ConfigError("algorithm.distill.on_policy samples on one process (trainer.multihost=false)")
        if d is not None or a.pear is not None:
            loss_fn = make_distill_loss_fn(self.graphdef, sliding_window=window, distill=d, pear=a.pear,
                                           teacher_graphdef=teacher_graphdef, vocab_size=setup.model.config.vocab_size)
        self._side_input = loss_fn is not None
        self._fields = required_fields(a)
        self._vocab_size = setup.model.config.vocab_size
        self.scheduler = None
        if a.schedule is not None:
            if jax.process_count() > 1:
                raise ConfigError("algorithm.schedule runs on one process (trainer.multihost=false)")
            o = cfg.optimizer
            # units are ranked (and D^3's lookahead taken) with the loss this run trains on
            if loss_fn is not None:
                teacher = self._teacher

                def trained_loss(params, batch):
                    total, (count, _) = loss_fn(params, batch, teacher)
                    return total, count
            else:
                trained_loss = make_loss_fn(self.graphdef, sliding_window=window, weight_fn=TOKEN_WEIGHTS[a.token_weights],
                                            beta_l1=a.beta_l1, sem_lambda=a.sem_lambda, sem_threshold=a.sem_threshold)
            self.scheduler = UnitScheduler(self.batches, a.schedule, trained_loss, self._params, adam=(o.b2, o.eps))
        self._step = make_train_step(
            self.graphdef, self.tx, schedule, grad_accum=t.grad_accum, sliding_window=window,
            weight_fn=TOKEN_WEIGHTS[a.token_weights], beta_l1=a.beta_l1, sem_lambda=a.sem_lambda,
            sem_threshold=a.sem_threshold, loss_fn=loss_fn,
        )
        self._eval_loss = make_eval_loss(self.graphdef, sliding_window=window, attention_stats=t.eval_attention_stats)
        self._heldout = eval_batches(cfg.data, setup.tokenizer)
        examples, self._verify = eval_examples(cfg.data)
        self._examples = examples[: t.eval_generate]
        if self._verify is not None and self._examples:
            check_eval_budget(self._examples, self.tokenizer, t.eval_max_new_tokens, cfg.model.max_seq_len)

    def place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over ``data`` x ``fsdp``."""
        return {k: jax.make_array_from_process_local_data(self._batch_sharding, np.asarray(v))
                for k, v in batch.items()}

    def init_state(self) -> TrainState:
        state = init_state(self._params, self.tx, self.cfg.trainer.seed)
        return state.replace(step=jax.device_put(state.step, self._replicated),
                             rng=jax.device_put(state.rng, self._replicated))

    def batch(self, state: TrainState, k: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        info: dict[str, float] = {}
        if self.scheduler is not None:
            batch, info = self.scheduler.next(state.params, state.opt_state)
        else:
            batch = next(self.batches)
        d = self.cfg.algorithm.distill
        if d is not None and d.on_policy:
            # whether and how this batch is resampled is fixed by (seed, step): resume rebuilds it
            rng = np.random.default_rng([self.cfg.trainer.seed, k, 2])
            sampled = rng.random() < d.on_policy
            info["on_policy"] = float(sampled)
            if sampled:
                batch, sample_info = on_policy.sample_rows(
                    nnx.merge(self.graphdef, state.params), batch, seed=int(rng.integers(2**31)),
                    temperature=d.on_policy_temperature, max_new_tokens=d.on_policy_max_new_tokens,
                    eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id or 0)
                info.update(sample_info)
        missing = [f for f in self._fields if f not in batch]
        if missing:
            raise ConfigError(
                f"{' and '.join(self._fields_for(missing))} need(s) the data rows' per-token {missing} columns, which "
                f"{type(self.cfg.data.source).__name__} rows do not carry: write them with `jaxlm logprobs MODEL "
                f"--data FILE --out FILE --as {missing[0].split('_')[0]}` and train on data.source=Files(path=...)")
        if "teacher_topk_ids" in self._fields:
            V = self._vocab_size
            top = int(np.max(batch["teacher_topk_ids"], initial=0))
            if top >= V:  # a gather past the vocabulary is NaN; the scatter backward drops it
                raise DataError(f"the data rows' teacher_topk_ids hold token id {top}, outside the student's "
                                f"vocabulary (vocab_size={V}): rewrite them with `jaxlm logprobs` and a teacher that "
                                "shares the student's vocabulary")
        return batch, info

    def _fields_for(self, missing: list[str]) -> list[str]:
        a = self.cfg.algorithm
        names = []
        if a.pear is not None and set(missing) & set(a.pear.fields):
            names.append("algorithm.pear")
        if a.distill is not None and set(missing) - set(a.pear.fields if a.pear is not None else ()):
            names.append("algorithm.distill.teacher_logprobs='offline'")
        return names

    def tokens(self, batch: dict[str, np.ndarray]) -> float:
        """Tokens in the global batch (this process holds its share of the rows)."""
        local = int((batch["segment_ids"] > 0).sum())
        if jax.process_count() == 1:
            return float(local)
        return float(np.asarray(multihost_utils.process_allgather(np.int64(local))).sum())

    def step(self, state: TrainState, batch: dict[str, np.ndarray]) -> tuple[TrainState, dict[str, Any]]:
        placed = self.place(batch)
        inputs = (placed, self._teacher) if self._side_input else placed  # the teacher rides unsplit
        state, metrics = self._step(state, inputs)
        return state, to_host(metrics)

    def _place_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A global batch (every process holds all rows, e.g. the held-out set) -> this
        process's rows, placed."""
        n, p = jax.process_count(), jax.process_index()
        rows = len(batch["tokens"]) // n
        return self.place({k: v[p * rows:(p + 1) * rows] for k, v in batch.items()})

    def evaluate(self, state: TrainState, k: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        result: dict[str, Any] = heldout_metrics(self._eval_loss, state.params, self._heldout, self._place_global)
        samples: list[dict[str, Any]] = []
        if self._verify is not None and self._examples:
            acc = task_accuracy(
                nnx.merge(self.graphdef, state.params), self._examples, self._verify, tokenizer=self.tokenizer,
                max_new_tokens=self.cfg.trainer.eval_max_new_tokens, batch_size=min(64, len(self._examples)),
            )
            result["accuracy"], samples = acc.accuracy, acc.samples
        return result, samples

    def data_state(self) -> dict[str, Any]:
        if getattr(self, "scheduler", None) is not None:
            return {"scheduler": self.scheduler.get_state(), "iterator": self.batches.get_state()}
        return self.batches.get_state()

    def load_data_state(self, data_state: dict[str, Any]) -> None:
        if getattr(self, "scheduler", None) is not None:
            self.batches.set_state(data_state["iterator"])
            self.scheduler.set_state(data_state["scheduler"])
        else:
            self.batches.set_state(data_state)

    def final_model(self, state: TrainState):
        model = nnx.merge(self.graphdef, state.params)
        model.tokenizer = self.tokenizer
        return model
