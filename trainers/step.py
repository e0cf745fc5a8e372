"""The pure training step: ``step(state, batch) -> (state, metrics)``.

Gradient accumulation is exact: each micro-batch contributes the gradient of its loss
*sum* and its token count; the step divides once by the total count, so two micro-batches
of unequal token counts give the gradient of the whole batch's token mean. A non-finite
loss or gradient norm leaves the state unchanged and reports ``finite=False``.
"""

from __future__ import annotations

from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxlm.models.logprobs import token_logprobs, unembedding
from jaxlm.models.masks import segment_mask
from trainers.losses import (
    next_token_targets,
    sem_entropy_sum,
    sft_loss_sum,
    token_nll,
    uniform_weights,
)
from trainers.optim import apply_if_finite

Batch = dict[str, jax.Array]


@struct.dataclass
class TrainState:
    params: Any  # nested dict of arrays (nnx.to_pure_dict of the model's Params)
    opt_state: Any
    step: jax.Array  # [] int32: optimizer steps taken
    rng: jax.Array


def init_state(params, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """The step-0 state, every leaf committed: the optimizer's parameter-shaped trees (Adam's
    moments) placed like the parameters (`optax.tree_map_params`), its other leaves and the
    step counter replicated over the parameters' mesh (or on their device). An uncommitted
    leaf would make the second step's inputs differ from the first's and compile the update
    again (`StateShardedJit`)."""
    placed = jax.tree.map(lambda x: jnp.asarray(x).sharding, params)
    mesh = next((sh.mesh for sh in jax.tree.leaves(placed) if isinstance(sh, NamedSharding)), None)
    home = NamedSharding(mesh, PartitionSpec()) if mesh is not None else (jax.tree.leaves(placed) or [None])[0]
    shapes = jax.eval_shape(tx.init, params)
    try:
        opt_shardings = optax.tree_map_params(tx, lambda _, sh: sh, shapes, placed,
                                              transform_non_params=lambda _: home)
    except (TypeError, ValueError, AttributeError):  # an init that cannot run on optax's placeholder
        opt_shardings = jax.tree.map(lambda _: home, shapes)
    state = TrainState(
        params=params, opt_state=jax.jit(tx.init, out_shardings=opt_shardings)(params),
        step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(jax.random.key(seed)),
    )

    def commit(x):
        x = jnp.asarray(x)
        if home is not None and x.sharding.device_set != home.device_set:
            return jax.device_put(x, home)
        return jax.device_put(x, x.sharding)

    return jax.tree.map(commit, state)


class StateShardedJit:
    """``jax.jit`` of a step ``(state, batch) -> (state, metrics)`` whose new state keeps the
    shardings of the state it was given (``out_shardings``), one compilation per input layout.

    Without it the outputs take the shardings XLA's propagation picks, spelled differently
    from how the state was placed (``P()`` vs ``P(None,)`` for a replicated vector, a
    ``NamedSharding`` vs a ``SingleDeviceSharding`` for the optimizer state): the second step
    misses the compilation cache and compiles the whole update again."""

    def __init__(self, step: Callable, *, donate: bool = True):
        self.step, self.donate = step, donate
        self._jitted: dict = {}

    def __call__(self, state, batch):
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), state)  # None: a host value
        key = (jax.tree.structure(shardings), tuple(jax.tree.leaves(shardings)))
        fn = self._jitted.get(key)
        if fn is None:
            fn = self._jitted[key] = jax.jit(
                self.step, donate_argnums=(0,) if self.donate else (), out_shardings=(shardings, None)
            )
        return fn(state, batch)


def forward(graphdef, params, batch: Batch, *, sliding_window: int | None, collect=(), head: bool = True):
    """The model on a training batch: packed rows get a block-diagonal causal mask; a batch may
    instead carry its own ``attn_mask [B, T, T]`` (graph layouts), 2-D ``positions``, and a
    ``condition`` (+ ``condition_mask``) for MeGan models. ``head=False``: the backbone only
    (``logits`` None), for chunked log-probs."""
    chex.assert_rank(batch["tokens"], 2)
    model = nnx.merge(graphdef, params)
    if "attn_mask" in batch:
        mask = batch["attn_mask"][:, None]
    else:
        mask = segment_mask(batch["segment_ids"], sliding_window=sliding_window)
    condition = None
    if "condition" in batch:
        condition = (batch["condition"], batch.get("condition_mask", batch["condition"] > 0))
    call = model if head else model.backbone
    return call(batch["tokens"], batch["positions"], mask=mask, condition=condition, collect=collect)


