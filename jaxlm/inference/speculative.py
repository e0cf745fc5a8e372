"""Speculative decoding inside one compiled loop (Leviathan et al., ICML 2023; Chen et al. 2023).

Each round a draft proposes ``k`` tokens ``d_1..d_k`` with distributions ``q_1..q_k``; the
target scores ``[last, d_1..d_k]`` in one forward, giving ``p_1..p_{k+1}``. Draft ``d_j`` is
accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection a token is
drawn from ``norm(max(0, p_j - q_j))`` and the round ends; if all ``k`` pass, a bonus token is
drawn from ``p_{k+1}``. Every emitted token is then distributed exactly as the target's
(processed) distribution, at any temperature / top-k / top-p. At temperature 0 a draft is
accepted iff it is the target's argmax and the round's last token is the argmax, so the
output is plain greedy decoding token for token.

Rows accept different numbers of drafts: the KV caches keep one write slot per row
(`KVCache.per_row`), and after each round every row is rolled back to its committed
tokens (`KVCache.truncate`: rejected slots become invalid and the next round overwrites
them). The whole decode, drafting included, is one `lax.while_loop`.

Drafts:

* a small jaxlm `Transformer` sharing the target's tokenizer, with its own cache. It is
  fed the round's last two committed tokens (the second-to-last is rewritten in place,
  so the cache never lags behind a fully accepted round) and then its own drafts;
* `MedusaHeads` (Cai et al. 2024, Medusa-1): ``k`` residual blocks on the target's last
  hidden state whose outputs go through the target's unembedding; head ``j`` proposes
  the token ``j`` places after the next one, all in one shot. Trainable
  (`medusa_loss`); a head ``q_j`` may ignore earlier drafts and the acceptance rule stays
  exact, since it holds for any proposal distribution.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxlm.inference.cache import KVCache
from jaxlm.inference.logits_processors import LogitsProcessor, compose
from jaxlm.inference.sampling import _invert_cdf, _select, argmax_last


class MedusaHeads(nnx.Module):
    """``num_heads`` Medusa-1 heads: ``h_j = h + SiLU(W_j h + b_j)``, logits ``= unembed(h_j)``
    through the target's own (frozen) unembedding. ``W_j`` starts at zero, so every head
    starts as the target's next-token head (Medusa's initialisation)."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs | None = None, dtype: Any = jnp.float32):
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads={num_heads!r} is invalid: must be a positive int")
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model={d_model!r} is invalid: must be a positive int")
        self.d_model, self.num_heads = d_model, num_heads
        self.w = nnx.Param(jnp.zeros((num_heads, d_model, d_model), dtype))
        self.b = nnx.Param(jnp.zeros((num_heads, d_model), dtype))

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """``[B, D]`` (final-norm hidden state) -> ``[B, num_heads, D]``."""
        chex.assert_axis_dimension(hidden, -1, self.d_model)
        h = hidden.astype(self.w.dtype)
        z = jnp.einsum("bd,jde->bje", h, self.w[...]) + self.b[...]
        return (h[:, None, :] + jax.nn.silu(z)).astype(hidden.dtype)


