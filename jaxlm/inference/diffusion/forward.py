"""Forward passes of a masked diffusion LM over ``x = [prompt, response]`` that reuse work
across denoising steps, and their matmul FLOPs.

* `full_forward`: the model's own forward (bidirectional), optionally collecting every
  layer's keys, values and attention / MLP sub-layer outputs (outputs before the residual
  add) as the caches below.
* `span_forward`: only the query slots of a span go through the layers; their keys and
  values are written into the cached ones and they attend over all slots. Fast-dLLM's
  block-wise caches (Wu et al. 2025): the prefix cache queries the current block and
  everything after it, the dual cache only the current block.
* `dllm_cache_forward`: dLLM-Cache (Liu et al. 2025, ``cache_hook_LLaDA.py``): the prompt
  is recomputed every ``K_p`` forwards, the response every ``K_r``; the first layer always
  recomputes; in between, the adaptive partial update recomputes only the ``floor(rho * L_gen)``
  response tokens whose value vectors moved most (lowest cosine similarity to the cached
  ones), all cached response values being replaced by the new ones.

Caches are a dict of ``[L, B, T, ...]`` arrays over the whole sequence: ``k`` / ``v`` (post-
RoPE keys and values ``[.., K, H]``), ``attn`` / ``mlp`` (sub-layer outputs ``[.., D]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.taps import Taps

CACHE_TAPS = ("k_rot", "v", "attn_out", "mlp_out")
_NO_TAPS = frozenset()


@dataclasses.dataclass(frozen=True)
class DLLMCache:
    """dLLM-Cache's schedule (the LLaDA-8B-Instruct GSM8K script: K_p 50, K_r 7, rho 0.25)."""

    prompt_interval: int = 50
    """K_p: the prompt is recomputed at steps 0, K_p, 2 K_p, ... (one cached model call per step;
    guidance batches its two rows into it, a Slow-Fast probe runs uncached)."""
    gen_interval: int = 7
    """K_r: the response is recomputed at steps 0, K_r, 2 K_r, ..."""
    transfer_ratio: float = 0.25
    """rho: fraction of response tokens the adaptive partial update recomputes in between."""

    def __post_init__(self):
        for name in ("prompt_interval", "gen_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DLLMCache.{name}={v!r} is invalid: must be a positive int")
        r = self.transfer_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"DLLMCache.transfer_ratio={r!r} is invalid: must be in [0, 1]")

    def mode(self, forward_index) -> jax.Array:
        """0 = both refresh (full), 1 = response only, 2 = prompt only, 3 = neither (partial
        update only), for the 0-based step ``forward_index``."""
        p = forward_index % self.prompt_interval == 0
        g = forward_index % self.gen_interval == 0
        return jnp.where(p & g, 0, jnp.where(g, 1, jnp.where(p, 2, 3))).astype(jnp.int32)


def check_cacheable(config) -> None:
    """The cached forwards rebuild attention from post-RoPE keys and values: configurations
    whose keys or values change after the `Attention.project` taps are refused."""
    if config.kv_quant is not None:
        raise ValueError(f"ModelConfig.kv_quant={config.kv_quant!r} is not supported by the cached diffusion "
                         "forwards (the cache would keep unquantized values); use cache=None")
    if config.per_layer_kv:
        raise ValueError("per-layer key/value widths are not supported by the cached diffusion forwards; "
                         "use cache=None")
    if config.mlp != "swiglu":
        raise ValueError(f"ModelConfig.mlp={config.mlp!r} is not supported by the cached diffusion forwards "
                         "(only 'swiglu'); use cache=None")


def blocks(model) -> list:
    """The model's blocks as modules (a scanned stack is sliced per layer)."""
    if not model.config.scan_layers:
        return list(model.layers)
    graphdef, state = nnx.split(model.layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(model.config.n_layers)]


def embed(model, tokens):
    return jnp.take(model.embed[...], tokens, axis=0).astype(model.config.compute_dtype)


def positions_of(valid: jax.Array) -> jax.Array:
    """Position of each slot of a left-padded row: 0 at its first real token."""
    return jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)


