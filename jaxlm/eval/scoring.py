"""Batched next-token scoring of texts with a jaxlm model: the log-probabilities of a few
candidate tokens (verdict letters, "yes"/"no") right after each prompt, from one left-padded
forward per batch. The primitive that judges, correctness models and reward checks share.
"""

from __future__ import annotations

import functools
from typing import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _candidate_logprobs(graphdef, state, tokens, mask, candidates):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits = model(tokens, positions, mask=mask).logits[:, -1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take(logp, candidates, axis=-1)


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], *, add_bos: bool = True
                   ) -> list[list[int]]:
    """Token lists of ``prompts`` (text encoded with ``tokenizer``, BOS first when it has one)."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the model has none): pass token ids")
            ids = tokenizer.encode(p, add_bos=add_bos and getattr(tokenizer, "bos_id", None) is not None)
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: nothing to condition the next token on")
        out.append(ids)
    return out


def candidate_logprobs(model, prompts: Sequence[str] | Sequence[Sequence[int]], candidates: Sequence[int], *,
                       batch_size: int = 32, bucket: int = 16, add_bos: bool = True) -> np.ndarray:
    """``[N, K]``: ``log p(candidates[k] | prompts[n])`` under ``model`` (full-vocabulary
    log-softmax, not renormalised). Prompts of any lengths are left-padded to a multiple of
    ``bucket`` and run ``batch_size`` at a time (one compilation per padded shape)."""
    V = model.config.vocab_size
    cand = np.asarray(candidates, np.int32).ravel()
    if cand.size == 0:
        raise ValueError("candidates is empty: name at least one token id to score")
    if cand.min() < 0 or cand.max() >= V:
        raise ValueError(f"candidate token ids must lie in [0, {V}), got {cand.tolist()}")
    tok = model.tokenizer
    ids = encode_prompts(tok, prompts, add_bos=add_bos)
    pad = getattr(tok, "pad_id", None) or 0
    graphdef, state = nnx.split(model)
    out = np.zeros((len(ids), cand.size), np.float32)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        T = _bucket(max(len(ids[i]) for i in idx), bucket)
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
