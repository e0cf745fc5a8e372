"""Masked-diffusion training as a run-harness algorithm (``algorithm.name = "diffusion"``).

LLaDA's objective (Nie et al. 2025, ``GUIDELINES.md``): each document draws ``t ~ U(0, 1)``,
each eligible token is replaced by ``[MASK]`` with probability ``p_mask = (1 - eps) t + eps``
and the model (bidirectional within its document) is trained with the cross-entropy of the
masked tokens divided by ``p_mask``:

* pretraining: ``L = 1/(B L) sum_b sum_{i masked} CE_i / p_mask``, every real token eligible;
* SFT: the prompt is never masked; ``L = 1/B sum_b sum_{i masked} CE_i / (p_mask |answer_b|)``,
  with each row's padding turned into EOS answer tokens (``pad_answers``).

ME-DLM's mask + edit training (``objective="edit"``, `trainers.edit_batches`): host-built
batches of masked answers or of the live model's own filled and self-edited outputs, both heads
trained, ``L = sum_b (mean CE_cur_b + mean CE_next_b) / p_b`` over documents.

SPEED's sharpened-teacher distillation (ICML 2026; method card B.8): with ``teacher`` set,
``L = L_MLM + lambda tau^2 mean_{i in S} KL(softmax(z^T_i / tau_T) || softmax(z^S_i / tau))``
over ``S``, the masked positions where the teacher's argmax is the clean token.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxlm
from jaxlm.data.pipeline import eval_examples, train_dataset
from jaxlm.eval import task_accuracy
from jaxlm.sharding import model_shardings, place, to_host
from trainers import edit_batches
from trainers.algorithm import ALGORITHMS, RunSetup
from trainers.config import ConfigError
from trainers.losses import token_nll
from trainers.optim import make_optimizer, param_names
from trainers.setup import check_batch_split, check_trainable
from trainers.sft import SFT
from trainers.step import StateShardedJit, TrainState, apply_summed_gradients, init_state

Batch = dict[str, jax.Array]


def noise_batch(rng: jax.Array, batch: Batch, *, mask_id: int, eps: float, objective: str):
    """The forward process: ``(noisy tokens, masked [B, T], p_mask [B, T])``. One ``t`` per
    document (row and segment id); pretraining may mask any real token, SFT only trained ones."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    B, T = tokens.shape
    t_key, m_key = jax.random.split(rng)
    t_doc = jax.random.uniform(t_key, (B, T + 1), jnp.float32)  # index = segment id
    t = jnp.take_along_axis(t_doc, jnp.clip(seg, 0, T), axis=1)
    p_mask = (1.0 - eps) * t + eps
    eligible = seg > 0 if objective == "pretrain" else (seg > 0) & batch["loss_mask"]
    masked = eligible & (jax.random.uniform(m_key, (B, T), jnp.float32) < p_mask)
    return jnp.where(masked, mask_id, tokens), masked, p_mask


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """Bidirectional block-diagonal attention ``[B, 1, T, T]``: a token sees every real token of
    its own document."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & (segment_ids[:, None, :] > 0))[:, None]


def answer_lengths(batch: Batch) -> jax.Array:
    """``|answer|`` of each token's document ``[B, T]`` (trained tokens in its segment)."""
    seg, trained = batch["segment_ids"], batch["loss_mask"] & (batch["segment_ids"] > 0)
    same = seg[:, :, None] == seg[:, None, :]
    return jnp.sum(same & trained[:, None, :], axis=-1).astype(jnp.float32)


