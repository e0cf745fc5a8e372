"""Align-TI's instruction-aware vision alignment (IVA; Chen et al., arXiv 2602.09483; method
card B.9, read from a summary: the training code is not released).

1. **Instruction-relevance layer selection.** At layer ``l``, ``alpha_l(x)`` is the
   instruction-to-vision attention of input ``x``: the attention of the instruction tokens
   (queries) on the vision tokens (keys), averaged over heads and instruction tokens and
   renormalised over the vision tokens. ``IRS(l) = 1 - E_{(x1, x2)} cos(alpha_l(x1),
   alpha_l(x2))`` over pairs that share the media and differ in the instruction [INFERRED
   reading of the truncated formula]: a layer whose vision attention follows the instruction
   scores high. ``l* = argmax IRS``.
2. **Salient visual tokens**: the top-``k`` vision tokens by the teacher's ``alpha_{l*}``.
3. **Alignment** on those tokens through the distillation registry
   (`trainers.distill.divergences.DIVERGENCES`): ``target="logits"`` (default) compares the
   teacher's and student's output distributions at the salient positions; ``"hidden"`` the
   layer-``l*`` hidden states by mean squared error (same width, or the caller projects) —
   the source does not say which, so it is a flag.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trainers.distill.divergences import DIVERGENCES


def instruction_to_vision_attention(attn_probs: jax.Array, instruction: jax.Array, vision: jax.Array) -> jax.Array:
    """``attn_probs [L, B, N, T, S]`` (a forward's ``collect=("attn_probs",)``) with masks
    ``instruction [B, T]`` (queries) and ``vision [B, S]`` (keys) -> ``alpha [L, B, S]``: per
    layer the mean over heads and instruction queries of the attention on each vision key,
    renormalised over the vision keys (zero off them)."""
    a = jnp.mean(attn_probs.astype(jnp.float32), axis=2)  # [L, B, T, S]
    q = instruction.astype(jnp.float32)
    a = jnp.einsum("lbts,bt->lbs", a, q) / jnp.maximum(q.sum(1), 1.0)[None, :, None]
    a = a * vision.astype(jnp.float32)[None]
    return a / jnp.maximum(a.sum(-1, keepdims=True), 1e-30)


def instruction_relevance(alpha_1: jax.Array, alpha_2: jax.Array) -> jax.Array:
    """``IRS [L]`` from the attentions ``[L, B, S]`` of B pairs (row b of each: the same media,
    two instructions): ``1 - mean_b cos(alpha_1[l, b], alpha_2[l, b])``."""
    num = jnp.sum(alpha_1 * alpha_2, -1)
    den = jnp.linalg.norm(alpha_1, axis=-1) * jnp.linalg.norm(alpha_2, axis=-1)
    return 1.0 - jnp.mean(num / jnp.maximum(den, 1e-30), axis=-1)


def salient_tokens(alpha: jax.Array, vision: jax.Array, k: int) -> jax.Array:
    """Mask ``[B, S]`` of the ``k`` vision tokens with the largest ``alpha [B, S]`` (all of them
    when a row has fewer)."""
    score = jnp.where(vision, alpha, -jnp.inf)
    order = jnp.argsort(-score, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1)
    return (ranks < k) & vision


def iva_loss(teacher: jax.Array, student: jax.Array, salient: jax.Array, *, target: str = "logits",
             divergence: str = "forward_kl", **divergence_kw) -> jax.Array:
    """Mean over the salient positions of the divergence of the student from the teacher:
    ``target="logits"``: ``teacher``/``student`` are logits ``[B, T, V]``, compared with
    ``DIVERGENCES[divergence]``; ``"hidden"``: hidden states ``[B, T, D]`` by squared error
    (mean over D). 0 when no position is salient."""
    w = salient.astype(jnp.float32)
    beta = divergence_kw.get("jsd_beta")
    if beta is not None and not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 < beta < 1):
        raise ValueError(f"iva_loss jsd_beta={beta!r} is invalid: must be in (0, 1), as DistillConfig.jsd_beta")
    tail = divergence_kw.get("tail_beta")
    if tail is not None and (isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0 <= tail < math.inf):
        raise ValueError(f"iva_loss tail_beta={tail!r} is invalid: must be a finite number >= 0, as DistillConfig")
    k = divergence_kw.get("top_k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"iva_loss top_k={k!r} is invalid: must be an int >= 0, as DistillConfig")
    if divergence not in DIVERGENCES:
        raise ValueError(f"iva_loss divergence={divergence!r} is invalid: must be one of {sorted(DIVERGENCES)}")
    if target == "logits":
        div = DIVERGENCES[divergence](jax.nn.log_softmax(teacher.astype(jnp.float32)),
                                      jax.nn.log_softmax(student.astype(jnp.float32)), **divergence_kw)
    elif target == "hidden":
        div = jnp.mean(jnp.square(teacher.astype(jnp.float32) - student.astype(jnp.float32)), axis=-1)
    else:
        raise ValueError(f"iva_loss target={target!r} must be 'logits' or 'hidden'")
    return jnp.sum(div * w) / jnp.maximum(w.sum(), 1.0)
