"""Batched next-token scoring of texts with a jaxlm model: the log-probabilities of a few
candidate tokens (verdict letters, "yes"/"no") right after each prompt, from one left-padded
forward per batch. The primitive that judges, correctness models and reward checks share.

`branched_candidate_logprobs` scores groups of prompts that share a beginning (a pairwise
judge's two response orders share the instructions and the question): the common token
prefix of each group is run once into a KV cache, the cache is repeated for the group's
branches, and only the differing suffixes are run, in the same call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.inference.cache import KVCache, batch_axis


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _candidate_logprobs(graphdef, state, tokens, mask, candidates):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    hidden = model.backbone(tokens, positions, mask=mask).hidden[:, -1]  # unembed the last position only
    logp = jax.nn.log_softmax(model.unembed(hidden).astype(jnp.float32), axis=-1)
    return jnp.take(logp, candidates, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "branches"))
def _branched_logprobs(graphdef, state, prefix, prefix_mask, suffix, suffix_mask, candidates, branches):
    model = nnx.merge(graphdef, state)
    B, P = prefix.shape
    cache = KVCache.init(model.config, B, P + suffix.shape[1])
    c = model.backbone(prefix, cache=cache, mask=prefix_mask).cache
    c = c.replace(k=jax.tree.map(lambda x: jnp.repeat(x, branches, axis=batch_axis(x)), c.k),
                  v=jax.tree.map(lambda x: jnp.repeat(x, branches, axis=batch_axis(x)), c.v),
                  valid=jnp.repeat(c.valid, branches, axis=0), lengths=jnp.repeat(c.lengths, branches, axis=0))
    hidden = model.backbone(suffix, cache=c, mask=suffix_mask).hidden[:, -1]
    logp = jax.nn.log_softmax(model.unembed(hidden).astype(jnp.float32), axis=-1)
    return jnp.take(logp, candidates, axis=-1).reshape(B, branches, -1)


def _check_candidates(model, candidates) -> np.ndarray:
    V = model.config.vocab_size
    cand = np.asarray(candidates, np.int32).ravel()
    if cand.size == 0:
        raise ValueError("candidates is empty: name at least one token id to score")
    if cand.min() < 0 or cand.max() >= V:
        raise ValueError(f"candidate token ids must lie in [0, {V}), got {cand.tolist()}")
    return cand


def _check_batching(batch_size, bucket) -> None:
    for name, v in (("batch_size", batch_size), ("bucket", bucket)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name}={v!r} is invalid: must be an int >= 1")


def _left_pad(rows: list[list[int]], width: int, n_rows: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((n_rows, width), pad, np.int32)
    mask = np.zeros((n_rows, width), bool)
    for r, ids in enumerate(rows):
        if ids:
            tokens[r, width - len(ids):] = ids
            mask[r, width - len(ids):] = True
    return tokens, mask


def branched_candidate_logprobs(model, groups: Sequence[Sequence[str]] | Sequence[Sequence[Sequence[int]]],
                                candidates: Sequence[int], *, batch_size: int = 16, bucket: int = 16,
                                add_bos: bool = True) -> np.ndarray:
    """``[N, G, K]``: `candidate_logprobs` of each of the ``G`` prompts of each group, with the
    group's common token prefix computed once (module docstring). Every group has ``G``
    prompts; identical prompts are fine (each branch keeps at least its last token)."""
    cand = _check_candidates(model, candidates)
    _check_batching(batch_size, bucket)
    if not len(groups):
        return np.zeros((0, 0, cand.size), np.float32)
    G = len(groups[0])
    if G < 1 or any(len(g) != G for g in groups):
        raise ValueError(f"every group must hold the same number (>= 1) of prompts, got {sorted({len(g) for g in groups})}")
    tok = model.tokenizer
    encoded = [encode_prompts(tok, list(g), add_bos=add_bos, vocab_size=model.config.vocab_size) for g in groups]
    heads, tails = [], []
    for ids in encoded:
        n = min(map(len, ids)) - 1  # each branch keeps at least one token of its own
        common = 0
        while common < n and all(x[common] == ids[0][common] for x in ids):
            common += 1
        heads.append(ids[0][:common])
        tails.append([x[common:] for x in ids])
    pad = getattr(tok, "pad_id", None) or 0
    graphdef, state = nnx.split(model)
    out = np.zeros((len(groups), G, cand.size), np.float32)
    limit = model.config.max_seq_len
    tail_len = [max(map(len, t)) for t in tails]
    for i, ids in enumerate(encoded):
        if len(heads[i]) + tail_len[i] > limit:
            raise ValueError(f"group {i}: a prompt of {max(map(len, ids))} tokens exceeds "
                             f"ModelConfig.max_seq_len={limit}")
    order = sorted(range(len(groups)), key=lambda i: (len(heads[i]), tail_len[i]))
    # batches of up to batch_size groups whose longest prefix + longest suffix fit the model
    # (one group always does; two that fit alone may not fit together)
    batches: list[list[int]] = []
    for i in order:
        b = batches[-1] if batches else None
        if (b is None or len(b) == batch_size
                or max(len(heads[j]) for j in b + [i]) + max(tail_len[j] for j in b + [i]) > limit):
            batches.append([i])
        else:
            b.append(i)
    for idx in batches:
        rows = len(idx) if len(order) <= batch_size else batch_size
        P, S = max(len(heads[i]) for i in idx), max(tail_len[i] for i in idx)
        if _bucket(P, bucket) + _bucket(S, bucket) <= limit:  # padded shapes, reused across calls
            P, S = _bucket(P, bucket), _bucket(S, bucket)
        P = max(P, 1)
        prefix, prefix_mask = _left_pad([heads[i] for i in idx], P, rows, pad)
        suffix, suffix_mask = _left_pad([t for i in idx for t in tails[i]], S, rows * G, pad)
        suffix_mask[len(idx) * G:, -1] = True  # filler rows score a pad token; their output is dropped
        got = _branched_logprobs(graphdef, state, jnp.asarray(prefix), jnp.asarray(prefix_mask), jnp.asarray(suffix),
                                 jnp.asarray(suffix_mask), jnp.asarray(cand), G)
        chex.assert_shape(got, (rows, G, cand.size))
        out[idx] = np.asarray(got)[: len(idx)]
    return out


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], *, add_bos: bool = True,
                   vocab_size: int | None = None) -> list[list[int]]:
    """Token lists of ``prompts`` (text encoded with ``tokenizer``, BOS first when it has one).
    Prompts given as token ids must hold ints, in ``[0, vocab_size)`` when it is given (an id
    past the vocabulary gave NaN log-probs, a negative one wrapped around, a float was cut)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the model has none): pass token ids")
            ids = tokenizer.encode(p, add_bos=add_bos and getattr(tokenizer, "bos_id", None) is not None)
        else:
            bad = [t for t in p if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
            if bad:
                raise ValueError(f"prompt {i} holds {bad[0]!r}: token-id prompts must hold ints")
            ids = [int(t) for t in p]
            out_of_range = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if out_of_range:
                allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"prompt {i} holds token id {out_of_range[0]}: ids must be {allowed}")
        if not ids:
            raise ValueError(f"prompt {i} is empty: nothing to condition the next token on")
        out.append(ids)
    return out


