"""The GRPO update: ``step(state, batch) -> (state, metrics)``, jitted with donation.

The batch is a minibatch of rollout rows (`trainers.rl.rollout`) plus ``old_logp``,
``advantages`` (per token), ``weights`` (per row, from the buffer sampler) and, with a KL
term, ``ref_logp``. The per-token loss is ``w_row * tis_t * policy_loss_t + beta * KL_t``
on policy tokens; the aggregator turns it into ``(sum, count)`` per micro-batch; sums and
counts are added over the ``grad_accum`` micro-batches and divided once, so the update is
the same however the minibatch is split (tested for ``token_mean`` with unequal lengths).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from trainers.rl.aggregation import AGGREGATORS
from trainers.rl.kl import KL_ESTIMATORS
from trainers.rl.policy_losses import POLICY_LOSSES
from trainers.rl.rollout import row_logprobs
from trainers.step import StateShardedJit, TrainState, apply_summed_gradients


def make_rl_loss(graphdef, cfg, *, completion_norm: float):
    """``loss(params, batch) -> (loss_sum, (count, stats))`` for one micro-batch."""
    policy_loss = POLICY_LOSSES[cfg.policy_loss]
    aggregate = AGGREGATORS[cfg.aggregation]
    kl_fn = KL_ESTIMATORS[cfg.kl_estimator]

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        logp = row_logprobs(model, batch, chunk=cfg.logprob_chunk)
        mask = batch["loss_mask"]
        tok, stats = policy_loss(
            logp, batch["old_logp"], batch["advantages"], mask,
            eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
        )
        weight = batch["weights"][:, None]
        if cfg.tis_cap is not None:  # truncated IS between the trainer's old policy and the sampler
            ratio = jnp.exp(jnp.clip(batch["old_logp"] - batch["sampler_logp"], -20.0, 20.0))
            weight = weight * jnp.minimum(ratio, cfg.tis_cap)
        tok = tok * jax.lax.stop_gradient(weight)
        m = mask.astype(jnp.float32)
        kl = jnp.where(mask, kl_fn(logp, batch["ref_logp"]), 0.0) if cfg.beta else jnp.zeros_like(tok)
        total, count = aggregate(tok + cfg.beta * kl, mask, norm=completion_norm)
        stats = {**stats, "kl_sum": jnp.sum(jax.lax.stop_gradient(kl) * m), "policy_tokens": jnp.sum(m)}
        return total, (count, stats)

    return loss_fn


def make_rl_step(graphdef, tx: optax.GradientTransformation, schedule, cfg, *, grad_accum: int = 1,
                 completion_norm: float, donate: bool = True):
    """A jitted ``step(state, minibatch) -> (state, metrics)``."""
    grad_fn = jax.value_and_grad(make_rl_loss(graphdef, cfg, completion_norm=completion_norm), has_aux=True)

    def step(state: TrainState, batch):
        if grad_accum == 1:
            (loss_sum, (count, stats)), g_sum = grad_fn(state.params, batch)
        else:
            R = batch["tokens"].shape[0]
            per_row = {k: v for k, v in batch.items() if k != "prompts"}  # prompts go to every micro-batch
            micro = jax.tree.map(lambda x: x.reshape(R // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), per_row)

            def accumulate(carry, mb):
                g_acc, l_acc, c_acc, s_acc = carry
                if "prompts" in batch:
                    mb = {**mb, "prompts": batch["prompts"]}
                (loss, (n, st)), g = grad_fn(state.params, mb)
                return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss, c_acc + n,
                        jax.tree.map(jnp.add, s_acc, st)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            z = jnp.zeros((), jnp.float32)
            stat0 = {"clipped_tokens": z, "ratio_sum": z, "kl_sum": z, "policy_tokens": z}
            (g_sum, loss_sum, count, stats), _ = jax.lax.scan(accumulate, (zeros, z, z, stat0), micro)
        new, loss, grad_norm, finite = apply_summed_gradients(state, tx, g_sum, loss_sum, count)
        tokens = jnp.maximum(stats["policy_tokens"], 1.0)
        metrics = {
            "loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "finite": finite,
            "clip_frac": stats["clipped_tokens"] / tokens, "ratio_mean": stats["ratio_sum"] / tokens,
            "kl": stats["kl_sum"] / tokens, "policy_tokens": stats["policy_tokens"],
        }
        return new, metrics

    return StateShardedJit(step, donate=donate)
