"""GRPO as a run-harness algorithm (``algorithm.name = "grpo"``): `GRPOTrainer` collects,
scores and updates; the harness (`trainers.loop.train`) logs, evaluates, checkpoints,
resumes and plots, as for SFT.

One iteration (``trainer.steps`` of them; the harness's ``batch`` is steps 1-3, its
``step`` is step 4):

1. the collector samples ``G`` rollouts for each of ``data.batch_size`` prompts (or plays
   ``G`` episodes per environment seed) and scores them;
2. advantages from the configured estimator, per rollout or per turn, spread over each
   rollout's policy tokens; with ``filter_zero_variance`` groups of equal rewards get no
   loss (their tokens are masked; shapes stay static);
3. the old policy's log-probs (recomputed, or the sampler's) and, with ``beta > 0``, the
   reference model's, once;
4. ``mu`` epochs; in each, the buffer sampler orders (or resamples) the rollouts and they
   are split into ``minibatches`` optimizer steps.

Data parallelism: the train state lives on ``trainer.mesh`` (`trainer.mesh` in the config,
every device by default), parameters and optimizer state placed by their logical axes as in
SFT (`jaxlm.sharding.model_shardings`), and the rollout rows of every log-prob pass and
optimizer step split over the mesh's ``data`` x ``fsdp`` devices (each micro-batch's rows
must divide evenly; the shared prompts are replicated). The sampler runs jaxlm's KV-cache
decoding with the sharded parameters, on prompts split over the same devices (collectors
with a ``prompt_sharding``). Single process (rows are host arrays).

A checkpoint stores the train state (params, optimizer state, step, rng), the iteration
(the checkpoint's step) and the collector's own state if it has one (PrefixRL's cuts); all
randomness derives from them, so a resumed run repeats an uninterrupted one exactly. The
reference model is the initial model, rebuilt identically on resume.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlm.data.pipeline import eval_examples
from jaxlm.eval import task_accuracy
from jaxlm.sharding import make_mesh, model_shardings, place, to_host
from trainers.algorithm import ALGORITHMS, RunSetup
from trainers.config import ConfigError, ExperimentConfig, GRPOConfig
from trainers.optim import make_optimizer
from trainers.rl.advantages import ADVANTAGES
from trainers.rl.buffer import BUFFER_SAMPLERS
from trainers.rl.collectors import COLLECTORS, Experience
from trainers.rl.rollout import make_logprob_fn, shared_prompts
from trainers.rl.step import make_rl_step
from trainers.step import TrainState, init_state

log = logging.getLogger(__name__)

_TRAIN_KEYS = ("tokens", "attend", "positions", "loss_mask", "sampler_logp", "old_logp", "advantages", "weights")
# step metrics that are means over the minibatch's policy tokens
_PER_TOKEN_METRICS = ("clip_frac", "ratio_mean", "kl")


def token_advantages(exp: Experience, advantages: np.ndarray) -> np.ndarray:
    """Advantages ``[B, G]`` (per rollout) or ``[B, G, K]`` (per turn) -> ``[R, T]`` on each
    row's tokens (row ``b*G + g``; a token's turn index picks its turn's advantage)."""
    R, T = exp.rows["tokens"].shape
    if advantages.ndim == 2:
        per_row = advantages.reshape(R)
        return np.broadcast_to(per_row[:, None], (R, T)).astype(np.float32)
    per_turn = advantages.reshape(R, -1)
    turn = np.clip(exp.rows["turn"], 0, per_turn.shape[1] - 1)
    return np.take_along_axis(per_turn, turn, axis=1).astype(np.float32)


