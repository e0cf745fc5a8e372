"""ME-DLM's edit rounds (Ren et al., arXiv 2605.09603; ``test.py::edit_diffusion``) as jittable
functions on a fixed-width response buffer.

After mask diffusion, the response is closed (`close_response`: stop tokens dropped, one
trailing EOS appended) and refined by rounds of edits. One round (`edit_round`) runs the
model once over ``prompt + response``; the current-token head's argmax at response token
``i`` says what it becomes (itself, another token, or the delete id) and the next-token head's
argmax at the position before ``i`` says which token to insert in gap ``i`` (predicting the
token that will stand there means "insert nothing"). `apply_predictions` applies both:
deleted tokens go with their gap's insertion; an insertion is made where it differs from the
token after it; insertions beyond ``max_len`` response tokens are dropped, left to right. The
prompt and the trailing EOS are frozen (the trailing EOS's current-token label is EOS, and the
gap before it inserts anything but EOS), which is `jaxlm.data.edit_labels.apply_edits` on
every row. With ``edits_per_round=k`` (the reference's ``pred_per_step``), `select_edits` keeps
only each row's ``k`` most confident edits of the round (``edit_threshold``: only those above a
confidence). A round that changes nothing is a fixed point of greedy decoding, so the loop of
`edit_rounds` stops when no row changes.

Buffers are ``[B, W]`` token arrays with per-row lengths ``[B]`` counting the trailing EOS; slots
at and after the length hold EOS.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlm.inference.sampling import argmax_last


def _scatter_rows(width: int, fill: int, slots: jax.Array, values: jax.Array) -> jax.Array:
    """``[B, width]`` filled with ``fill`` and ``values`` written at ``slots`` (``>= width`` dropped)."""
    B = slots.shape[0]
    out = jnp.full((B, width), fill, values.dtype)
    return jax.vmap(lambda o, s, v: o.at[s].set(v, mode="drop"))(out, slots, values)


def close_response(tokens: jax.Array, stop: jax.Array, *, eos_id: int, width: int,
                   max_len: int | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The decoded response ``tokens [B, G]`` with its stop tokens (``stop [B, G]``) dropped,
    cut to ``max_len`` (an int or one per row; at most and by default ``width - 1``) tokens
    and closed by one EOS: ``(buffer [B, width], lengths [B])``."""
    cap = width - 1 if max_len is None else jnp.minimum(jnp.asarray(max_len, jnp.int32), width - 1)
    cap = jnp.broadcast_to(jnp.asarray(cap, jnp.int32).reshape(-1, 1), (tokens.shape[0], 1))
    keep = ~stop
    slot = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, width)
    slot = jnp.where(slot < cap, slot, width)
    out = _scatter_rows(width, eos_id, slot, tokens.astype(jnp.int32))
    lengths = jnp.minimum(keep.sum(1), cap[:, 0]).astype(jnp.int32) + 1
    return out, lengths


