"""Which masked positions a diffusion-LM denoising step commits, as pure functions on one block.

* `num_transfer_tokens`: LLaDA's fixed schedule (Nie et al. 2025, ``generate.py``): ``n`` masked
  tokens over ``s`` steps, ``n // s`` each and one more in the first ``n % s`` steps.
* `predict`: the step's proposals, ``argmax(logits + temperature * Gumbel)`` (LLaDA's
  ``exp(logits) / (-log U)^temperature``, taken in log space), and their confidences
  (``softmax(logits)[proposal]``, or uniform noise for ``remasking="random"``).
* `commit_top_k` (LLaDA low-confidence remasking: the ``k`` most confident masked positions
  keep their proposal, the rest stay masked), `commit_threshold` (Fast-dLLM, Wu et al. 2025,
  ``get_transfer_index``: the most confident masked position and every other one with
  confidence >= threshold) and `commit_slow_fast` (SPEED's Slow-Fast rule, see its docstring).

Every function takes block-local arrays: tokens ``[B, L]``, logits ``[B, L, V]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.inference.sampling import argmax_last

REMASKING = ("low_confidence", "random")
#: which sensitivity group SPEED's Slow-Fast rule decodes jointly (the sources disagree)
FAST_GROUPS = ("low", "high")


def num_transfer_tokens(masked: int | np.ndarray, steps: int) -> np.ndarray:
    """Tokens to commit at each of ``steps`` steps for ``masked`` masked positions (an int or
    an array of per-row counts): ``masked // steps`` each, plus one in the first
    ``masked % steps`` steps, e.g. ``num_transfer_tokens(10, 4) == [3, 3, 2, 2]``."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps <= 0:
        raise ValueError(f"steps={steps!r} is invalid: must be a positive int")
    n = np.asarray(masked, np.int64)
    if (n < 0).any():
        raise ValueError(f"masked={masked!r} is invalid: counts must be >= 0")
    base, extra = n // steps, n % steps
    return (base[..., None] + (np.arange(steps) < extra[..., None])).astype(np.int32)


def predict(logits: jax.Array, rng: jax.Array, *, temperature: float, remasking: str) -> tuple[jax.Array, jax.Array]:
    """Proposals ``[B, L]`` and confidences ``[B, L]`` float32 from ``logits [B, L, V]``.
    Temperature 0 is argmax (deterministic); otherwise Gumbel-max sampling at ``temperature``.
    The confidence is the un-noised softmax probability of the proposal."""
    if remasking not in REMASKING:
        raise ValueError(f"remasking={remasking!r} is invalid: must be one of {REMASKING}")
    logits = logits.astype(jnp.float32)
    noise_key, order_key = jax.random.split(rng)
    if temperature > 0:
        gumbel = jax.random.gumbel(noise_key, logits.shape, jnp.float32)
        proposal = argmax_last(logits + temperature * gumbel)
    else:
        proposal = argmax_last(logits)
    if remasking == "random":
        conf = jax.random.uniform(order_key, proposal.shape, jnp.float32)
    else:
        p = jax.nn.softmax(logits, axis=-1)
        conf = jnp.take_along_axis(p, proposal[..., None], axis=-1)[..., 0]
    return proposal.astype(jnp.int32), conf


def confidence_rank(conf: jax.Array, masked: jax.Array) -> jax.Array:
    """Rank ``[B, L]`` of each masked position by descending confidence (0 = most confident;
    ties go to the earlier position); unmasked positions rank after every masked one. A NaN
    confidence (NaN logits) ranks as 0, still before every unmasked position: each step then
    commits at least one token (a NaN ranked after them, nothing was committed again, and the
    threshold loop never ended)."""
    score = jnp.where(masked, jnp.nan_to_num(conf, nan=0.0), -jnp.inf)
    order = jnp.argsort(-score, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def commit_top_k(tokens, masked, proposal, conf, k) -> tuple[jax.Array, jax.Array]:
    """LLaDA low-confidence remasking: commit the ``k`` (``[]`` or ``[B]``) most confident
    masked positions. Returns the new tokens and the committed positions."""
    rank = confidence_rank(conf, masked)
    select = masked & (rank < jnp.reshape(k, (-1, 1)))
    return jnp.where(select, proposal, tokens), select


def commit_threshold(tokens, masked, proposal, conf, threshold: float) -> tuple[jax.Array, jax.Array]:
    """Fast-dLLM confidence-aware parallel decoding: the most confident masked position and
    every masked position whose confidence is >= ``threshold``."""
    rank = confidence_rank(conf, masked)
    select = masked & ((rank == 0) | (conf >= threshold))
    return jnp.where(select, proposal, tokens), select


def jensen_shannon(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
    """``JSD(p || q) = (KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2``, in nats, per
    position (``[..., V]`` logits -> ``[...]``); 0 for identical inputs, at most log 2."""
    lp = jax.nn.log_softmax(p_logits.astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
    lm = jnp.logaddexp(lp, lq) - jnp.log(2.0)
    p, q = jnp.exp(lp), jnp.exp(lq)
    kl_pm = jnp.sum(jnp.where(p > 0, p * (lp - lm), 0.0), axis=-1)
    kl_qm = jnp.sum(jnp.where(q > 0, q * (lq - lm), 0.0), axis=-1)
    return jnp.maximum(0.5 * (kl_pm + kl_qm), 0.0)


def commit_slow_fast(tokens, masked, proposal, conf, jsd, *, jsd_threshold: float, confidence: float,
                     fast: str) -> tuple[jax.Array, jax.Array]:
    """SPEED's Slow-Fast decoding: each masked position's sensitivity to the preceding block
    is ``jsd`` (the JSD between its predictions with and without that block). With
    ``fast="low"`` the positions with ``jsd < jsd_threshold`` form the fast group (the seed
    abstract: low-sensitivity tokens are decoded jointly), with ``fast="high"`` those with
    ``jsd >= jsd_threshold`` do (the ICML page). Every fast position with confidence >=
    ``confidence`` is committed together; the slow group advances by the single most
    confident masked position of the step (committed whatever its group)."""
    if fast not in FAST_GROUPS:
        raise ValueError(f"fast={fast!r} is invalid: must be one of {FAST_GROUPS}")
    low = jsd < jsd_threshold
    in_fast = low if fast == "low" else ~low
    rank = confidence_rank(conf, masked)
    select = masked & ((rank == 0) | (in_fast & (conf >= confidence)))
    return jnp.where(select, proposal, tokens), select
