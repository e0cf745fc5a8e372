"""The optimizer from an `OptimizerConfig`: optax AdamW, warmup + cosine, clipping.

`apply_if_finite` applies a transformation's update unless the step is not finite. For the
clipped AdamW that `make_optimizer` builds (`ClippedAdamW`) it computes optax's update in an
order that lets XLA write each new moment and parameter in one elementwise pass, in place
(`_adamw_apply_if_finite`; equal to the optax chain to rounding, tested).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
    if cfg.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1)), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.min_lr_ratio,
    )


def param_names(params) -> Any:
    """A pytree like ``params`` holding each leaf's dotted name (``layers.0.mlp.up_proj.kernel``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path), params
    )


@dataclasses.dataclass(frozen=True)
class AdamWSpec:
    """The hyperparameters of ``chain(clip_by_global_norm(clip_norm), adamw(...))``."""

    schedule: Callable
    b1: float
    b2: float
    eps: float
    weight_decay: float
    decay_mask: Callable  # params -> tree of bools
    clip_norm: float | None
    eps_root: float = 0.0


class ClippedAdamW(optax.GradientTransformation):
    """``optax.chain(clip_by_global_norm, adamw)`` (`clipped_adamw`): ``init`` and ``update``
    are optax's, so the state (and checkpoints) are the chain's; its ``spec`` lets
    `apply_if_finite` run the update in place."""

    spec: AdamWSpec | None


def clipped_adamw(spec: AdamWSpec) -> ClippedAdamW:
    """The `ClippedAdamW` of ``spec``."""
    adamw = optax.adamw(spec.schedule, b1=spec.b1, b2=spec.b2, eps=spec.eps, eps_root=spec.eps_root,
                        weight_decay=spec.weight_decay, mask=spec.decay_mask)
    clip = [optax.clip_by_global_norm(spec.clip_norm)] if spec.clip_norm is not None else []
    chain = optax.chain(*clip, adamw)
    tx = ClippedAdamW(chain.init, chain.update)
    tx.spec = spec
    return tx


def _where(finite, new, old):
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _is_adam_or_schedule(node) -> bool:
    return isinstance(node, (optax.ScaleByAdamState, optax.ScaleByScheduleState))


def _adamw_apply_if_finite(spec: AdamWSpec, grads, grad_norm, finite, opt_state, params):
    """`ClippedAdamW`'s update and ``apply_updates``, kept only where ``finite``: optax's
    ``clip_by_global_norm`` (Pascanu et al. 2013; here one scalar factor, ``clip / norm``,
    instead of a per-element quotient), ``scale_by_adam`` (Kingma & Ba 2015, Alg. 1), masked
    ``add_decayed_weights`` (Loshchilov & Hutter 2019, Alg. 2) and ``scale_by_learning_rate``,
    with optax's own moment and bias-correction functions. The new moments are selected and
    materialised first (``optimization_barrier``) and the parameters read them, so each of
    ``mu``, ``nu`` and the parameters is one in-place pass; from optax's graph XLA fuses the
    moment update into each consumer, re-reading the old moments and copying them to write
    in place. ``grad_norm`` is the global norm of ``grads`` (what the clip computes)."""
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=_is_adam_or_schedule) if _is_adam_or_schedule(n)]
    (adam,) = [n for n in nodes if isinstance(n, optax.ScaleByAdamState)]
    (sched,) = [n for n in nodes if isinstance(n, optax.ScaleByScheduleState)]
    if spec.clip_norm is not None:  # one scalar factor: a quotient per element would be written out
        scale = jnp.where(jnp.squeeze(grad_norm < spec.clip_norm), 1.0, spec.clip_norm / grad_norm)
        grads = jax.tree.map(lambda t: t * scale.astype(t.dtype), grads)
    mu = optax.tree.cast_like(optax.tree.update_moment(grads, adam.mu, spec.b1, 1), adam.mu)
    nu = optax.tree.cast_like(optax.tree.update_moment_per_elem_norm(grads, adam.nu, spec.b2, 2), adam.nu)
    mu, nu = jax.lax.optimization_barrier((_where(finite, mu, adam.mu), _where(finite, nu, adam.nu)))
    count_inc = optax.safe_increment(adam.count)
    mu_hat = optax.tree.bias_correction(mu, spec.b1, count_inc)
    nu_hat = optax.tree.bias_correction(nu, spec.b2, count_inc)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + spec.eps_root) + spec.eps), mu_hat, nu_hat)
    if not (isinstance(spec.weight_decay, (int, float)) and spec.weight_decay == 0.0):  # optax skips a 0.0
        mask = spec.decay_mask(updates)
        updates = jax.tree.map(lambda u, p, m: u + spec.weight_decay * p if m else u, updates, params, mask)
    step_size = -1 * spec.schedule(sched.count)
    updates = jax.tree.map(lambda u: jnp.array(step_size, dtype=u.dtype) * u, updates)
    new_params = _where(finite, optax.apply_updates(params, updates), params)

    def replace(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=jnp.where(finite, count_inc, node.count), mu=mu, nu=nu)
        if isinstance(node, optax.ScaleByScheduleState):
            return node._replace(count=jnp.where(finite, optax.safe_increment(node.count), node.count))
        return node

    return new_params, jax.tree.map(replace, opt_state, is_leaf=_is_adam_or_schedule)


def apply_if_finite(tx: optax.GradientTransformation, grads, grad_norm, finite, opt_state, params):
    """``(params, opt_state)`` after ``tx``'s update and ``optax.apply_updates``, or the old
    ones where ``finite`` is False. ``grad_norm`` is ``optax.tree.norm(grads)``."""
    spec = getattr(tx, "spec", None) if isinstance(tx, ClippedAdamW) else None
    if spec is not None:
        return _adamw_apply_if_finite(spec, grads, grad_norm, finite, opt_state, params)
    updates, new_state = tx.update(grads, opt_state, params)
    return _where(finite, optax.apply_updates(params, updates), params), _where(finite, new_state, opt_state)


def decay_mask(params) -> Any:
    """Weight decay on matrices only (not norms, biases, nor the RoPE frequency buffers of
    compressed models or the Q-FIT key shift, whose gradient the forward stops unless
    ``k_shift_trainable``)."""
    def matrix(p, name: str) -> bool:
        parts = name.split(".")
        # scan_layers: "layers.<param>" is [L, ...], at the top or under a prefix ("lm.layers..." in omni models)
        stacked = any(a == "layers" and not b.isdigit() for a, b in zip(parts, parts[1:]))
        return p.ndim - stacked >= 2 and not name.endswith(("rope_inv_freq", "k_shift"))

    return jax.tree.map(matrix, params, param_names(params))


def make_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with decoupled weight decay on matrices only (`decay_mask`) and global-norm
    clipping (`ClippedAdamW`); parameters not matching ``cfg.trainable`` (when set) are
    frozen."""
    schedule = learning_rate_schedule(cfg, total_steps)
    tx = clipped_adamw(AdamWSpec(schedule=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, decay_mask=decay_mask, clip_norm=cfg.clip_norm))
    if cfg.trainable:
        pattern = re.compile(cfg.trainable)
        labels = lambda params: jax.tree.map(
            lambda name: "train" if pattern.search(name) else "freeze", param_names(params)
        )
        tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
    return tx, schedule