def zero_variance_groups(advantages: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """``[B]`` True where every counted rollout (every counted turn, for per-turn rewards) of
    the group has advantage 0: its rewards are equal (per turn index, for turn-level
    advantages), so its tokens carry no policy gradient. ``advantages``: ``[B, G]`` or
    ``[B, G, K]``; a constant group's advantages are exactly 0 for every estimator."""
    a = np.asarray(advantages).reshape(advantages.shape[0], advantages.shape[1], -1)
    v = np.ones(a.shape, bool) if valid is None else np.asarray(valid, bool).reshape(a.shape)
    return ~np.any(v & (a != 0), axis=(1, 2))


@dataclasses.dataclass
class GRPOBatch:
    """One iteration's prepared rollouts: the rows every epoch reuses, and a few samples."""

    rows: dict[str, np.ndarray]
    iteration: int
    samples: list[dict[str, Any]]


class GRPOTrainer:
    """The pieces of a GRPO run, usable from a notebook one iteration at a time:
    ``trainer.iteration(state, k) -> (state, metrics, samples)``, and the run harness's
    algorithm (`trainers.algorithm.Algorithm`: ``batch`` collects and prepares, ``step``
    updates). ``mesh``: the devices of the train state and the rows (default:
    ``cfg.trainer.mesh`` over every device)."""

    unit = "iteration"

    def __init__(self, cfg: ExperimentConfig, model, tokenizer, *, reference_params=None, mesh=None):
        if not isinstance(cfg.algorithm, GRPOConfig):
            raise ConfigError(f"algorithm must be GRPOConfig, got {type(cfg.algorithm).__name__}")
        self.cfg, self.a = cfg, cfg.algorithm
        self.tokenizer = tokenizer
        self.graphdef, state = nnx.split(model)
        self.params = nnx.to_pure_dict(state)
        a, t = self.a, cfg.trainer
        self.mesh = mesh if mesh is not None else make_mesh(t.mesh.data, t.mesh.fsdp, t.mesh.tensor)
        self.param_shardings = nnx.to_pure_dict(model_shardings(model, self.mesh))
        self.row_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self._rows = NamedSharding(self.mesh, PartitionSpec(("data", "fsdp")))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self.updates_per_iteration = a.mu * a.minibatches
        self.tx, self.schedule = make_optimizer(cfg.optimizer, t.steps * self.updates_per_iteration)
        self.collector = COLLECTORS[a.collector](cfg, self.graphdef, tokenizer, base_params=self.params)
        if hasattr(self.collector, "prompt_sharding"):  # each data-parallel device decodes its prompts
            self.collector.prompt_sharding = self._rows
        self.logprob_fn = make_logprob_fn(self.graphdef, chunk=a.logprob_chunk)
        self.step_fn = make_rl_step(
            self.graphdef, self.tx, self.schedule, a, grad_accum=t.grad_accum,
            completion_norm=float(a.max_new_tokens),
        )
        self.reference = None
        if a.beta:
            ref = reference_params if reference_params is not None else jax.tree.map(jnp.copy, self.params)
            self.reference = place(ref, self.param_shardings)  # committed, like the state
        self._examples, self._verify = [], None
        if a.collector in ("single_turn", "camel"):  # held-out greedy accuracy needs a verifier
            examples, self._verify = eval_examples(cfg.data)
            self._examples = examples[: t.eval_generate]

    def init_state(self) -> TrainState:
        # a copy (updates donate the state's buffers; self.params stays usable), committed to
        # the mesh so the first and later iterations share their compilations
        params = place(jax.tree.map(lambda x: jnp.array(x, copy=True), self.params), self.param_shardings)
        state = init_state(params, self.tx, self.cfg.trainer.seed)
        return state.replace(step=jax.device_put(state.step, self._replicated),
                             rng=jax.device_put(state.rng, self._replicated))

    def place_rows(self, rows: dict, *, what: str) -> dict:
        """Host rows -> device arrays split over the mesh's ``data`` x ``fsdp`` devices (the
        shared ``prompts`` block replicated)."""
        n = len(rows["tokens"])
        micro = n // self.cfg.trainer.grad_accum if what == "minibatch" else n
        if micro % self.row_shards:
            a, t = self.a, self.cfg.trainer
            raise ConfigError(
                f"GRPO {what}: {micro} rows per {'micro-batch' if what == 'minibatch' else 'pass'} are not divisible "
                f"by the mesh's data x fsdp = {self.row_shards} devices (rows per iteration = data.batch_size x "
                f"algorithm.num_generations = {self.cfg.data.batch_size} x {a.num_generations} for single-turn "
                f"collectors, split into algorithm.minibatches={a.minibatches} and trainer.grad_accum={t.grad_accum}); "
                "change them or trainer.mesh"
            )
        # every process holds all rows: each puts its own devices' slices (multi-host too)
        return {k: jax.device_put(jax.tree.map(np.asarray, v), self._replicated if k == "prompts" else self._rows)
                for k, v in rows.items()}

    def prepare(self, state: TrainState, exp: Experience) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Advantages, filtering, old and reference log-probs: the rows every epoch reuses."""
        a = self.a
        adv = np.asarray(ADVANTAGES[a.advantage](
            exp.rewards, exp.valid, eps=a.adv_eps, gamma=a.turn_gamma,
        ))
        rows = dict(exp.rows)
        rows["advantages"] = token_advantages(exp, adv)
        metrics: dict[str, float] = {}
        loss_mask = rows["loss_mask"].copy()
        if a.filter_zero_variance:
            flat = zero_variance_groups(adv, exp.valid)
            G = exp.rewards.shape[1]
            loss_mask &= ~np.repeat(flat, G)[:, None]
            metrics["groups_kept"] = float((~flat).mean())
        rows["loss_mask"] = loss_mask
        device_rows = {k: rows[k] for k in ("tokens", "attend", "positions")}
        if a.shared_prompt_forward and exp.prompt_block is not None:
            rows["prompts"] = shared_prompts(rows, exp.prompt_block)
            device_rows["prompts"] = rows["prompts"]
            device_rows["prompt_index"] = rows["prompt_index"]
        device_rows = self.place_rows(device_rows, what="log-prob pass")
        if a.use_sampler_logprobs:
            rows["old_logp"] = rows["sampler_logp"]
        else:
            old, ent = to_host(self.logprob_fn(state.params, device_rows))
            rows["old_logp"] = np.where(loss_mask, old, 0.0).astype(np.float32)
            m = rows["loss_mask"]
            if m.any():  # no policy token left (every group filtered): no entropy to report
                metrics["entropy"] = float((ent * m).sum() / m.sum())
            metrics["sampler_mismatch"] = float(np.abs(old - rows["sampler_logp"])[exp.rows["loss_mask"]].max(initial=0.0))
        if self.reference is not None:
            ref, _ = to_host(self.logprob_fn(self.reference, device_rows))
            rows["ref_logp"] = ref.astype(np.float32)
        R = rows["tokens"].shape[0]
        rows["priority"] = np.abs(adv).reshape(R, -1).max(axis=1)
        return rows, metrics

    def update(self, state: TrainState, rows: dict[str, np.ndarray], iteration: int):
        """``mu`` epochs of ``minibatches`` optimizer steps over the prepared rows; the mean
        of their metrics, and ``finite`` (False: a non-finite loss or gradient stopped the
        update there)."""
        a = self.a
        R = rows["tokens"].shape[0]
        keys = list(_TRAIN_KEYS) + (["ref_logp"] if "ref_logp" in rows else [])
        sampler = BUFFER_SAMPLERS[a.buffer_sampler]
        rng = np.random.default_rng([self.cfg.trainer.seed, iteration, 7])
        per = R // a.minibatches
        metrics_sum: dict[str, float] = {}
        steps = 0
        for _ in range(a.mu):
            order, weights = sampler(rows["priority"], rng, a)
            for j in range(a.minibatches):
                idx = order[j * per : (j + 1) * per]
                mb = {k: rows[k][idx] for k in keys if k != "weights"}
                mb["weights"] = weights[j * per : (j + 1) * per]
                if "prompts" in rows:  # every minibatch carries all prompts (static shapes)
                    mb["prompts"], mb["prompt_index"] = rows["prompts"], rows["prompt_index"][idx]
                state, m = self.step_fn(state, self.place_rows(mb, what="minibatch"))
                m = to_host(m)
                if not bool(m["finite"]):  # the state is left as it was before this minibatch
                    return state, {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "finite": False}
                steps += 1
                n = float(m["policy_tokens"])
                for k, v in m.items():
                    if k in _PER_TOKEN_METRICS:  # token-weighted over the minibatches
                        metrics_sum[k] = metrics_sum.get(k, 0.0) + float(v) * n
                    elif k != "finite":
                        metrics_sum[k] = metrics_sum.get(k, 0.0) + float(v)
        tokens = metrics_sum.get("policy_tokens", 0.0)
        out = {k: v / max(steps, 1) for k, v in metrics_sum.items() if k not in _PER_TOKEN_METRICS}
        if tokens > 0:  # with no policy token (all groups filtered) there is no ratio, KL or clipping
            out.update({k: metrics_sum[k] / tokens for k in _PER_TOKEN_METRICS if k in metrics_sum})
        return state, {**out, "finite": True}

    def iteration(self, state: TrainState, k: int):
        """Collect, prepare and update once: ``(state, metrics, samples)``; a non-finite loss
        or gradient raises `FloatingPointError`."""
        batch, info = self.batch(state, k)
        state, upd = self.step(state, batch)
        if not upd.pop("finite"):
            raise FloatingPointError(f"non-finite loss or gradient (loss={upd['loss']}, grad_norm={upd['grad_norm']})")
        return state, {**info, **upd}, batch.samples

    # ------------------------------------------------- the harness's algorithm interface
    def batch(self, state: TrainState, k: int) -> tuple[GRPOBatch, dict[str, float]]:
        """Iteration ``k``'s rollouts from the current policy, scored and prepared."""
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), k)
        exp = self.collector(state.params, k, rng)
        rows, prep = self.prepare(state, exp)
        return GRPOBatch(rows=rows, iteration=k, samples=exp.samples), {**exp.metrics, **prep}

    def step(self, state: TrainState, batch: GRPOBatch) -> tuple[TrainState, dict[str, Any]]:
        return self.update(state, batch.rows, batch.iteration)

    def tokens(self, batch: GRPOBatch) -> float:
        """Policy tokens over the iteration's ``mu`` epochs."""
        return float(batch.rows["loss_mask"].sum()) * self.a.mu

    def evaluate(self, state: TrainState, k: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out greedy accuracy (single-turn sources with a verifier; nothing otherwise)."""
        if self._verify is None or not self._examples:
            return {}, []
        acc = task_accuracy(
            nnx.merge(self.graphdef, state.params), self._examples, self._verify, tokenizer=self.tokenizer,
            max_new_tokens=self.a.max_new_tokens, batch_size=min(64, len(self._examples)),
        )
        return {"accuracy": acc.accuracy}, acc.samples

    def data_state(self) -> dict[str, Any]:
        # collectors with state of their own (PrefixRL's current cuts)
        return {"collector": self.collector.state_dict()} if hasattr(self.collector, "state_dict") else {}

    def load_data_state(self, data_state: dict[str, Any]) -> None:
        if "collector" in data_state:
            self.collector.load_state_dict(data_state["collector"])

    def final_model(self, state: TrainState):
        model = nnx.merge(self.graphdef, state.params)
        model.tokenizer = self.tokenizer
        return model


@ALGORITHMS.register("grpo")
def grpo(setup: RunSetup) -> GRPOTrainer:
    return GRPOTrainer(setup.cfg, setup.model, setup.tokenizer, mesh=setup.mesh)