def apply_predictions(response: jax.Array, lengths: jax.Array, cur: jax.Array, nxt: jax.Array, *, del_id: int,
                      eos_id: int, max_len: int | jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One round of edits on ``response [B, W]`` (``lengths`` with the trailing EOS).

    ``cur [B, W]``: what response token ``i`` becomes (``del_id``: deleted); ``nxt [B, W]``: the
    token for gap ``i`` (before token ``i``; gap ``lengths - 1`` is before the trailing EOS).
    Returns ``(response, lengths, changed [B])``; the response keeps at most ``max_len`` (an
    int or one per row) tokens before its EOS (surviving tokens are never cut) and must fit:
    ``max_len < W``.
    """
    B, W = response.shape
    if isinstance(max_len, int) and max_len >= W:
        raise ValueError(f"max_len={max_len} leaves no slot for the trailing EOS in a buffer of width {W}")
    max_len = jnp.minimum(jnp.broadcast_to(jnp.asarray(max_len, jnp.int32).reshape(-1, 1), (B, 1)), W - 1)
    slot = jnp.arange(W)[None]
    body = slot < (lengths[:, None] - 1)
    closing = slot == (lengths[:, None] - 1)
    value = jnp.where(body, cur, jnp.where(closing, eos_id, response))
    keep = (body & (cur != del_id)) | closing
    wants = keep & (nxt != value)
    budget = max_len - jnp.sum(keep & body, axis=1, keepdims=True, dtype=jnp.int32)
    insert = wants & (jnp.cumsum(wants, axis=1) <= budget)
    count = keep.astype(jnp.int32) * (1 + insert.astype(jnp.int32))
    start = jnp.cumsum(count, axis=1) - count
    ins_slot = jnp.where(insert, start, W)
    tok_slot = jnp.where(keep, start + insert, W)
    out = _scatter_rows(W, eos_id, jnp.concatenate([ins_slot, tok_slot], 1),
                        jnp.concatenate([nxt, value], 1).astype(response.dtype))
    new_lengths = count.sum(1).astype(lengths.dtype)
    changed = jnp.any(body & (value != response), axis=1) | jnp.any(insert, axis=1) | jnp.any(body & ~keep, axis=1)
    return out, new_lengths, changed


def select_edits(response: jax.Array, lengths: jax.Array, cur: jax.Array, nxt: jax.Array, cur_score: jax.Array,
                 nxt_score: jax.Array, *, eos_id: int, k: int | None = None,
                 threshold: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Keep only some of each row's predicted edits: ``(cur, nxt)`` to give `apply_predictions`.

    ``k``: the ``k`` most confident ones (ME-DLM ``test.py::edit_diffusion`` with
    ``pred_per_step=k``, ``max_prob_score=True``). ``threshold``: only those whose score is at
    least this (not in the reference, which makes every edit: Fast-dLLM's confidence rule
    applied to edits). With both, the ``k`` most confident of those above the threshold.

    The candidates, as in the reference, are the substitutions (response token ``i`` predicted
    as another token or the delete id, scored by ``cur_score[i]``) and the insertions (gap ``i``
    whose next-token prediction differs from the current-token prediction of the token after
    it, or from EOS at the closing gap, scored by ``nxt_score[i]``), ranked together per row;
    ties go to substitutions, then to the leftmost. A substitution left out keeps its token;
    an insertion left out becomes "insert nothing" (the token after the gap as it will stand).
    """
    W = response.shape[1]
    slot = jnp.arange(W)[None]
    body = slot < (lengths[:, None] - 1)
    gaps = slot <= (lengths[:, None] - 1)
    predicted = jnp.where(body, cur, eos_id)
    sub = body & (cur != response)
    ins = gaps & (nxt != predicted)
    if threshold is not None:
        sub, ins = sub & (cur_score >= threshold), ins & (nxt_score >= threshold)
    chosen = jnp.concatenate([sub, ins], 1)
    if k is not None:
        score = jnp.concatenate([jnp.where(sub, cur_score, -jnp.inf), jnp.where(ins, nxt_score, -jnp.inf)], 1)
        rank = jnp.argsort(jnp.argsort(-score, axis=1, stable=True), axis=1, stable=True)
        chosen = chosen & (rank < k)
    cur = jnp.where(body & ~chosen[:, :W], response, cur)
    nxt = jnp.where(chosen[:, W:], nxt, jnp.where(body, cur, eos_id))
    return cur, nxt


def edit_logits(model, prompt: jax.Array, prompt_valid: jax.Array, response: jax.Array, lengths: jax.Array):
    """Current-token logits of the response slots and next-token logits of the slot before each
    (gap ``i``'s insertion), ``[B, W, V]`` each, float32, from one forward over ``prompt + response``."""
    P, W = prompt.shape[1], response.shape[1]
    x = jnp.concatenate([prompt.astype(jnp.int32), response.astype(jnp.int32)], 1)
    valid = jnp.concatenate([prompt_valid.astype(bool), jnp.arange(W)[None] < lengths[:, None]], 1)
    hidden = model.backbone(x, mask=valid).hidden
    return model.unembed(hidden[:, P:]), model.unembed_next(hidden[:, P - 1:P + W - 1])


def edit_round(model, prompt, prompt_valid, response, lengths, *, del_id: int, eos_id: int, max_len: int,
               banned: tuple[int, ...] = (), edits_per_round: int | None = None,
               edit_threshold: float | None = None):
    """`edit_logits`, greedy predictions (``banned`` ids excluded, e.g. the mask id), with
    ``edits_per_round`` / ``edit_threshold`` only the most confident edits of each row
    (`select_edits`; confidence is the prediction's softmax probability), and
    `apply_predictions`: ``(response, lengths, changed)``."""
    cur_logits, next_logits = edit_logits(model, prompt, prompt_valid, response, lengths)
    if banned:
        ids = jnp.asarray(banned, jnp.int32)
        cur_logits = cur_logits.at[..., ids].set(-jnp.inf)
        next_logits = next_logits.at[..., ids].set(-jnp.inf)
    cur, nxt = argmax_last(cur_logits).astype(jnp.int32), argmax_last(next_logits).astype(jnp.int32)
    if edits_per_round is not None or edit_threshold is not None:
        cur_score = jnp.exp(jnp.max(cur_logits, -1) - jax.nn.logsumexp(cur_logits, -1))
        nxt_score = jnp.exp(jnp.max(next_logits, -1) - jax.nn.logsumexp(next_logits, -1))
        cur, nxt = select_edits(response, lengths, cur, nxt, cur_score, nxt_score, eos_id=eos_id, k=edits_per_round,
                                threshold=edit_threshold)
    return apply_predictions(response, lengths, cur, nxt, del_id=del_id, eos_id=eos_id, max_len=max_len)


def edit_rounds(model, prompt, prompt_valid, response, lengths, *, rounds: int, del_id: int, eos_id: int,
                max_len: int, banned: tuple[int, ...] = (), edits_per_round: int | None = None,
                edit_threshold: float | None = None):
    """Up to ``rounds`` `edit_round` s in one ``while_loop``, stopping once no row changes.
    Returns ``(response, lengths, edits [B] = rounds that changed the row, forwards)``."""
    B = response.shape[0]

    def cond(c):
        return (c["round"] < rounds) & c["any_changed"]

    def body(c):
        resp, lens, changed = edit_round(model, prompt, prompt_valid, c["resp"], c["lens"], del_id=del_id,
                                         eos_id=eos_id, max_len=max_len, banned=banned,
                                         edits_per_round=edits_per_round, edit_threshold=edit_threshold)
        return {"resp": resp, "lens": lens, "round": c["round"] + 1, "any_changed": jnp.any(changed),
                "edits": c["edits"] + changed.astype(jnp.int32)}

    init = {"resp": response.astype(jnp.int32), "lens": lengths.astype(jnp.int32), "round": jnp.zeros((), jnp.int32),
            "any_changed": jnp.ones((), bool), "edits": jnp.zeros((B,), jnp.int32)}
    out = jax.lax.while_loop(cond, body, init)
    return out["resp"], out["lens"], out["edits"], out["round"]


def fill_masks(model, x: jax.Array, valid: jax.Array, *, mask_id: int, per_step: jax.Array, rng: jax.Array,
               order: str = "random", banned: tuple[int, ...] = ()) -> jax.Array:
    """Every ``mask_id`` slot of ``x [B, T]`` filled by the model's greedy proposals, ``per_step``
    (traced) slots per row and forward: the most confident ones (``order="confidence"``) or
    random ones (``"random"``, ME-DLM's trainer ``mask_diffusion``); ``banned`` ids never proposed."""
    if order not in ("random", "confidence"):
        raise ValueError(f"order={order!r} is invalid: must be 'random' or 'confidence'")
    ids = jnp.asarray(banned, jnp.int32) if banned else None

    def body(c):
        x, i = c
        logits = model.unembed(model.backbone(x, mask=valid).hidden)
        if ids is not None:
            logits = logits.at[..., ids].set(-jnp.inf)
        proposal = argmax_last(logits).astype(jnp.int32)
        masked = x == mask_id
        if order == "confidence":
            score = jnp.take_along_axis(jax.nn.softmax(logits, -1), proposal[..., None], -1)[..., 0]
        else:
            score = jax.random.uniform(jax.random.fold_in(rng, i), x.shape)
        score = jnp.where(masked, score, -jnp.inf)
        rank = jnp.argsort(jnp.argsort(-score, axis=1), axis=1)
        commit = masked & (rank < per_step)
        return jnp.where(commit, proposal, x), i + 1

    x, _ = jax.lax.while_loop(lambda c: jnp.any(c[0] == mask_id), body, (x.astype(jnp.int32), jnp.zeros((), jnp.int32)))
    return x
