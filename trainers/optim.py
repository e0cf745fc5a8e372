"""The optimizer from an `OptimizerConfig`: optax AdamW, warmup + cosine, clipping."""

from __future__ import annotations

import re
from typing import Any

import jax
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


def make_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with decoupled weight decay on matrices only (not norms, biases, nor the RoPE
    frequency buffers of compressed models or the Q-FIT key shift, whose gradient the forward
    stops unless ``k_shift_trainable``); parameters not matching ``cfg.trainable`` (when set)
    are frozen."""
    schedule = learning_rate_schedule(cfg, total_steps)
    decay_mask = lambda params: jax.tree.map(
        lambda p, name: p.ndim >= 2 and not name.endswith(("rope_inv_freq", "k_shift")), params, param_names(params)
    )
    adamw = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm is not None else []
    tx = optax.chain(*chain, adamw)
    if cfg.trainable:
        pattern = re.compile(cfg.trainable)
        labels = lambda params: jax.tree.map(
            lambda name: "train" if pattern.search(name) else "freeze", param_names(params)
        )
        tx = optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
    return tx, schedule