def full_forward(model, tokens, valid, *, start: int, collect: bool):
    """The model's forward on ``tokens [B, T]`` (padding keys hidden): response logits
    ``[B, T - start, V]`` and, with ``collect``, the caches."""
    out = model.backbone(tokens, mask=valid, collect=CACHE_TAPS if collect else ())
    logits = model.unembed(out.hidden[:, start:])
    caches = None
    if collect:
        c = out.collected
        caches = {"k": c["k_rot"], "v": c["v"], "attn": c["attn_out"], "mlp": c["mlp_out"]}
    return logits, caches


def _scatter(buf, slots, values):
    """``buf [B, T, ...]`` with rows' ``slots [B, n]`` set to ``values [B, n, ...]``."""
    return jax.vmap(lambda b, i, u: b.at[i].set(u))(buf, slots, values)


def _gather(buf, slots):
    return jax.vmap(lambda b, i: b[i])(buf, slots)


def layer_queries(block, x_q, pos_q, slots, k, v, key_valid):
    """One block for the query tokens ``x_q [B, n, D]`` (residual stream) at ``slots [B, n]``:
    their keys/values are written into ``k``, ``v [B, T, K, H]`` and they attend to every
    valid slot. Returns ``(attn_out, mlp_out, k, v)`` (sub-layer outputs before the residual add)."""
    B, n, _ = x_q.shape
    h = block.attn_norm(x_q)
    q, kq, vq = block.attn.project(h, pos_q, Taps(_NO_TAPS))
    k = _scatter(k, slots, kq.transpose(0, 2, 1, 3).astype(k.dtype))
    v = _scatter(v, slots, vq.transpose(0, 2, 1, 3).astype(v.dtype))
    mask = jnp.broadcast_to(key_valid[:, None, None, :], (B, 1, n, key_valid.shape[1]))
    ctx, _ = block.attn.attend(q, k.transpose(0, 2, 1, 3).astype(q.dtype), v.transpose(0, 2, 1, 3).astype(q.dtype),
                               mask, inputs=h, need_probs=False)
    a = block.attn.o_proj(ctx.reshape(B, n, -1))
    m = block.mlp(block.mlp_norm(x_q + a), Taps(_NO_TAPS), {"meta": None})
    return a, m, k, v


def span_forward(model, tokens, valid, caches, *, start, size: int):
    """Logits ``[B, size, V]`` of the slots ``[start, start + size)`` (``start`` may be
    traced) when only they go through the layers, over the cached keys/values of the rest."""
    B, T = tokens.shape
    slots = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32), (B, size))
    x = embed(model, _gather(tokens, slots))
    pos = _gather(positions_of(valid), slots)
    for i, block in enumerate(blocks(model)):
        a, m, _, _ = layer_queries(block, x, pos, slots, caches["k"][i], caches["v"][i], valid)
        x = x + a + m
    return model.unembed(model.final_norm(x))


