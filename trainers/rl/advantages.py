"""Advantage estimators: rewards of G rollouts per prompt -> advantages (``ADVANTAGES``).

Outcome estimators take ``rewards [B, G]`` (and ``valid [B, G]``: rollouts that count;
invalid ones get advantage 0 and do not enter the baseline):

- ``grpo``: ``(r - mean_g) / (std_g + eps)`` with the Bessel-corrected group std
  (Shao et al. 2024, DeepSeekMath eq. 3; TRL/verl/Tunix all use ddof=1).
- ``dr_grpo``: ``r - mean_g`` (Liu et al. 2025, "Understanding R1-Zero-like training").
- ``rloo``: ``r - mean of the other G-1`` = ``G/(G-1) (r - mean_g)`` (Ahmadian et al. 2024).

The turn-level estimator (MemoPilot, B.3) takes ``rewards [B, G, K]`` per turn with
``valid [B, G, K]`` (turns an episode reached): ``A[g, k]`` is the z-score of ``R[g, k]``
among the rollouts of the same group that reached turn ``k``: the baseline pools turn
index ``k`` across rollouts whatever their histories ("context-independent"). Turns that
only one rollout reached get advantage 0 (no baseline), as do padded turns. With
``gamma`` the per-turn reward is first turned into the return-to-go
``R[k] = sum_{k' >= k} gamma^(k'-k) r[k']`` within each episode.

A NaN reward means "no opinion" (as in `trainers.rl.rewards`): that rollout (or turn) is not
counted, as if ``valid`` were False there (it made the whole group's GRPO advantages 0, or
NaN for the other estimators). An infinite reward is an error (under ``jit``, where values
cannot be checked, it is not counted either).

Every estimator first subtracts one counted reward of the group (the first) from all of
them. The advantages are unchanged in exact arithmetic (each is a function of differences),
but a group whose counted rewards are all equal then gets exactly 0: float32 sums of
non-dyadic values such as 0.7 are off by an ulp, and ``(r - mean) / (std + eps)`` would turn
that ulp into an advantage of a few percent shared by the whole group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")


def _centred(rewards, valid, axis):
    """``rewards`` minus the group's first counted reward along ``axis`` (exact zeros for a
    constant group; groups with nothing counted are shifted by an arbitrary member)."""
    first = jnp.argmax(valid, axis=axis, keepdims=True)
    return rewards - jnp.take_along_axis(rewards, first, axis=axis)


def _group_stats(rewards, valid, axis):
    """Count, mean and Bessel-corrected std of the counted rewards (already `_centred`)."""
    n = valid.sum(axis=axis, keepdims=True).astype(jnp.float32)
    r = jnp.where(valid, rewards, 0.0)
    mean = r.sum(axis=axis, keepdims=True) / jnp.maximum(n, 1.0)
    var = jnp.where(valid, (rewards - mean) ** 2, 0.0).sum(axis=axis, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    return n, mean, jnp.sqrt(var)


def _scaled(centred, std, eps):
    """``centred / (std + eps)``; 0 where ``std + eps`` is 0 (a constant group at eps = 0,
    whose centred rewards are exact zeros: 0, not 0/0 = NaN)."""
    denom = std + eps
    return jnp.where(denom > 0, centred / jnp.where(denom > 0, denom, 1.0), 0.0)


def _check(rewards, valid):
    rewards = jnp.asarray(rewards, jnp.float32)
    valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid, bool)
    if rewards.ndim < 2:
        raise ValueError(f"rewards must be [B, G] (prompts x rollouts), got shape {rewards.shape}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G={rewards.shape[1]} is invalid: a group baseline needs G >= 2")
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {valid.shape}; it must match rewards {rewards.shape}")
    if not isinstance(rewards, jax.core.Tracer):
        infinite = np.argwhere(np.isinf(np.asarray(rewards)) & np.asarray(valid))
        if infinite.size:
            raise ValueError(f"reward {list(map(int, infinite[0]))} is {float(rewards[tuple(infinite[0])])}: rewards "
                             f"must be finite (NaN: no opinion, not counted); {len(infinite)} infinite in all")
    finite = jnp.isfinite(rewards)
    return jnp.where(finite, rewards, 0.0), valid & finite


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards, valid=None, *, eps: float = 1e-6, **_) -> jax.Array:
    rewards, valid = _check(rewards, valid)
    rewards = _centred(rewards, valid, axis=1)
    n, mean, std = _group_stats(rewards, valid, axis=1)
    adv = _scaled(rewards - mean, std, eps)
    return jnp.where(valid & (n > 1), adv, 0.0)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards, valid=None, **_) -> jax.Array:
    rewards, valid = _check(rewards, valid)
    rewards = _centred(rewards, valid, axis=1)
    n, mean, _ = _group_stats(rewards, valid, axis=1)
    return jnp.where(valid & (n > 1), rewards - mean, 0.0)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards, valid=None, **_) -> jax.Array:
    rewards, valid = _check(rewards, valid)
    rewards = _centred(rewards, valid, axis=1)
    n = valid.sum(axis=1, keepdims=True).astype(jnp.float32)
    total = jnp.where(valid, rewards, 0.0).sum(axis=1, keepdims=True)
    others = (total - rewards) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(valid & (n > 1), rewards - others, 0.0)


def returns_to_go(rewards, valid, gamma: float) -> jax.Array:
    """``R[k] = sum_{k' >= k, valid} gamma^(k'-k) r[k']`` along the last axis."""
    r = jnp.where(valid, rewards, 0.0)

    def back(carry, x):
        carry = x + gamma * carry
        return carry, carry

    _, out = jax.lax.scan(back, jnp.zeros(r.shape[:-1]), jnp.moveaxis(r, -1, 0), reverse=True)
    return jnp.moveaxis(out, 0, -1)


@ADVANTAGES.register("turn_level")
def turn_level_advantages(rewards, valid=None, *, eps: float = 1e-6, gamma: float | None = None,
                          scale: bool = True, **_) -> jax.Array:
    rewards, valid = _check(rewards, valid)
    if rewards.ndim != 3:
        raise ValueError(f"turn_level advantages need rewards [B, G, K turns], got shape {rewards.shape}")
    if gamma is not None:
        rewards = returns_to_go(rewards, valid, gamma)
    rewards = _centred(rewards, valid, axis=1)
    n, mean, std = _group_stats(rewards, valid, axis=1)  # pooled over rollouts, per turn index
    adv = rewards - mean
    if scale:
        adv = _scaled(adv, std, eps)
    return jnp.where(valid & (n > 1), adv, 0.0)
