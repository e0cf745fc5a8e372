"""Per-token policy-gradient surrogates (``POLICY_LOSSES``): ``(logp, old_logp, adv, mask,
cfg) -> (loss [B, T], stats)``; aggregation over tokens happens in `aggregation`.

- ``ppo_clip``: ``max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))`` with
  ``rho = exp(logp - old_logp)`` (log-ratio clamped to +-20 as verl/Tunix do); separate
  ``eps_low``/``eps_high`` (DAPO's clip-higher, Yu et al. 2025); optional dual clip
  ``min(., -A c)`` for ``A < 0`` (Ye et al. 2020).
- ``gspo``: the sequence-level ratio ``s_i = exp(mean_t (logp - old_logp))`` of GSPO
  (Zheng et al. 2025, eq. 7), in its token form ``logp - sg(logp) + sg(log s_i)`` so the
  value is sequence-level and the gradient per token; then the same clipping (GSPO uses
  eps ~ 3e-4 / 4e-4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")


def _clipped(log_ratio, adv, mask, eps_low, eps_high, dual_clip):
    """``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` (and dual-clip's ``min(., -A c)`` for
    ``A < 0``), each branch chosen explicitly: the clipped branch is a constant where it wins,
    and a tie (``r`` on a bound, e.g. on-policy ``r = 1`` with ``eps_low = 0``) takes the
    unclipped gradient. Differentiating ``jnp.clip`` / ``jnp.maximum`` splits a tie's gradient
    in half (0.75x the policy gradient there); PyTorch's clamp passes it whole."""
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    loss = jnp.where(clipped > unclipped, clipped, unclipped)
    if dual_clip is not None:
        floor = -adv * dual_clip
        loss = jnp.where((adv < 0) & (loss > floor), floor, loss)
    m = mask.astype(jnp.float32)
    clip_frac = jnp.sum(jnp.where(clipped > unclipped, m, 0.0))
    stats = {"clipped_tokens": clip_frac, "ratio_sum": jnp.sum(ratio * m)}
    return jnp.where(mask, loss, 0.0), stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logp, old_logp, adv, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=None, **_):
    log_ratio = jnp.clip(logp - old_logp, -20.0, 20.0)
    return _clipped(log_ratio, adv, mask, eps_low, eps_high, dual_clip)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logp, old_logp, adv, mask, *, eps_low=3e-4, eps_high=4e-4, dual_clip=None, **_):
    m = mask.astype(jnp.float32)
    seq = jnp.sum((logp - old_logp) * m, -1, keepdims=True) / jnp.maximum(m.sum(-1, keepdims=True), 1.0)
    seq = jnp.minimum(jax.lax.stop_gradient(seq), 10.0)
    log_ratio = logp - jax.lax.stop_gradient(logp) + seq
    return _clipped(log_ratio, adv, mask, eps_low, eps_high, dual_clip)
