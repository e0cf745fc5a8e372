"""Rollouts as training rows, and log-probs of rows under a set of parameters.

A batch of rollouts is a dict of host arrays, one row per rollout (row ``b * G + g`` is
prompt b's g-th completion), every row ``T`` tokens long::

    tokens        int32 [R, T]  prompt (left-padded to a fixed block) then what followed
    attend        bool  [R, T]  real tokens (padding is neither attended to nor trained)
    positions     int32 [R, T]
    loss_mask     bool  [R, T]  token t was produced by the policy: it is a trained target
    sampler_logp  f32   [R, T]  log-prob the sampler gave token t (0 where not sampled)
    turn          int32 [R, T]  turn index of token t (multi-turn; 0 for single-turn)
    prompt_index  int32 [R]     which prompt the row continues (single-turn rows: ``b``)

Rows that continue the same prompt share their first ``prompt_block`` columns. With
``algorithm.shared_prompt_forward`` the log-probs are computed from one forward of each
distinct prompt (its keys/values gathered into every row that continues it) followed by a
forward of the rows' remaining columns: the same function, with the prompt's share of the
forward and backward done once per prompt instead of once per rollout.

Environment tokens of multi-turn rollouts and PrefixRL's prefix live in ``tokens`` with
``loss_mask = 0``: they are context, never targets and never in an importance ratio.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxlm.inference.cache import batch_axis
from jaxlm.inference.logits_processors import Temperature, TopP
from jaxlm.inference.sampler import generate_tokens
from jaxlm.models.logprobs import token_entropy, token_logprobs, unembedding
from jaxlm.sharding import to_host


def left_pad(token_lists: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> a left-padded ``[n, width]`` block and its mask."""
    block = np.full((len(token_lists), width), pad_id, np.int32)
    mask = np.zeros((len(token_lists), width), bool)
    for i, ids in enumerate(token_lists):
        if len(ids) > width:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens > the prompt block of {width} "
                f"(data.seq_len - algorithm.max_new_tokens); raise data.seq_len"
            )
        if ids:
            block[i, width - len(ids):] = ids
            mask[i, width - len(ids):] = True
    return block, mask


def positions_of(attend: np.ndarray) -> np.ndarray:
    return np.maximum(np.cumsum(attend, axis=1) - 1, 0).astype(np.int32)


def divides_rows(sharding: NamedSharding, rows: int) -> bool:
    """Whether ``rows`` split evenly over the devices ``sharding`` puts its first axis on."""
    spec = tuple(sharding.spec)
    axes = spec[0] if spec else None
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return rows % int(np.prod([sharding.mesh.shape[n] for n in names], dtype=int)) == 0


def sample_block(graphdef, params, block, mask, rng, *, max_new_tokens: int, temperature: float,
                 top_p: float | None, pad_id: int, stop_tokens: tuple[int, ...], samples_per_prompt: int = 1,
                 prompt_sharding: NamedSharding | None = None):
    """The KV-cache sampler on a left-padded ``block`` at ``temperature`` (0 = greedy) and
    ``top_p``: its final `SamplingState` (``samples_per_prompt`` rows per prompt, each prompt
    prefilled once). ``prompt_sharding``: where the prompt rows go (e.g. split over a mesh's
    data-parallel devices, so each device decodes its own prompts); ignored when the number
    of prompts does not divide over it (the prompts are then not split). The state carries no
    KV cache (``cache`` is None)."""
    block, mask = jnp.asarray(block), jnp.asarray(mask)
    if prompt_sharding is not None and divides_rows(prompt_sharding, block.shape[0]):
        block, mask = jax.device_put(block, prompt_sharding), jax.device_put(mask, prompt_sharding)
    processors = []
    if temperature not in (0, 1):
        processors.append(Temperature(float(temperature)))
    if top_p is not None and top_p != 1:
        processors.append(TopP(float(top_p)))
    return generate_tokens(
        graphdef, params, block, mask, rng, max_new_tokens=max_new_tokens,
        processors=tuple(processors), greedy=temperature == 0, pad_id=pad_id, stop_tokens=stop_tokens,
        samples_per_prompt=samples_per_prompt, return_cache=False,
    )