#: Float32 ``[B, T, V]`` logits above this many bytes make the SFT loss chunk its LM head
#: (`make_loss_fn`): below it the whole-logits path is as fast or faster on CPU; above it the
#: logits and their gradient dominate the step's memory (Qwen3-0.6B shape, 32 x 256 tokens, one
#: device: XLA's temporaries 18.1 GiB whole, 6.0 GiB chunked; docs/benchmarks.md).
CHUNKED_LOSS_BYTES = 2**30


def make_loss_fn(graphdef, *, sliding_window: int | None, weight_fn: Callable = uniform_weights, beta_l1: float = 0.0,
                 sem_lambda: float = 0.0, sem_threshold: float = 0.25):
    """``loss(params, batch) -> (loss_sum, token_count)`` for next-token SFT.

    ``beta_l1 > 0`` adds MeGan's regulariser ``beta_l1 * sum |beta|`` over real tokens (summed
    over layers and channels) to the loss sum, i.e. its per-token mean to the loss.
    ``sem_lambda > 0`` adds selective entropy minimisation (ReQAT):
    ``sem_lambda * sum_t w_t H_t`` (`trainers.losses.sem_entropy_sum`). With uniform weights,
    no SEM and float32 ``[B, T, V]`` logits above `CHUNKED_LOSS_BYTES`, the NLL goes through
    the LM head in chunks (`jaxlm.models.logprobs`): the logits never exist whole."""

    def loss_fn(params, batch: Batch):
        collect = ("mlp_beta",) if beta_l1 else ()
        model = nnx.merge(graphdef, params)
        logits_bytes = 4 * batch["tokens"].size * model.config.vocab_size
        if weight_fn is uniform_weights and not sem_lambda and logits_bytes > CHUNKED_LOSS_BYTES:
            out = forward(graphdef, params, batch, sliding_window=sliding_window, collect=collect, head=False)
            targets, valid = next_token_targets(batch)
            logp = token_logprobs(out.hidden, unembedding(model), targets)
            total, count = -jnp.sum(jnp.where(valid, logp, 0.0)), valid.sum(dtype=jnp.float32)
        else:
            out = forward(graphdef, params, batch, sliding_window=sliding_window, collect=collect)
            total, count = sft_loss_sum(out.logits, batch, weight_fn)
        if sem_lambda:
            total = total + sem_lambda * sem_entropy_sum(out.logits, batch, sem_threshold)
        if beta_l1 and "mlp_beta" in out.collected:
            real = (batch["segment_ids"] > 0)[None, :, :, None]
            total = total + beta_l1 * jnp.sum(jnp.where(real, jnp.abs(out.collected["mlp_beta"]), 0.0))
        return total, count

    return loss_fn


def apply_summed_gradients(state: TrainState, tx: optax.GradientTransformation, g_sum, loss_sum, count):
    """Divide the summed gradient and loss by the summed count once, apply the optimizer, and
    keep the old state if the loss or the gradient norm is not finite:
    ``(new_state, loss, grad_norm, finite)``."""
    # the count may be a sum of weights below 1 (PEAR's self-normalised weights): only an
    # empty batch (count 0) is guarded
    denom = jnp.where(count > 0, count, 1.0)
    inv = 1.0 / denom
    # a product with the reciprocal, not a quotient, and the norm of the sum scaled after the
    # reduction: XLA fuses the product into each reader of the gradient (the moments) instead
    # of writing the divided gradient out first (XLA:CPU's reductions read materialised arrays)
    grads = jax.tree.map(lambda g, p: (g * inv).astype(p.dtype), g_sum, state.params)
    loss = loss_sum / denom
    grad_norm = optax.tree.norm(g_sum) * inv
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state = apply_if_finite(tx, grads, grad_norm, finite, state.opt_state, state.params)
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new = TrainState(params=params, opt_state=opt_state, step=jnp.where(finite, state.step + 1, state.step),
                     rng=jnp.where(finite, rng, state.rng))
    return new, loss, grad_norm, finite