def diffusion_loss_sum(logits, batch: Batch, masked, p_mask, *, objective: str) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` whose ratio is LLaDA's loss: pretraining ``sum = sum_masked CE / p``,
    ``count`` = real tokens; SFT ``sum = sum_masked CE / (p |answer|)``, ``count`` = documents
    with an answer."""
    ce = token_nll(logits, batch["tokens"])
    seg = batch["segment_ids"]
    if objective == "pretrain":
        total = jnp.sum(jnp.where(masked, ce / p_mask, 0.0))
        return total, jnp.sum(seg > 0, dtype=jnp.float32)
    n = answer_lengths(batch)
    total = jnp.sum(jnp.where(masked, ce / (p_mask * jnp.maximum(n, 1.0)), 0.0))
    trained = batch["loss_mask"] & (seg > 0)
    has_answer = jax.vmap(lambda s_, t_: jnp.zeros(seg.shape[1] + 1, bool).at[s_].max(t_))(seg, trained)
    return total, jnp.sum(has_answer[:, 1:], dtype=jnp.float32)


def sharpened_kl(student_logits, teacher_logits, targets, masked, *, teacher_temperature: float,
                 student_temperature: float) -> tuple[jax.Array, jax.Array]:
    """SPEED's KL term: ``(sum_{i in S} KL(softmax(z^T/tau_T) || softmax(z^S/tau)), |S|)`` with
    ``S`` the masked positions where the teacher's argmax equals the target."""
    correct = masked & (jnp.argmax(teacher_logits, -1) == targets)
    lt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / teacher_temperature, -1)
    ls = jax.nn.log_softmax(student_logits.astype(jnp.float32) / student_temperature, -1)
    kl = jnp.sum(jnp.exp(lt) * (lt - ls), -1)
    return jnp.sum(jnp.where(correct, kl, 0.0)), jnp.sum(correct, dtype=jnp.float32)


def edit_loss_sum(logits, next_logits, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """``(sum, count)`` of ME-DLM's loss on an edit batch: per document ``weight * (mean CE of
    the current-token head + mean CE of the next-token head)`` over its labelled slots (a head
    without labels adds 0), ``count`` = documents with a label."""
    total = jnp.zeros((logits.shape[0],), jnp.float32)
    any_label = jnp.zeros((logits.shape[0],), bool)
    for head_logits, labels in ((logits, batch["cur_labels"]), (next_logits, batch["next_labels"])):
        has = labels >= 0
        ce = token_nll(head_logits, jnp.maximum(labels, 0))
        n = jnp.sum(has, axis=1, dtype=jnp.float32)
        total = total + jnp.sum(jnp.where(has, ce, 0.0), axis=1) / jnp.maximum(n, 1.0)
        any_label = any_label | (n > 0)
    return jnp.sum(jnp.where(any_label, batch["weight"] * total, 0.0)), jnp.sum(any_label, dtype=jnp.float32)


def make_loss_fn(graphdef, algo, mask_id: int, teacher_graphdef=None):
    """``loss(params, batch, rng, teacher_params) -> (sum, count)`` (see the module docstring)."""

    def loss_fn(params, batch, rng, teacher_params):
        if algo.objective == "edit":  # the noise is in the host-built batch
            out = nnx.merge(graphdef, params)(batch["tokens"], batch["positions"],
                                              mask=document_mask(batch["segment_ids"]))
            return edit_loss_sum(out.logits, out.next_logits, batch)
        chex.assert_rank(batch["tokens"], 2)
        noisy, masked, p_mask = noise_batch(rng, batch, mask_id=mask_id, eps=algo.eps, objective=algo.objective)
        mask = document_mask(batch["segment_ids"])
        model = nnx.merge(graphdef, params)
        logits = model(noisy, batch["positions"], mask=mask).logits
        total, count = diffusion_loss_sum(logits, batch, masked, p_mask, objective=algo.objective)
        if teacher_graphdef is not None and algo.distill_weight:
            teacher = nnx.merge(teacher_graphdef, teacher_params)
            t_logits = jax.lax.stop_gradient(teacher(noisy, batch["positions"], mask=mask).logits)
            kl_sum, n_correct = sharpened_kl(logits, t_logits, batch["tokens"], masked,
                                             teacher_temperature=algo.teacher_temperature,
                                             student_temperature=algo.student_temperature)
            kl_mean = kl_sum / jnp.maximum(n_correct, 1.0)
            # the KL's mean over S added to the loss mean: scaled by the count so sum / count carries it
            total = total + count * algo.distill_weight * algo.student_temperature**2 * kl_mean
        return total, count

    return loss_fn


def make_diffusion_step(graphdef, tx: optax.GradientTransformation, schedule, algo, mask_id: int, *,
                        grad_accum: int = 1, teacher_graphdef=None, donate: bool = True):
    """A jitted ``step(state, (batch, teacher_params)) -> (state, metrics)``; the noise comes
    from ``state.rng`` (advanced by every applied step), one key per micro-batch."""
    grad_fn = jax.value_and_grad(make_loss_fn(graphdef, algo, mask_id, teacher_graphdef), has_aux=True)

    def step(state: TrainState, inputs):
        batch, teacher_params = inputs
        key = jax.random.wrap_key_data(state.rng)
        B = batch["tokens"].shape[0]
        micro = jax.tree.map(lambda x: x.reshape(B // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch)

        def accumulate(carry, xs):
            g_sum, loss_sum, count = carry
            mb, i = xs
            (loss, n), g = grad_fn(state.params, mb, jax.random.fold_in(key, i), teacher_params)
            return (jax.tree.map(jnp.add, g_sum, g), loss_sum + loss, count + n), None

        if grad_accum == 1:
            (loss_sum, count), g_sum = grad_fn(state.params, batch, jax.random.fold_in(key, 0), teacher_params)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            (g_sum, loss_sum, count), _ = jax.lax.scan(accumulate, init, (micro, jnp.arange(grad_accum)))
        new, loss, grad_norm, finite = apply_summed_gradients(state, tx, g_sum, loss_sum, count)
        return new, {"loss": loss, "grad_norm": grad_norm, "tokens": count, "lr": schedule(state.step),
                     "finite": finite}

    return StateShardedJit(step, donate=donate)


def pad_answers(batch: dict[str, np.ndarray], eos_id: int, rng: np.random.Generator | None = None
                ) -> dict[str, np.ndarray]:
    """LLaDA SFT rows: padding after the (single) example of each row becomes EOS tokens that
    belong to the example and are trained. With ``rng`` each row is padded to a random length
    between its example's and the row's (LLaDA pads each batch to its longest sequence, so the
    model sees responses of many lengths); the rest stays padding, unseen and untrained."""
    seg = batch["segment_ids"]
    B, T = seg.shape
    n = (seg > 0).sum(1)
    ends = np.full(B, T) if rng is None else rng.integers(n, T + 1)
    pad = (seg == 0) & (np.arange(T)[None] < ends[:, None])
    out = dict(batch)
    out["tokens"] = np.where(pad, eos_id, batch["tokens"]).astype(np.int32)
    out["loss_mask"] = batch["loss_mask"] | pad
    out["segment_ids"] = np.where(pad, 1, seg).astype(np.int32)
    real = out["segment_ids"] > 0
    out["positions"] = np.where(real, np.arange(T, dtype=np.int32)[None], 0).astype(np.int32)
    return out


def check_special_ids(model_cfg, tokenizer) -> None:
    """The mask (and delete) id must be none of the tokenizer's BOS / EOS / PAD / stop ids: a
    clean EOS would read as noise, and the sampler, which never emits the mask id, could never
    stop."""
    specials = {name: getattr(tokenizer, f"{name}_id", None) for name in ("bos", "eos", "pad")}
    specials.update({f"stop id {i}": i for i in getattr(tokenizer, "stop_ids", None) or ()})
    for field in ("mask_token_id", "delete_token_id"):
        v = getattr(model_cfg, field, None)
        clash = [name for name, i in specials.items() if i is not None and v is not None and int(i) == int(v)]
        if clash:
            raise ConfigError(f"model.{field}={v} is the tokenizer's {clash[0]} id: give the {field.split('_')[0]} "
                              "token an id of its own (e.g. one past the tokenizer's vocabulary)")
        if v is not None and int(v) < tokenizer.vocab_size:
            try:  # an ordinary token decodes to text (a special one to nothing)
                text = tokenizer.decode([int(v)])  # special tokens are skipped
            except Exception:  # noqa: BLE001 (an id the tokenizer cannot decode is no text of it)
                text = ""
            if text:
                raise ConfigError(f"model.{field}={v} is the tokenizer's ordinary token {text!r}: clean occurrences of "
                                  f"it in the data would read as [{field.split('_')[0].upper()}]; give the token an id "
                                  "of its own (e.g. one past the tokenizer's vocabulary)")


@ALGORITHMS.register("diffusion")
class Diffusion:
    """Masked-diffusion training on ``cfg.data`` (one optimizer step per harness step)."""

    unit = "step"

    def __init__(self, setup: RunSetup):
        cfg, mesh = setup.cfg, setup.mesh
        t, a = cfg.trainer, cfg.algorithm
        self.cfg, self.mesh, self.tokenizer, self.algo = cfg, mesh, setup.tokenizer, a
        if jax.process_count() > 1:
            raise ConfigError("algorithm.name='diffusion' runs on one process (trainer.multihost=false)")
        check_batch_split(cfg, mesh)
        if a.objective == "sft" and a.pad_answers and getattr(setup.tokenizer, "eos_id", None) is None:
            raise ConfigError("algorithm.pad_answers=True needs a tokenizer with an EOS token")
        if a.objective == "edit" and getattr(setup.tokenizer, "eos_id", None) is None:
            raise ConfigError("algorithm.objective='edit' needs a tokenizer with an EOS token")
        check_special_ids(cfg.model, setup.tokenizer)
        self._accepted = None
        if a.objective == "edit" and a.edit_target == "nearest":
            source = cfg.data.source
            probe = source.example(0)["prompt"] if hasattr(source, "accepted_completions") else None
            if probe is None or source.accepted_completions(probe) is None:
                raise ConfigError(f"algorithm.edit_target='nearest' needs a generated task that knows the answers it "
                                  f"accepts for a prompt (Task.accepted_completions); data.source="
                                  f"{type(source).__name__} does not")
            self._accepted = source.accepted_completions
        self.graphdef, state = nnx.split(setup.model)
        self._params = place(nnx.to_pure_dict(state), nnx.to_pure_dict(model_shardings(setup.model, mesh)))
        self.tx, schedule = make_optimizer(cfg.optimizer, t.steps)
        check_trainable(cfg, list(jax.tree.leaves(param_names(self._params))))
        self._teacher = None
        teacher_graphdef = None
        if a.teacher is not None:
            teacher = jaxlm.load_model(a.teacher)
            if teacher.config.mode != "diffusion" or teacher.config.mask_token_id != cfg.model.mask_token_id:
                raise ConfigError(f"algorithm.teacher={a.teacher!r} is not a diffusion model with mask_token_id="
                                  f"{cfg.model.mask_token_id} (got mode={teacher.config.mode!r}, "
                                  f"mask_token_id={teacher.config.mask_token_id})")
            teacher_graphdef, tstate = nnx.split(teacher)
            self._teacher = place(nnx.to_pure_dict(tstate), nnx.to_pure_dict(model_shardings(teacher, mesh)))
        self.batches = iter(train_dataset(cfg.data, setup.tokenizer))
        self._batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._step = make_diffusion_step(self.graphdef, self.tx, schedule, a, cfg.model.mask_token_id,
                                         grad_accum=t.grad_accum, teacher_graphdef=teacher_graphdef)
        examples, self._verify = eval_examples(cfg.data)
        self._examples = examples[: t.eval_generate]

    def init_state(self) -> TrainState:
        state = init_state(self._params, self.tx, self.cfg.trainer.seed)
        return state.replace(step=jax.device_put(state.step, self._replicated),
                             rng=jax.device_put(state.rng, self._replicated))

    def batch(self, state: TrainState, k: int):
        batch = next(self.batches)
        a = self.algo
        if a.objective in ("sft", "edit") and a.pad_answers:
            rng = np.random.default_rng([self.cfg.trainer.seed, k])
            batch = pad_answers(batch, self.tokenizer.eos_id, rng)
        if a.objective != "edit":
            return batch, {}
        # the batch kind, its masks and the fill order are fixed by (seed, step): resume rebuilds them
        rng = np.random.default_rng([self.cfg.trainer.seed, k, 1])
        m = self.cfg.model
        if rng.random() >= a.edit_intermediate_ratio:
            return edit_batches.mask_batch(batch, rng, mask_id=m.mask_token_id, eps=a.eps), {"intermediate": 0.0}
        cycle = a.edit_round_cycle or self.cfg.trainer.steps
        rounds = int((k % cycle) / cycle * a.edit_max_rounds)
        per_step = int(rng.choice(a.edit_fill_per_step))
        accepted = None
        if self._accepted is not None:  # every answer the task accepts for each row's prompt
            accepted = [[self.tokenizer.encode(c, add_bos=False) for c in self._accepted(self.tokenizer.decode(p))]
                        for p, _ in edit_batches.split_rows(batch)]
        built = edit_batches.intermediate_batch(
            batch, rng, nnx.merge(self.graphdef, state.params), mask_id=m.mask_token_id, del_id=m.delete_token_id,
            eos_id=self.tokenizer.eos_id, eps=a.eps, per_step=per_step, rounds=rounds, order=a.edit_fill_order,
            swap_rule=a.edit_swap_rule, accepted=accepted)
        return built, {"intermediate": 1.0, "self_edit_rounds": float(rounds)}

    def tokens(self, batch) -> float:
        return float((batch["segment_ids"] > 0).sum())

    def step(self, state: TrainState, batch):
        placed = {k: jax.device_put(np.asarray(v), self._batch_sharding) for k, v in batch.items()}
        state, metrics = self._step(state, (placed, self._teacher))
        return state, to_host(metrics)

    def evaluate(self, state: TrainState, k: int):
        result: dict[str, Any] = {}
        samples: list[dict[str, Any]] = []
        if self._verify is not None and self._examples:
            n = self.cfg.trainer.eval_max_new_tokens
            acc = task_accuracy(
                nnx.merge(self.graphdef, state.params), self._examples, self._verify, tokenizer=self.tokenizer,
                max_new_tokens=n, batch_size=min(64, len(self._examples)),
                generate_kwargs=self._eval_generate_kwargs(n),
            )
            result["accuracy"], samples = acc.accuracy, acc.samples
        return result, samples

    def _eval_generate_kwargs(self, n: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"steps": self.algo.eval_steps or n, "block_length": self.algo.eval_block_length}
        m = self.cfg.model
        if m.delete_token_id is not None:
            kw["banned_tokens"] = (m.delete_token_id,)  # mask diffusion never proposes a deletion
        if self.algo.eval_edit_rounds:
            kw["edit_rounds"] = self.algo.eval_edit_rounds
        return kw

    # the data position and the final model are kept as SFT keeps them
    data_state = SFT.data_state
    load_data_state = SFT.load_data_state
    final_model = SFT.final_model