def sample_rollouts(
    graphdef, params, prompt_ids: Sequence[Sequence[int]], *, num_generations: int, prompt_block: int,
    max_new_tokens: int, temperature: float, top_p: float | None, rng: jax.Array, pad_id: int,
    stop_tokens: tuple[int, ...], prompt_sharding: NamedSharding | None = None,
) -> dict[str, np.ndarray]:
    """``G`` sampled completions per prompt (``jaxlm``'s KV-cache sampler) as training rows,
    with ``lengths [R]`` (completion tokens, stop token included) and ``completion [R, N]``.
    ``prompt_sharding``: as for `sample_block`."""
    G = num_generations
    unique, unique_mask = left_pad(prompt_ids, prompt_block, pad_id)
    final = sample_block(graphdef, params, unique, unique_mask, rng, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, pad_id=pad_id, stop_tokens=stop_tokens,
                         samples_per_prompt=G, prompt_sharding=prompt_sharding)
    block, mask = np.repeat(unique, G, axis=0), np.repeat(unique_mask, G, axis=0)
    completion, logp, lengths = to_host((final.tokens, final.logprobs, final.lengths))
    N = max_new_tokens
    produced = np.arange(N)[None, :] < lengths[:, None]
    zeros_p = np.zeros_like(mask)
    attend = np.concatenate([mask, produced], 1)
    return {
        "tokens": np.concatenate([block, completion], 1).astype(np.int32),
        "attend": attend,
        "positions": positions_of(attend),
        "loss_mask": np.concatenate([zeros_p, produced], 1),
        "sampler_logp": np.concatenate([np.zeros(mask.shape, np.float32), np.where(produced, logp, 0.0)], 1)
        .astype(np.float32),
        "turn": np.zeros(attend.shape, np.int32),
        "prompt_index": np.repeat(np.arange(len(prompt_ids)), G).astype(np.int32),
        "lengths": lengths.astype(np.int32),
        "completion": completion.astype(np.int32),
    }


def shared_prompts(rows: dict[str, np.ndarray], prompt_block: int) -> dict[str, np.ndarray]:
    """The distinct prompts of ``rows`` as ``{tokens, attend, positions} [U, prompt_block]``
    (``U = max(prompt_index) + 1``), checked to be what every row that names them starts with."""
    idx = rows["prompt_index"]
    U = int(idx.max()) + 1
    first = np.zeros(U, np.int64)
    first[idx[::-1]] = np.arange(len(idx))[::-1]  # first row of each prompt
    out = {}
    for k in ("tokens", "attend", "positions"):
        block = rows[k][:, :prompt_block]
        out[k] = block[first]
        if not np.array_equal(out[k][idx], block):
            raise ValueError(
                f"algorithm.shared_prompt_forward: rows with the same prompt_index differ in their "
                f"first {prompt_block} columns of {k!r}; this collector's rows do not share a prompt block"
            )
    return out


def _shared_prompt_hidden(model, batch):
    """Final hidden states ``[R, T, D]`` of the rows, with each distinct prompt of
    ``batch["prompts"]`` run once: its keys/values (a KV cache of ``U`` rows) are gathered
    by ``batch["prompt_index"]`` and the rows' remaining columns attend to them. Gradients
    flow back through the gather (summed over the rows of a prompt)."""
    p, idx = batch["prompts"], batch["prompt_index"]
    tokens = batch["tokens"]
    R, T = tokens.shape
    U, W = p["tokens"].shape
    pre = model.backbone(p["tokens"], p["positions"], cache=model.init_cache(U, T), mask=p["attend"])
    c = pre.cache
    take = lambda x: jnp.take(x, idx, axis=batch_axis(x))  # noqa: E731 (stacked or per-layer cache)
    gathered = c.replace(k=jax.tree.map(take, c.k), v=jax.tree.map(take, c.v),
                         valid=jnp.take(c.valid, idx, axis=0), lengths=jnp.take(c.lengths, idx, axis=0))
    rest = model.backbone(tokens[:, W:], batch["positions"][:, W:], cache=gathered, mask=batch["attend"][:, W:])
    return jnp.concatenate([jnp.take(pre.hidden, idx, axis=0), rest.hidden], axis=1)


def row_logprobs(model, batch, *, chunk: int = 256, entropy: bool = False):
    """``logp [R, T]``: ``log pi(tokens[t] | tokens[<t])`` (0 at t = 0), computed from the
    hidden states ``chunk`` rows of logits at a time (never a whole ``[R, T, V]``); with
    ``entropy``, also the policy entropy at the positions that predict each token. A batch
    with ``prompts`` (`shared_prompts`) runs each distinct prompt once."""
    tokens = batch["tokens"]
    if "prompts" in batch:
        hidden = _shared_prompt_hidden(model, batch)
    else:
        hidden = model.backbone(tokens, batch["positions"], mask=batch["attend"]).hidden
    h = hidden[:, :-1]
    w = unembedding(model)
    lp = token_logprobs(h, w, tokens[:, 1:], chunk=chunk)
    lp = jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)
    if not entropy:
        return lp
    ent = token_entropy(h, w, chunk=chunk)
    return lp, jnp.concatenate([jnp.zeros_like(ent[:, :1]), ent], axis=1)


def make_logprob_fn(graphdef, *, chunk: int = 256):
    """Jitted ``(params, batch) -> (logp [R, T], entropy [R, T])`` (no gradient)."""

    @jax.jit
    def fn(params, batch):
        model = nnx.merge(graphdef, params)
        return row_logprobs(model, batch, chunk=chunk, entropy=True)

    return fn