def make_train_step(
    graphdef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    grad_accum: int = 1,
    sliding_window: int | None = None,
    weight_fn: Callable = uniform_weights,
    beta_l1: float = 0.0,
    sem_lambda: float = 0.0,
    sem_threshold: float = 0.25,
    loss_fn: Callable | None = None,
    donate: bool = True,
):
    """A jitted ``step(state, batch) -> (state, metrics)``; the batch's leading axis is split
    into ``grad_accum`` micro-batches.

    ``loss_fn`` replaces the SFT loss (`make_loss_fn`): ``loss_fn(params, micro_batch, side)``
    with the step called as ``step(state, (batch, side))``, ``side`` (e.g. a frozen teacher's
    parameters) handed unsplit to every micro-batch. It returns ``(sum, count)`` or
    ``(sum, (count, sums))``: ``sums`` are summed over the micro-batches and reported as
    metrics, ``sums["tokens"]`` as is and the others divided by it (per-token means)."""
    side_input = loss_fn is not None
    if loss_fn is None:
        loss_fn = make_loss_fn(graphdef, sliding_window=sliding_window, weight_fn=weight_fn, beta_l1=beta_l1,
                               sem_lambda=sem_lambda, sem_threshold=sem_threshold)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, inputs):
        batch, side = inputs if side_input else (inputs, None)
        args = (side,) if side_input else ()
        B = batch["tokens"].shape[0]
        # micro-batch i = rows i, i + A, i + 2A, ...: a batch sharded over its leading axis
        # keeps every device's rows in place (no resharding for the accumulation loop)
        micro = jax.tree.map(
            lambda x: x.reshape(B // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch
        )

        def split_aux(aux):
            return aux if isinstance(aux, tuple) else (aux, {})

        def accumulate(carry, mb):
            g_sum, loss_sum, count, sums = carry
            (loss, aux), g = grad_fn(state.params, mb, *args)
            n, s = split_aux(aux)
            return (jax.tree.map(jnp.add, g_sum, g), loss_sum + loss, count + n, jax.tree.map(jnp.add, sums, s)), None

        if grad_accum == 1:  # no loop: lets XLA fuse the gradient into the update
            (loss_sum, aux), g_sum = grad_fn(state.params, batch, *args)
            count, sums = split_aux(aux)
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            first = jax.tree.map(lambda x: x[0], micro)
            sums0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                 split_aux(jax.eval_shape(grad_fn, state.params, first, *args)[0][1])[1])
            init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), sums0)
            (g_sum, loss_sum, count, sums), _ = jax.lax.scan(accumulate, init, micro)
        new, loss, grad_norm, finite = apply_summed_gradients(state, tx, g_sum, loss_sum, count)
        metrics = {
            "loss": loss, "grad_norm": grad_norm, "tokens": count, "lr": schedule(state.step),
            "finite": finite,
        }
        if sums:
            tokens = sums.get("tokens", count)
            metrics["tokens"] = tokens
            metrics.update({k: v / jnp.maximum(tokens, 1.0) for k, v in sums.items() if k != "tokens"})
        return new, metrics

    return StateShardedJit(step, donate=donate)


def make_eval_loss(graphdef, *, sliding_window: int | None = None, attention_stats: bool = False):
    """A jitted ``(params, batch) -> sums`` for held-out evaluation: ``loss`` (NLL sum),
    ``tokens``, ``exact`` (rows whose every trained target is the argmax: greedy exact match
    under teacher forcing), ``rows``; with ``attention_stats``, the attention entropy summed
    over real query rows (``entropy``, ``queries``) and the mass on each row's first token
    (``first_mass``)."""
    def eval_fn(params, batch: Batch):
        collect = ("attn_probs",) if attention_stats else ()
        out = forward(graphdef, params, batch, sliding_window=sliding_window, collect=collect)
        targets, valid = next_token_targets(batch)
        nll = jnp.where(valid, token_nll(out.logits, targets), 0.0)
        correct = (jnp.argmax(out.logits, -1) == targets) | ~valid
        has_target = valid.any(-1)
        sums = {
            "loss": nll.sum(), "tokens": valid.sum(dtype=jnp.float32),
            "exact": jnp.sum(correct.all(-1) & has_target, dtype=jnp.float32),
            "rows": has_target.sum(dtype=jnp.float32),
        }
        if attention_stats:
            p = out.collected["attn_probs"].astype(jnp.float32)  # [L, B, N, T, S]
            ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), -1)
            real = (batch["segment_ids"] > 0)[None, :, None, :]
            sums["entropy"] = jnp.sum(jnp.where(real, ent, 0.0))
            sums["first_mass"] = jnp.sum(jnp.where(real, p[..., 0], 0.0))
            sums["queries"] = jnp.sum(jnp.broadcast_to(real, ent.shape), dtype=jnp.float32)
        return sums

    return jax.jit(eval_fn)