def medusa_loss(heads: MedusaHeads, target, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean cross-entropy of head ``j`` (0-based) predicting ``tokens[t + j + 2]`` from the
    target's hidden state at ``t`` (the target's own head predicts ``t + 1``); ``mask [B, T]``
    marks real tokens. The target is frozen (its hidden states are stopped)."""
    B, T = tokens.shape
    hidden = jax.lax.stop_gradient(target.backbone(tokens, mask=mask).hidden)  # [B, T, D]
    out = jax.vmap(heads, in_axes=1, out_axes=1)(hidden)  # [B, T, J, D]
    logits = target.unembed(out)  # [B, T, J, V]
    total, count = 0.0, 0.0
    for j in range(heads.num_heads):
        shift = j + 2
        if shift >= T:
            break
        lg, tgt = logits[:, : T - shift, j], tokens[:, shift:]
        ok = (mask[:, shift:] & mask[:, : T - shift]).astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(lg, tgt)
        total, count = total + jnp.sum(nll * ok), count + jnp.sum(ok)
    return total / jnp.maximum(count, 1.0)


def train_medusa_heads(heads: MedusaHeads, target, batches, *, learning_rate: float = 1e-3, steps: int | None = None):
    """Fit ``heads`` on ``(tokens, mask)`` batches with Adam (the target stays frozen);
    returns the trained heads and the per-step losses."""
    graphdef, params = nnx.split(heads)
    opt = optax.adam(learning_rate)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask):
        loss, grads = jax.value_and_grad(lambda p: medusa_loss(nnx.merge(graphdef, p), target, tokens, mask))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i, (tokens, mask) in enumerate(batches):
        if steps is not None and i >= steps:
            break
        params, opt_state, loss = step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
        losses.append(float(loss))
    return nnx.merge(graphdef, params), losses


@struct.dataclass
class SpeculativeState:
    """The speculative loop's carry; logits processors receive it as ``state``."""

    step: jax.Array  # [] int32: rounds so far
    tokens: jax.Array  # [B, N + k + 1] generated so far (columns >= lengths are scratch)
    logprobs: jax.Array  # [B, N + k + 1] float32 log p_target(token | prefix), raw logits
    sampling_logprobs: jax.Array  # [B, N + k + 1] float32, under the processed distribution
    lengths: jax.Array  # [B] int32 generated tokens so far (stop token included)
    done: jax.Array  # [B] bool
    prompt_lengths: jax.Array  # [B] int32
    last: jax.Array  # [B] int32 the last generated token (not yet in the target's cache)
    prev: jax.Array  # [B] int32 the token before it
    hidden: jax.Array  # [B, D] the target's hidden state that predicted ``last``
    cache: KVCache  # target cache, per-row write slots
    draft_cache: KVCache | None  # draft model cache, per-row write slots (None for heads)
    accepted: jax.Array  # [B, N] int32 drafts accepted in each round (-1: row not active)
    rounds: jax.Array  # [B] int32 verify rounds each row took part in
    rng: jax.Array


def _processed(process, logits, state):
    """Apply the processors to ``[B, J, V]`` logits position by position."""
    return jnp.stack([process(logits[:, j], state) for j in range(logits.shape[1])], axis=1)


def _draw(key, mass):
    """One draw per row from unnormalised ``mass [B, V] >= 0`` (two-level inverse CDF)."""
    B, V = mass.shape
    block = 128
    m = jnp.pad(mass, ((0, 0), (0, (-V) % block))).reshape(B, -1, block)
    k1, k2 = jax.random.split(key)
    chosen = _invert_cdf(k1, m.sum(-1))
    inner = jnp.take_along_axis(m, chosen[:, None, None], axis=1)[:, 0]
    return (chosen * block + _invert_cdf(k2, inner)).astype(jnp.int32)


