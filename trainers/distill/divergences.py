"""Divergences between a teacher distribution ``p`` and a student distribution ``q``, given
as log-probabilities along the last axis (``[..., V]`` full vocabularies, or ``[..., K + 1]``
teacher top-K bins plus one tail bucket, `bucketed`). Each returns ``[...]``; zero-probability
bins contribute nothing (``0 log 0 = 0``).

``DIVERGENCES`` maps a config string to ``div(p_logp, q_logp, *, jsd_beta, top_k, tail_beta)``:

* ``forward_kl``  ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` (Hinton et al. 2015);
* ``reverse_kl``  ``KL(q || p)`` (mode-seeking, as in MiniLLM);
* ``jsd``         generalized Jensen-Shannon, ``beta KL(p || m) + (1 - beta) KL(q || m)`` with
  ``m = beta p + (1 - beta) q`` (GKD, Agarwal et al. 2024; ``beta = 1/2`` is the JSD);
* ``tail_aware``  "Don't Ignore the Tail" (Dasgupta et al. 2026): with ``H`` the teacher's
  top-K tokens and ``T`` the rest, ``KL`` over the ``K + 1`` bins (``H`` and one bucket of
  mass ``p_T``) ``+ beta KL(p_T~ || q_T~)`` over the renormalised tails. Since
  ``KL(p || q) = KL_{K+1} + p_T KL(p_T~ || q_T~)`` exactly, ``beta = p_T`` gives plain KL and
  ``K = 0`` gives ``beta KL``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.registry import Registry

DIVERGENCES: Registry = Registry("distillation divergence")


def _kl(p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
    """``sum p (log p - log q)`` over the last axis; bins with ``p = 0`` count 0 (even where
    ``q = 0``; their gradient is 0 too, not NaN), a bin with ``p > 0 = q`` makes it ``inf``."""
    p = jnp.exp(p_logp)
    has = p > 0
    safe_p_logp = jnp.where(has, p_logp, 0.0)
    term = jnp.where(has, p * (safe_p_logp - jnp.where(has, q_logp, 0.0)), 0.0)
    return jnp.sum(term, axis=-1)


@DIVERGENCES.register("forward_kl")
def forward_kl(p_logp, q_logp, **_) -> jax.Array:
    """``KL(p || q)``: mass-covering, the classic distillation loss."""
    return _kl(p_logp, q_logp)


@DIVERGENCES.register("reverse_kl")
def reverse_kl(p_logp, q_logp, **_) -> jax.Array:
    """``KL(q || p)``: mode-seeking."""
    return _kl(q_logp, p_logp)


@DIVERGENCES.register("jsd")
def generalized_jsd(p_logp, q_logp, *, jsd_beta: float = 0.5, **_) -> jax.Array:
    """``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``, ``0 < beta < 1``."""
    neither = jnp.isneginf(p_logp) & jnp.isneginf(q_logp)  # a bin empty on both sides (its gradient: 0, not NaN)
    m_logp = jnp.logaddexp(jnp.where(neither, 0.0, p_logp + jnp.log(jsd_beta)),
                           jnp.where(neither, 0.0, q_logp + jnp.log1p(-jsd_beta)))
    m_logp = jnp.where(neither, -jnp.inf, m_logp)
    return jsd_beta * _kl(p_logp, m_logp) + (1.0 - jsd_beta) * _kl(q_logp, m_logp)


def index_mask(shape: tuple[int, ...], idx: jax.Array) -> jax.Array:
    """``shape = (..., V)`` bool, True at the vocabulary indices ``idx [..., K]`` (a scatter:
    no ``[..., K, V]`` one-hot)."""
    flat = idx.reshape(-1, idx.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    return jnp.zeros((flat.shape[0], shape[-1]), bool).at[rows, flat].set(True).reshape(shape)


def head_mask(p_logp: jax.Array, k: int) -> jax.Array:
    """``[..., V]`` bool: the teacher's ``k`` most likely tokens (ties broken by index, as
    `jax.lax.top_k` does)."""
    if k == 0:
        return jnp.zeros(p_logp.shape, bool)
    return index_mask(p_logp.shape, jax.lax.top_k(p_logp, k)[1])


def _masked_lse(logp: jax.Array, keep: jax.Array) -> jax.Array:
    """``log sum_{keep} exp(logp)`` (``-inf`` when nothing is kept)."""
    return jax.nn.logsumexp(jnp.where(keep, logp, -jnp.inf), axis=-1)


def tail_aware_parts(p_logp: jax.Array, q_logp: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(KL over head + tail bucket, KL of the renormalised tails, p_T)`` per position."""
    head = head_mask(p_logp, k)
    tail = ~head
    p_tail, q_tail = _masked_lse(p_logp, tail), _masked_lse(q_logp, tail)
    head_kl = _kl(jnp.where(head, p_logp, -jnp.inf), jnp.where(head, q_logp, 0.0))
    # the tail is judged on its log-mass: exp(p_T) underflows to 0 below ~1e-38 while the
    # renormalised tail is still well defined (a very peaked teacher, or tau < 1)
    has_tail = jnp.isfinite(p_tail)
    safe_p_tail = jnp.where(has_tail, p_tail, 0.0)
    pt = jnp.where(has_tail, jnp.exp(safe_p_tail), 0.0)
    bucket = jnp.where(has_tail, pt * (safe_p_tail - jnp.where(has_tail, q_tail, 0.0)), 0.0)
    # renormalised tails: log p~ = log p - log p_T on T (an empty tail has no KL)
    pn = jnp.where(tail & has_tail[..., None], p_logp - safe_p_tail[..., None], -jnp.inf)
    # a student with no mass on the teacher's tail: the bucket term is already +inf, and the
    # renormalised tail (-inf - -inf) is undefined: no tail term (it was NaN, even at beta 0)
    q_ok = jnp.isfinite(q_tail)
    qn = jnp.where(tail & q_ok[..., None], q_logp - jnp.where(q_ok, q_tail, 0.0)[..., None], -jnp.inf)
    tail_kl = jnp.where(has_tail & q_ok, _kl(pn, qn), 0.0)
    return head_kl + bucket, tail_kl, pt