def dllm_cache_forward(model, tokens, valid, caches, mode, *, prompt_len: int, transfer_ratio: float):
    """Response logits ``[B, T - prompt_len, V]`` and the updated caches for one forward in
    dLLM-Cache ``mode`` 1 (response refresh), 2 (prompt refresh + partial update) or 3
    (partial update only), a static int (`DLLMCache.mode`; mode 0 is `full_forward`)."""
    B, T = tokens.shape
    P, G = prompt_len, T - prompt_len
    pos = positions_of(valid)
    x = embed(model, tokens)
    all_slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    gen_slots, prompt_slots = all_slots[:, P:], all_slots[:, :P]
    # the adaptive partial update runs only for 0 < ratio <= 1 (at ratio 0 the response's
    # values stay as of its last refresh); it may choose no token when G * ratio < 1
    transfer = mode != 1 and 0 < transfer_ratio <= 1
    k_top = int(G * transfer_ratio) if transfer else 0
    new = {name: [] for name in caches}
    for i, block in enumerate(blocks(model)):
        k, v, attn, mlp = (caches[name][i] for name in ("k", "v", "attn", "mlp"))
        if i == 0:  # the first layer always recomputes everything
            a, m, k, v = layer_queries(block, x, pos, all_slots, k, v, valid)
            attn, mlp, x = a, m, x + a + m
        else:
            x_p, x_g = x[:, :P], x[:, P:]
            chosen = None
            if transfer:  # adaptive partial update: every response value first, then chosen tokens
                h = block.attn_norm(x_g)
                c = block.attn.config
                v_new = block.attn.v_proj(h).reshape(B, G, c.n_kv_heads, c.v_head_dim).astype(v.dtype)
                old = v[:, P:].reshape(B, G, -1).astype(jnp.float32)
                cur = v_new.reshape(B, G, -1).astype(jnp.float32)
                sim = jnp.sum(old * cur, -1) / (
                    jnp.maximum(jnp.linalg.norm(old, axis=-1) * jnp.linalg.norm(cur, axis=-1), 1e-8))
                v = v.at[:, P:].set(v_new)
                if k_top:
                    chosen = jnp.argsort(sim, axis=-1, stable=True)[:, :k_top]  # least similar first
            if mode == 1:
                x_p = x_p + attn[:, :P] + mlp[:, :P]  # the prompt's outputs from the cache
                a, m, k, v = layer_queries(block, x_g, pos[:, P:], gen_slots, k, v, valid)
                attn, mlp = attn.at[:, P:].set(a), mlp.at[:, P:].set(m)
            else:
                # the queries: the prompt (mode 2) and the chosen response tokens, in one pass over
                # the keys/values as updated (the reference's order: values, then the queries)
                xs, ps, ss = ([x_p], [pos[:, :P]], [prompt_slots]) if mode == 2 else ([], [], [])
                if chosen is not None:
                    xs.append(_gather(x_g, chosen))
                    ps.append(_gather(pos[:, P:], chosen))
                    ss.append(P + chosen.astype(jnp.int32))
                if xs:
                    slots = jnp.concatenate(ss, axis=1)
                    a, m, k, v = layer_queries(block, jnp.concatenate(xs, axis=1), jnp.concatenate(ps, axis=1),
                                               slots, k, v, valid)
                    attn, mlp = _scatter(attn, slots, a), _scatter(mlp, slots, m)
                x_p = x_p + attn[:, :P] + mlp[:, :P]
            x_g = x_g + attn[:, P:] + mlp[:, P:]
            x = jnp.concatenate([x_p, x_g], axis=1)
        for name, value in zip(("k", "v", "attn", "mlp"), (k, v, attn, mlp)):
            new[name].append(value)
    logits = model.unembed(model.final_norm(x[:, P:]))
    return logits, {name: jnp.stack(values) for name, values in new.items()}


# ------------------------------------------------------------------ FLOP counts
def _token_flops(c) -> float:
    """Matmul FLOPs of one token through one block's projections and MLP."""
    return 2.0 * (c.d_model * (c.q_dim + c.k_dim + c.v_dim) + c.o_dim * c.d_model + 3 * c.d_model * c.ffn_dim)


def _attention_flops(c, queries: int, keys: int) -> float:
    return 2.0 * queries * keys * c.n_heads * (c.qk_head_dim + c.v_head_dim)


def head_flops(c, tokens: int) -> float:
    return 2.0 * tokens * c.d_model * c.vocab_size


def full_flops(c, batch: int, length: int, head_tokens: int) -> float:
    """One full forward of ``batch`` rows of ``length`` slots, the LM head on ``head_tokens``."""
    per_layer = length * _token_flops(c) + _attention_flops(c, length, length)
    return batch * (c.n_layers * per_layer + head_flops(c, head_tokens))


def span_flops(c, batch: int, length: int, size: int) -> float:
    per_layer = size * _token_flops(c) + _attention_flops(c, size, length)
    return batch * (c.n_layers * per_layer + head_flops(c, size))


def dllm_cache_flops(c, batch: int, length: int, prompt_len: int, mode: int, transfer_ratio: float) -> float:
    """FLOPs of `dllm_cache_forward` in ``mode`` (0: the full forward)."""
    T, P, G = length, prompt_len, length - prompt_len
    if mode == 0:
        return full_flops(c, batch, T, G)
    first = T * _token_flops(c) + _attention_flops(c, T, T)
    rest = 0.0
    if mode == 2:
        rest += P * _token_flops(c) + _attention_flops(c, P, T)
    if mode == 1:
        rest += G * _token_flops(c) + _attention_flops(c, G, T)
    elif 0 < transfer_ratio <= 1:  # the values of every response token, then the chosen ones
        k = int(G * transfer_ratio)
        rest += G * 2.0 * c.d_model * c.v_dim + k * _token_flops(c) + _attention_flops(c, k, T)
    return batch * (first + (c.n_layers - 1) * rest + head_flops(c, G))