def _put_rows(buf, block, start):
    """Write ``block [B, W]`` into ``buf [B, C]`` at column ``start[b]`` per row."""
    return jax.vmap(lambda b, x, i: jax.lax.dynamic_update_slice(b, x, (i,)))(buf, block.astype(buf.dtype), start)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "draft_graphdef", "max_new_tokens", "num_draft_tokens", "processors", "greedy",
                     "pad_id", "stop_tokens", "cache_dtype"),
)
def speculative_generate_tokens(
    graphdef,
    params,
    draft_graphdef,
    draft_params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    processors: tuple[LogitsProcessor, ...] = (),
    greedy: bool = False,
    pad_id: int = 0,
    stop_tokens: tuple[int, ...] = (),
    cache_dtype: str | None = None,
) -> SpeculativeState:
    """The jittable core: left-padded ``prompt_tokens [B, P]`` -> final `SpeculativeState`.
    ``draft_graphdef / draft_params``: a split `Transformer` (draft model) or `MedusaHeads`."""
    target = nnx.merge(graphdef, params)
    draft = nnx.merge(draft_graphdef, draft_params)
    heads = isinstance(draft, MedusaHeads)
    B, P = prompt_tokens.shape
    N, k = max_new_tokens, num_draft_tokens
    chex.assert_shape(prompt_mask, (B, P))
    process = compose(processors)
    stop = jnp.asarray(stop_tokens, jnp.int32) if stop_tokens else None
    cols = jnp.arange(k + 1)
    plen = prompt_mask.sum(axis=1, dtype=jnp.int32)

    def init_cache(model):
        c = KVCache.init(model.config, B, P + N + k, cache_dtype, per_layer=not model.config.scan_layers)
        return c

    out = target.backbone(prompt_tokens, cache=init_cache(target), mask=prompt_mask)
    cache = out.cache.per_row()
    hidden = out.hidden[:, -1]
    logits = target.unembed(hidden)
    draft_cache = None
    if not heads:
        dout = draft.backbone(prompt_tokens, cache=init_cache(draft), mask=prompt_mask)
        # the draft rewrites the last prompt token in the first round (see the module docstring)
        draft_cache = dout.cache.per_row().truncate(jnp.full((B,), P - 1, jnp.int32), plen - 1)

    rng, key = (rng, None) if greedy else jax.random.split(rng)
    state0 = SpeculativeState(
        step=jnp.zeros((), jnp.int32), tokens=jnp.full((B, N + k + 1), pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N + k + 1), jnp.float32), sampling_logprobs=jnp.zeros((B, N + k + 1), jnp.float32),
        lengths=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool), prompt_lengths=plen,
        last=prompt_tokens[:, -1], prev=prompt_tokens[:, -1], hidden=hidden, cache=cache, draft_cache=draft_cache,
        accepted=jnp.full((B, N), -1, jnp.int32), rounds=jnp.zeros((B,), jnp.int32), rng=rng,
    )
    first, lp, slp = _select(logits, process(logits, state0), key, greedy, same=not processors)
    done = jnp.zeros((B,), bool) if stop is None else jnp.isin(first, stop)
    state0 = state0.replace(
        tokens=state0.tokens.at[:, 0].set(first), logprobs=state0.logprobs.at[:, 0].set(lp),
        sampling_logprobs=state0.sampling_logprobs.at[:, 0].set(slp), lengths=jnp.ones((B,), jnp.int32),
        done=done | (N <= 1), last=first,
    )

    def propose(s: SpeculativeState, key):
        """k drafted tokens ``[B, k]``, their processed draft logits ``[B, k, V]`` and the draft cache."""
        if heads:
            q_logits = _processed(process, target.unembed(draft(s.hidden)[:, :k]), s)
            if greedy:
                return argmax_last(q_logits), q_logits, None
            keys = jax.random.split(key, k)
            d = jnp.stack([_draw(keys[j], jax.nn.softmax(q_logits[:, j], -1)) for j in range(k)], axis=1)
            return d, q_logits, None
        dout = draft.backbone(jnp.stack([s.prev, s.last], axis=1), cache=s.draft_cache)
        logits = draft.unembed(dout.hidden[:, -1])
        keys = jax.random.split(key, k) if not greedy else [None] * k

        def pick(logits, key):
            q = process(logits, s)
            tok = argmax_last(q) if greedy else _draw(key, jax.nn.softmax(q, -1))
            return tok, q

        def one(carry, key):
            dcache, logits = carry
            tok, q = pick(logits, key)
            o = draft.backbone(tok[:, None], cache=dcache)
            return (o.cache, draft.unembed(o.hidden[:, 0])), (tok, q)

        scan_keys = jnp.zeros((k - 1,), jnp.uint32) if greedy else keys[: k - 1]
        (dcache, logits), (toks, qs) = jax.lax.scan(
            lambda c, kk: one(c, None if greedy else kk), (dout.cache, logits), scan_keys, length=k - 1)
        tok_k, q_k = pick(logits, None if greedy else keys[k - 1])
        drafts = jnp.concatenate([toks.T, tok_k[:, None]], axis=1)
        q_all = jnp.concatenate([jnp.swapaxes(qs, 0, 1), q_k[:, None]], axis=1)
        return drafts, q_all, dcache

    def body(s: SpeculativeState) -> SpeculativeState:
        if greedy:
            rng, k_draft, k_acc, k_res = s.rng, None, None, None
        else:
            rng, k_draft, k_acc, k_res = jax.random.split(s.rng, 4)
        drafts, q_logits, dcache = propose(s, k_draft)
        vout = target.backbone(jnp.concatenate([s.last[:, None], drafts], axis=1), cache=s.cache)
        raw = target.unembed(vout.hidden)  # [B, k + 1, V]
        p_logits = _processed(process, raw, s)
        if greedy:
            target_tok = jnp.argmax(p_logits, -1).astype(jnp.int32)  # [B, k + 1]
            ok = drafts == target_tok[:, :k]
        else:
            p = jax.nn.softmax(p_logits, -1)
            q = jax.nn.softmax(q_logits, -1)
            pick = lambda x: jnp.take_along_axis(x, drafts[..., None], -1)[..., 0]  # noqa: E731
            u = jax.random.uniform(k_acc, (B, k), jnp.float32)
            ok = u * pick(q) < pick(p[:, :k])  # accept with probability min(1, p / q)
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # drafts accepted [B]
        if greedy:
            new = jnp.take_along_axis(target_tok, n[:, None], 1)[:, 0]
        else:
            p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
            q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # bonus: q = 0
            q_n = jnp.take_along_axis(q_pad, n[:, None, None], 1)[:, 0]
            residual = jnp.maximum(p_n - q_n, 0.0)
            residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
            new = _draw(k_res, residual)
        drafts_pad = jnp.concatenate([drafts, jnp.full((B, 1), pad_id, jnp.int32)], axis=1)
        seq = jnp.where(cols < n[:, None], drafts_pad, jnp.where(cols == n[:, None], new[:, None], pad_id))
        count = n + 1
        if stop is not None:
            is_stop = jnp.isin(seq, stop) & (cols <= n[:, None])
            first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), k + 1)
            count = jnp.minimum(count, first_stop + 1)
        count = jnp.where(s.done, 0, jnp.minimum(count, N - s.lengths))
        stopped = jnp.zeros((B,), bool) if stop is None else jnp.any(
            jnp.isin(seq, stop) & (cols < count[:, None]), 1)
        lp_raw = jnp.take_along_axis(jax.nn.log_softmax(raw, -1), seq[..., None], -1)[..., 0]
        lp_smp = lp_raw if not processors else jnp.take_along_axis(
            jax.nn.log_softmax(p_logits, -1), seq[..., None], -1)[..., 0]
        keep = cols < count[:, None]
        lengths = s.lengths + count
        idx = jnp.maximum(count - 1, 0)
        at = lambda x, i: jnp.take_along_axis(x, i[:, None], 1)[:, 0]  # noqa: E731
        active = count > 0
        last = jnp.where(active, at(seq, idx), s.last)
        prev = jnp.where(count >= 2, at(seq, jnp.maximum(count - 2, 0)), jnp.where(active, s.last, s.prev))
        hidden = jnp.where(active[:, None], jnp.take_along_axis(vout.hidden, idx[:, None, None], 1)[:, 0], s.hidden)
        cache = vout.cache.truncate(s.cache.end_index + count, s.cache.lengths + count)
        if dcache is not None:
            dcache = dcache.truncate(s.draft_cache.end_index + count, s.draft_cache.lengths + count)
        rounds_col = jnp.minimum(s.rounds, N - 1)
        return s.replace(
            step=s.step + 1,
            tokens=_put_rows(s.tokens, jnp.where(keep, seq, pad_id), s.lengths),
            logprobs=_put_rows(s.logprobs, jnp.where(keep, lp_raw, 0.0), s.lengths),
            sampling_logprobs=_put_rows(s.sampling_logprobs, jnp.where(keep, lp_smp, 0.0), s.lengths),
            lengths=lengths, done=s.done | stopped | (lengths >= N), last=last, prev=prev, hidden=hidden,
            cache=cache, draft_cache=dcache,
            accepted=jnp.where(active[:, None] & (jnp.arange(N)[None] == rounds_col[:, None]),
                               jnp.minimum(n, count - 1)[:, None], s.accepted),
            rounds=s.rounds + active.astype(jnp.int32), rng=rng,
        )

    def cond(s):
        return (s.step < N) & ~jnp.all(s.done)

    final = jax.lax.while_loop(cond, body, state0)
    cols_n = jnp.arange(N + k + 1)[None]
    real = cols_n < final.lengths[:, None]
    return final.replace(
        tokens=jnp.where(real, final.tokens, pad_id), logprobs=jnp.where(real, final.logprobs, 0.0),
        sampling_logprobs=jnp.where(real, final.sampling_logprobs, 0.0),
    )


