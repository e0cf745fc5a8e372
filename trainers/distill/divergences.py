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
    ``q = 0``), a bin with ``p > 0 = q`` makes it ``inf``."""
    p = jnp.exp(p_logp)
    term = jnp.where(p > 0, p * (p_logp - jnp.where(p > 0, q_logp, 0.0)), 0.0)
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
    m_logp = jnp.logaddexp(p_logp + jnp.log(jsd_beta), q_logp + jnp.log1p(-jsd_beta))
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
    p_head = jnp.where(head, jnp.exp(p_logp), 0.0)
    head_kl = jnp.sum(jnp.where(head & (p_head > 0), p_head * (p_logp - q_logp), 0.0), axis=-1)
    pt = jnp.exp(p_tail)
    bucket = jnp.where(pt > 0, pt * (p_tail - jnp.where(pt > 0, q_tail, 0.0)), 0.0)
    # renormalised tails: log p~ = log p - log p_T on T (an empty tail has no KL)
    pn = jnp.where(tail, p_logp - p_tail[..., None], -jnp.inf)
    qn = jnp.where(tail, q_logp - q_tail[..., None], -jnp.inf)
    tail_kl = jnp.where(pt > 0, _kl(jnp.where(pt[..., None] > 0, pn, -jnp.inf), qn), 0.0)
    return head_kl + bucket, tail_kl, pt


@DIVERGENCES.register("tail_aware")
def tail_aware(p_logp, q_logp, *, top_k: int = 10, tail_beta: float | jax.Array = 1.0, **_) -> jax.Array:
    """``KL_{K+1}(p || q) + beta KL(p_T~ || q_T~)`` with ``H`` = the teacher's top-``top_k``."""
    bucket_kl, tail_kl, _ = tail_aware_parts(p_logp, q_logp, top_k)
    return bucket_kl + tail_beta * tail_kl


def bucketed(logp: jax.Array, idx: jax.Array) -> jax.Array:
    """``[..., V]`` log-probs -> ``[..., K + 1]``: those of tokens ``idx [..., K]`` (distinct)
    and, last, the log of the remaining mass (``-inf`` if none remains)."""
    head = jnp.take_along_axis(logp, idx, axis=-1)
    in_head = index_mask(logp.shape, idx)
    return jnp.concatenate([head, _masked_lse(logp, ~in_head)[..., None]], axis=-1)


def bucket_from_head(head_logp: jax.Array) -> jax.Array:
    """Stored top-K log-probs ``[..., K]`` -> ``[..., K + 1]`` with the tail bucket
    ``log(1 - sum exp(head))`` (clipped at 0 mass when rounding makes the head sum exceed 1)."""
    head_mass = jax.nn.logsumexp(head_logp, axis=-1)
    tail = jnp.where(head_mass < 0, jnp.log(-jnp.expm1(jnp.minimum(head_mass, 0.0))), -jnp.inf)
    return jnp.concatenate([head_logp, tail[..., None]], axis=-1)
