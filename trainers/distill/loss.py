"""The SFT loss with a frozen teacher and/or PEAR importance weights (``SFTConfig.distill``,
``SFTConfig.pear``), as a ``(sum, (count, sums))`` pair so gradient accumulation stays exact.

Per trained position t (target ``y = tokens[t + 1]``), with ``p``/``q`` the teacher's and the
student's next-token distributions at temperature tau:

    loss_t = ce_weight CE_t + weight tau^2 D(p_t || q_t) + tpa_weight tau^2 TPA_t

The student's LM head and the teacher's run over ``chunk_rows`` positions at a time when the
float32 ``[B, T, V]`` logits exceed `trainers.step.CHUNKED_LOSS_BYTES` (each chunk under
`jax.checkpoint`: the backward pass recomputes its logits), so no float32 ``[B, T, V]`` exists
whole; with ``teacher_logprobs="topk"`` the teacher's side is only its top-K log-probs and a
tail bucket ``[B, T, K + 1]`` (computed once, no gradient).

Align-TI's TPA (Chen et al. 2026, method card B.9, [INFERRED] reading): the divergence of the
two-step joints ``P(y, v) = p_t(y) p_{t+1}(v | y)`` along the data token ``y``;
``joint_bucket`` lumps the pairs whose first token is not ``y`` into one bin, a proper KL:

    TPA_t = p_t(y) log(p_t(y)/q_t(y)) + (1 - p_t(y)) log((1 - p_t(y))/(1 - q_t(y))) + p_t(y) KL(p_{t+1} || q_{t+1})

``product`` drops the middle term (the card's formula as written). Only positions whose next
position is trained too have a transition.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.models.logprobs import unembedding
from trainers.distill.config import DistillConfig
from trainers.distill.divergences import DIVERGENCES, bucket_from_head, bucketed, forward_kl
from trainers.losses import next_token_targets
from trainers.pear import PEARConfig, pear_weights, shifted
from trainers.step import CHUNKED_LOSS_BYTES, forward

Batch = dict[str, jax.Array]


def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)


def _over_chunks(fn: Callable, args: tuple, n: int, chunk: int | None, *, remat: bool) -> dict[str, jax.Array]:
    """``fn(*args)`` on rows ``[n, ...]``, ``chunk`` rows at a time (None: all at once)."""
    if chunk is None or chunk >= n:
        return fn(*args)
    pad = (-n) % chunk

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, chunk, *x.shape[1:])

    body = jax.checkpoint(lambda xs: fn(*xs)) if remat else (lambda xs: fn(*xs))
    out = jax.lax.map(body, jax.tree.map(split, args))
    return jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:])[:n], out)


def log_rest(logp: jax.Array, targets: jax.Array) -> jax.Array:
    """``log(1 - p(y))`` as the log-sum over every token but ``y`` (``[n, V]``, ``[n]`` ->
    ``[n]``): exact where ``log p(y)`` rounds to 0 in float32 (a margin above ~17)."""
    others = jnp.arange(logp.shape[-1])[None, :] != targets[:, None]
    return jax.nn.logsumexp(jnp.where(others, logp, -jnp.inf), axis=-1)


def rest_from_bucket(bucket: jax.Array, idx: jax.Array, targets: jax.Array, target_logp: jax.Array) -> jax.Array:
    """``log(1 - p(y))`` from top-K bins ``bucket [n, K + 1]`` over ``idx [n, K]`` and the
    target's own log-prob: the other bins when ``y`` is in the head, else the tail bucket
    less ``p(y)``."""
    in_head = idx == targets[:, None]
    head_rest = jax.nn.logsumexp(jnp.where(jnp.concatenate([in_head, jnp.zeros_like(in_head[:, :1])], -1),
                                           -jnp.inf, bucket), axis=-1)
    tail, y = bucket[:, -1], jnp.minimum(target_logp, bucket[:, -1])
    d = jnp.where(jnp.isfinite(tail), y - tail, -jnp.inf)  # <= 0
    tail_rest = jnp.logaddexp(jax.nn.logsumexp(bucket[:, :-1], axis=-1),
                              tail + jnp.where(d > -0.693, jnp.log(-jnp.expm1(jnp.minimum(d, -1e-30))),
                                               jnp.log1p(-jnp.exp(d))))
    return jnp.where(in_head.any(-1), head_rest, tail_rest)


def teacher_topk(h: jax.Array, w: jax.Array, targets: jax.Array, *, k: int, temperature: float,
                 chunk: int | None) -> dict[str, jax.Array]:
    """The teacher's top-``k`` bins and tail bucket ``bucket [n, k + 1]``, their token ids
    ``idx [n, k]`` and the log-prob of each target ``target [n]``, at ``temperature``,
    ``chunk`` rows of logits at a time (no gradient); ``rest [n]`` is ``log(1 - p(target))``
    summed over the other tokens (exact where ``p(target)`` rounds to 1)."""
    h, w = jax.lax.stop_gradient(h), jax.lax.stop_gradient(w)

    def one(hc, tc):
        logp = jax.nn.log_softmax(_logits(hc, w) / temperature, axis=-1)
        _, idx = jax.lax.top_k(logp, k)
        return {"bucket": bucketed(logp, idx), "idx": idx,
                "target": jnp.take_along_axis(logp, tc[:, None], axis=-1)[:, 0], "rest": log_rest(logp, tc)}

    return _over_chunks(one, (h, targets), h.shape[0], chunk, remat=False)


def _zero_cotangent(x):
    x = jnp.asarray(x)
    return np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x)


def _kd_forward(h, w, targets, teacher, tau):
    z = _logits(h, w)
    lse1 = jax.nn.logsumexp(z, axis=-1)
    nll = lse1 - jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0]
    lse_tau = jax.nn.logsumexp(z / tau, axis=-1)
    logq = z / tau - lse_tau[:, None]
    if "h" in teacher:
        p = jax.nn.log_softmax(_logits(teacher["h"], teacher["w"]) / tau, axis=-1)
        return nll, forward_kl(p, logq), (lse1, lse_tau, None)
    q = bucketed(logq, teacher["idx"])
    return nll, forward_kl(teacher["bucket"], q), (lse1, lse_tau, q[:, -1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_kd(h, w, targets, teacher, tau):
    nll, kl, _ = _kd_forward(h, w, targets, teacher, tau)
    return nll, kl


def _fused_kd_fwd(h, w, targets, teacher, tau):
    nll, kl, stats = _kd_forward(h, w, targets, teacher, tau)
    return (nll, kl), (h, w, targets, teacher, stats)


def _fused_kd_bwd(tau, res, g):
    # d CE / dz = softmax(z) - onehot(y); d KL(p || softmax(z / tau)) / dz = (q - p^) / tau, where
    # p^ = p on a full vocabulary and, over top-K bins, p_v on the head and p_T q_v / q_T on the tail
    h, w, targets, teacher, (lse1, lse_tau, log_q_tail) = res
    g_nll, g_kl = g
    z = _logits(h, w)
    rows = jnp.arange(z.shape[0])[:, None]
    # every term an elementwise function of z, so XLA writes dz in one pass over the logits
    q = jnp.exp(z / tau - lse_tau[:, None])
    ce = g_nll[:, None] * jnp.exp(z - lse1[:, None])
    if "h" in teacher:
        p = jax.nn.softmax(_logits(teacher["h"], teacher["w"]) / tau, axis=-1)
        dz = ce + (g_kl / tau)[:, None] * (q - p)
    else:
        # the tail's p^_v = exp(log p_T + log q_v - log q_T) everywhere (in log space: p_T / q_T
        # may be far beyond float range), then the head's entries set in place to their own
        # q_v - p_v (never formed as a difference of two tail-scaled terms)
        idx, bucket = teacher["idx"], teacher["bucket"]
        log_ratio = bucket[:, -1] - log_q_tail
        log_ratio = jnp.where(jnp.isfinite(log_ratio), log_ratio, -jnp.inf)  # no tail mass on either side
        p_tail = jnp.exp(jnp.minimum(log_ratio[:, None] + z / tau - lse_tau[:, None], 0.0))
        dz = ce + (g_kl / tau)[:, None] * (q - p_tail)
        z_head = jnp.take_along_axis(z, idx, axis=-1)
        q_head = jnp.exp(z_head / tau - lse_tau[:, None])
        ce_head = g_nll[:, None] * jnp.exp(z_head - lse1[:, None])
        dz = dz.at[rows, idx].set(ce_head + (g_kl / tau)[:, None] * (q_head - jnp.exp(bucket[:, :-1])))
    dz = dz.at[rows[:, 0], targets].add(-g_nll)
    dh = jnp.dot(dz, w.astype(jnp.float32).T).astype(h.dtype)
    dw = jnp.dot(h.astype(jnp.float32).T, dz).astype(w.dtype)
    return dh, dw, _zero_cotangent(targets), jax.tree.map(_zero_cotangent, teacher)


_fused_kd.defvjp(_fused_kd_fwd, _fused_kd_bwd)


def fused_forward_kl_terms(h, w, targets, teacher: dict[str, Any], *, tau: float, chunk: int | None):
    """``{"nll", "div"}`` per row for the forward KL, with a hand-written backward pass (one
    elementwise pass over each chunk's recomputed logits): the same values and gradients as
    `position_terms`, fewer passes over ``[rows, V]``."""
    full = "h" in teacher
    tw = jax.lax.stop_gradient(teacher["w"]) if full else None

    def one(hc, tc, tch):
        tch = {"h": jax.lax.stop_gradient(tch["h"]), "w": tw} if full else jax.lax.stop_gradient(tch)
        nll, kl = _fused_kd(hc, w, tc, tch, tau)
        return {"nll": nll, "div": kl}

    tch = {"h": teacher["h"]} if full else {k: teacher[k] for k in ("bucket", "idx")}
    return _over_chunks(one, (h, targets, tch), h.shape[0], chunk, remat=False)


def position_terms(h: jax.Array, w: jax.Array, targets: jax.Array, teacher: dict[str, Any] | None,
                   cfg: DistillConfig | None, *, chunk: int | None, need_fkl: bool) -> dict[str, jax.Array]:
    """Per-row ``nll`` (at temperature 1) and, with a teacher, ``div`` (``cfg.divergence``),
    ``fkl`` (forward KL, for TPA), ``q_target`` / ``p_target`` (the student's / teacher's
    log-prob of the target at tau) and ``q_rest`` / ``p_rest`` (their ``log(1 - p(target))``).
    ``teacher``: ``{"h", "w"}`` (full distributions) or ``{"bucket", "idx", "target", "rest"}``
    (top-K bins)."""
    full = teacher is not None and "h" in teacher
    tw = jax.lax.stop_gradient(teacher["w"]) if full else None
    div_fn = DIVERGENCES[cfg.divergence] if cfg is not None else None

    def one(hc, tc, tch):
        logits = _logits(hc, w)
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = {"nll": lse - jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]}
        if teacher is None:
            return out
        tau = cfg.temperature
        q = jax.nn.log_softmax(logits / tau, axis=-1)
        if full:
            p = jax.nn.log_softmax(jax.lax.stop_gradient(_logits(tch["h"], tw)) / tau, axis=-1)
            p_target = jnp.take_along_axis(p, tc[:, None], axis=-1)[:, 0]
        else:
            p, p_target = tch["bucket"], tch["target"]
            q_full, q = q, bucketed(q, tch["idx"])
        # the bins of a top-K / stored teacher are its K head tokens and the bucket: the head is
        # those K (a stored K can differ from cfg.top_k)
        kwargs = dict(jsd_beta=cfg.jsd_beta, top_k=cfg.top_k if full else p.shape[-1] - 1, tail_beta=cfg.tail_beta)
        out["div"] = div_fn(p, q, **kwargs)
        if need_fkl:
            out["fkl"] = out["div"] if cfg.divergence == "forward_kl" else forward_kl(p, q)
            out["p_target"] = p_target
            q_all = q if full else q_full
            out["q_target"] = jnp.take_along_axis(q_all, tc[:, None], axis=-1)[:, 0]
            out["q_rest"] = log_rest(q_all, tc)
            out["p_rest"] = log_rest(p, tc) if full else (
                tch["rest"] if "rest" in tch else rest_from_bucket(p, tch["idx"], tc, p_target))
        return out

    tch = {} if teacher is None else ({"h": teacher["h"]} if full else
                                      {k: teacher[k] for k in ("bucket", "idx", "target", "rest") if k in teacher})
    return _over_chunks(one, (h, targets, tch), h.shape[0], chunk, remat=True)


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x <= 0`` (``-inf`` at 0; every branch finite, for the gradient)."""
    safe = jnp.minimum(x, -1e-30)
    value = jnp.where(safe > -0.693, jnp.log(-jnp.expm1(safe)), jnp.log1p(-jnp.exp(jnp.minimum(safe, -0.693))))
    return jnp.where(x >= 0, -jnp.inf, value)


def _plogratio(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """``p (log p - log q)`` with ``0 log 0 = 0`` and a finite gradient where ``p = 0``."""
    has = jnp.isfinite(logp)
    safe_p = jnp.where(has, logp, 0.0)
    return jnp.where(has, jnp.exp(safe_p) * (safe_p - jnp.where(has, logq, 0.0)), 0.0)


def transition_alignment(p_target, q_target, fkl_next, *, form: str, p_rest=None, q_rest=None) -> jax.Array:
    """TPA per position (module docstring), from the teacher's/student's log-prob of the data
    token, the forward KL of the next position and, for ``joint_bucket``, their log-mass on
    every other token (``p_rest`` / ``q_rest``: exact sums; default ``log(1 - p(y))``, which is
    ``-inf`` once ``p(y)`` rounds to 1)."""
    pt = jnp.exp(p_target)
    first = _plogratio(p_target, q_target)
    if form == "joint_bucket":
        rest_p = _log1mexp(p_target) if p_rest is None else p_rest
        rest_q = _log1mexp(q_target) if q_rest is None else q_rest
        first = first + _plogratio(rest_p, rest_q)
    return first + pt * fkl_next


def make_distill_loss_fn(graphdef, *, sliding_window: int | None, distill: DistillConfig | None,
                         pear: PEARConfig | None, teacher_graphdef=None, vocab_size: int,
                         chunked: bool | None = None, fused: bool = True):
    """``loss(params, batch, teacher_params) -> (sum, (count, sums))``: ``count`` is the
    trained-token count (or PEAR's weight sum when self-normalised); ``sums`` holds the
    trained-token count and the summed ``ce`` / ``distill`` / ``tpa`` / ``pear_weight`` terms.
    ``chunked``: run the LM heads in row chunks (None: when the float32 ``[B, T, V]`` logits
    exceed `CHUNKED_LOSS_BYTES`). ``fused``: the forward KL without TPA takes the hand-written
    backward pass (`fused_forward_kl_terms`)."""
    need_fkl = distill is not None and distill.tpa_weight > 0

    def loss_fn(params, batch: Batch, teacher_params):
        targets, valid = next_token_targets(batch)
        B, T = targets.shape
        big = 4 * B * T * vocab_size > CHUNKED_LOSS_BYTES if chunked is None else chunked
        rows = distill.chunk_rows if (big and distill is not None) else (512 if big else None)
        student = nnx.merge(graphdef, params)
        out = forward(graphdef, params, batch, sliding_window=sliding_window, head=False)
        h = out.hidden.reshape(B * T, -1)
        flat_targets = targets.reshape(-1)
        teacher = None
        if distill is not None:
            if distill.teacher_logprobs == "offline":
                missing = [k for k in ("teacher_topk_ids", "teacher_topk_logprobs") + (
                    ("teacher_logprobs",) if need_fkl else ()) if k not in batch]
                if missing:
                    raise ValueError(f"algorithm.distill.teacher_logprobs='offline' needs the data rows' {missing} "
                                     "(write them with `jaxlm logprobs --as teacher --top-k K`)")
                bucket = bucket_from_head(shifted(batch["teacher_topk_logprobs"]), vocab_size)
                teacher = {"bucket": bucket.reshape(B * T, -1),
                           "idx": shifted(batch["teacher_topk_ids"]).reshape(B * T, -1),
                           "target": shifted(batch.get("teacher_logprobs", jnp.zeros((B, T)))).reshape(-1)}
                teacher["rest"] = rest_from_bucket(teacher["bucket"], teacher["idx"], flat_targets, teacher["target"])
            else:
                t_model = nnx.merge(teacher_graphdef, teacher_params)
                # the teacher's own attention window (a windowed teacher for a full-attention student)
                t_out = forward(teacher_graphdef, teacher_params, batch, sliding_window=t_model.config.sliding_window,
                                head=False)
                th = jax.lax.stop_gradient(t_out.hidden).reshape(B * T, -1)
                tw = unembedding(t_model)
                if distill.teacher_logprobs == "full":
                    teacher = {"h": th, "w": tw}
                else:
                    # no gradient flows here: chunking the teacher's logits costs nothing
                    teacher = teacher_topk(th, tw, flat_targets, k=distill.top_k,
                                           temperature=distill.temperature, chunk=distill.chunk_rows)
        if fused and teacher is not None and distill.divergence == "forward_kl" and not need_fkl:
            terms = fused_forward_kl_terms(h, unembedding(student), flat_targets, teacher,
                                           tau=distill.temperature, chunk=rows)
        else:
            terms = position_terms(h, unembedding(student), flat_targets, teacher, distill, chunk=rows,
                                   need_fkl=need_fkl)
        terms = {k: v.reshape(B, T) for k, v in terms.items()}
        per_token = jnp.zeros((B, T), jnp.float32)
        sums: dict[str, jax.Array] = {"tokens": valid.sum(dtype=jnp.float32),
                                      "ce": jnp.sum(jnp.where(valid, terms["nll"], 0.0))}
        if distill is None:
            per_token = terms["nll"]
        else:
            tau2 = distill.temperature**2
            per_token = distill.ce_weight * terms["nll"] + distill.weight * tau2 * terms["div"]
            sums["distill"] = jnp.sum(jnp.where(valid, terms["div"], 0.0))
            if need_fkl:
                nxt = jnp.concatenate([valid[:, 1:], jnp.zeros_like(valid[:, :1])], axis=1) & valid
                fkl_next = jnp.concatenate([terms["fkl"][:, 1:], jnp.zeros_like(terms["fkl"][:, :1])], axis=1)
                tpa = transition_alignment(terms["p_target"], terms["q_target"], fkl_next, form=distill.tpa_form,
                                           p_rest=terms["p_rest"], q_rest=terms["q_rest"])
                tpa = jnp.where(nxt, tpa, 0.0)
                per_token = per_token + distill.tpa_weight * tau2 * tpa
                sums["tpa"] = jnp.sum(tpa)
        weights = jnp.where(valid, 1.0, 0.0)
        if pear is not None:
            weights = jax.lax.stop_gradient(pear_weights(-terms["nll"], batch, valid, pear))
            sums["pear_weight"] = jnp.sum(weights)
        total = jnp.sum(jnp.where(valid, weights * per_token, 0.0))
        count = sums["pear_weight"] if (pear is not None and pear.normalize) else sums["tokens"]
        return total, (count, sums)

    return loss_fn