def candidate_logprobs(model, prompts: Sequence[str] | Sequence[Sequence[int]], candidates: Sequence[int], *,
                       batch_size: int = 32, bucket: int = 16, add_bos: bool = True) -> np.ndarray:
    """``[N, K]``: ``log p(candidates[k] | prompts[n])`` under ``model`` (full-vocabulary
    log-softmax, not renormalised). Prompts of any lengths are left-padded to a multiple of
    ``bucket`` and run ``batch_size`` at a time (one compilation per padded shape)."""
    cand = _check_candidates(model, candidates)
    _check_batching(batch_size, bucket)
    tok = model.tokenizer
    ids = encode_prompts(tok, prompts, add_bos=add_bos, vocab_size=model.config.vocab_size)
    limit = model.config.max_seq_len
    over = [i for i, x in enumerate(ids) if len(x) > limit]
    if over:  # positions past the model's length: numbers, but not ones it was built for
        raise ValueError(f"prompt {over[0]} has {len(ids[over[0]])} tokens, more than ModelConfig.max_seq_len={limit}"
                         f" ({len(over)} prompt(s) too long)")
    pad = getattr(tok, "pad_id", None) or 0
    graphdef, state = nnx.split(model)
    out = np.zeros((len(ids), cand.size), np.float32)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        T = min(_bucket(max(len(ids[i]) for i in idx), bucket), limit)
        rows = len(idx) if len(order) <= batch_size else batch_size  # one shape per bucket
        tokens = np.full((rows, T), pad, np.int32)
        mask = np.zeros((rows, T), bool)
        for r, i in enumerate(idx):
            tokens[r, T - len(ids[i]):] = ids[i]
            mask[r, T - len(ids[i]):] = True
        mask[len(idx):, -1] = True  # filler rows score a pad token; their output is dropped
        got = _candidate_logprobs(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(cand))
        chex.assert_shape(got, (rows, cand.size))
        out[idx] = np.asarray(got)[: len(idx)]
    return out


def single_token_id(tokenizer, text: str, *, field: str = "verdict") -> int:
    """The id of ``text`` when it encodes to exactly one token; a clear error otherwise."""
    if tokenizer is None:
        raise ValueError(f"{field} {text!r} needs a tokenizer to resolve its token id")
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise ValueError(f"{field} {text!r} encodes to {len(ids)} tokens {ids}; a verdict must be one token "
                         "(pick another string, e.g. without a leading space)")
    return int(ids[0])