@DIVERGENCES.register("tail_aware")
def tail_aware(p_logp, q_logp, *, top_k: int = 10, tail_beta: float | jax.Array = 1.0, **_) -> jax.Array:
    """``KL_{K+1}(p || q) + beta KL(p_T~ || q_T~)`` with ``H`` = the teacher's top-``top_k``.
    At ``beta = 0`` the tail term is absent, also where it is ``inf`` (a student with no mass on
    part of the teacher's tail; ``0 * inf`` would be NaN)."""
    bucket_kl, tail_kl, _ = tail_aware_parts(p_logp, q_logp, top_k)
    return bucket_kl + jnp.where(jnp.asarray(tail_beta) == 0, 0.0, tail_beta * tail_kl)


def bucketed(logp: jax.Array, idx: jax.Array) -> jax.Array:
    """``[..., V]`` log-probs -> ``[..., K + 1]``: those of tokens ``idx [..., K]`` (distinct)
    and, last, the log of the remaining mass (``-inf`` if none remains)."""
    head = jnp.take_along_axis(logp, idx, axis=-1)
    in_head = index_mask(logp.shape, idx)
    return jnp.concatenate([head, _masked_lse(logp, ~in_head)[..., None]], axis=-1)


def bucket_from_head(head_logp: jax.Array, vocab_size: int | None = None) -> jax.Array:
    """Stored top-K log-probs ``[..., K]`` -> ``[..., K + 1]`` with the tail bucket
    ``log(1 - sum exp(head))``. Float32 log-probs resolve the head's sum only to about
    ``K 2^-24``: a tail below that (a confident teacher's top-1 stored as ``-0.0``) is unknown,
    and is floored there rather than set to 0 mass, which would make reverse KL infinite.
    With ``K >= vocab_size`` there is no tail at all: its bucket is empty (``-inf``; the floor
    gave the teacher tail mass where the student has no token, and forward KL was inf)."""
    head_logp = head_logp.astype(jnp.float32)
    if vocab_size is not None and head_logp.shape[-1] >= vocab_size:
        empty = jnp.full(head_logp.shape[:-1] + (1,), -jnp.inf, jnp.float32)
        return jnp.concatenate([head_logp, empty], axis=-1)
    head_mass = jax.nn.logsumexp(head_logp, axis=-1)
    floor = jnp.log(jnp.float32(head_logp.shape[-1] * 2.0**-24))
    safe = jnp.minimum(head_mass, -1e-30)
    tail = jnp.where(safe > -0.693, jnp.log(-jnp.expm1(safe)), jnp.log1p(-jnp.exp(jnp.minimum(safe, -0.693))))
    tail = jnp.maximum(jnp.where(head_mass < 0, tail, -jnp.inf), floor)
    return jnp.concatenate([head_logp, tail[..., None]], axis=-1)