_PROBE = "The quick brown fox, 1234 + 5678 = 6912! éè 漢字 <tag> {\"k\": [1, 2]}\n\t"


def _same_tokenizer(a, b) -> bool:
    """Whether two tokenizers agree on special ids and on the encoding of a varied probe text."""
    if a is None or b is None or a is b:
        return True
    if any(getattr(a, n, None) != getattr(b, n, None) for n in ("bos_id", "eos_id", "pad_id")):
        return False
    try:
        return list(a.encode(_PROBE)) == list(b.encode(_PROBE))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode the probe is not the same one
        return False


def check_draft(target, draft, num_draft_tokens, *, longest_prompt: int, max_new_tokens: int, tokenizer=None) -> int:
    """Clear errors for a draft that cannot serve ``target``: another vocabulary or tokenizer,
    ``num_draft_tokens`` < 1 or more than the heads, or a cache too short for the drafts.
    Returns the smallest ``max_seq_len`` of the models that keep a cache."""
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r} is invalid: must be an int >= 1")
    need = longest_prompt + max_new_tokens + num_draft_tokens
    if isinstance(draft, MedusaHeads):
        if draft.d_model != target.config.d_model:
            raise ValueError(f"draft heads have d_model={draft.d_model} but the target has "
                             f"d_model={target.config.d_model}")
        if num_draft_tokens > draft.num_heads:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the draft's num_heads={draft.num_heads}")
        models = [("target", target)]
    elif hasattr(draft, "config") and hasattr(draft, "backbone"):
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft vocab_size={draft.config.vocab_size} differs from the target's "
                             f"vocab_size={target.config.vocab_size}: the draft must share the tokenizer")
        if not _same_tokenizer(tokenizer, getattr(draft, "tokenizer", None)):
            raise ValueError("draft tokenizer differs from the target's (special ids or encodings disagree): "
                             "the draft must share the tokenizer")
        models = [("target", target), ("draft", draft)]
    else:
        raise TypeError(f"draft must be a jaxlm Transformer or MedusaHeads, got {type(draft).__name__}")
    for name, m in models:
        if need > m.config.max_seq_len:
            raise ValueError(
                f"prompt length {longest_prompt} + max_new_tokens {max_new_tokens} + num_draft_tokens "
                f"{num_draft_tokens} = {need} exceeds the {name}'s ModelConfig.max_seq_len={m.config.max_seq_len} "
                "(the verify step writes num_draft_tokens past the last token): lower num_draft_tokens or "
                "max_new_tokens")
    return min(m.config.max_seq_len for _, m in models)
