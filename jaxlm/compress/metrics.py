"""How well a compressed model approximates the original, per component and end to end.

`component_errors` feeds every layer of both models the *original* model's layer inputs
(and, for OV, its attention probabilities), so each number isolates one component's
approximation: the relative squared error of

* ``qk``: the pre-softmax scores over causal pairs of valid tokens (per query head);
* ``ov``: the attention output ``o_proj(sum_j a_ij v_j)`` with the original ``a_ij``;
* ``mlp``: the MLP output.

`mean_token_nll` is the end-to-end next-token loss on valid tokens.
"""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.compress.calibrate import check_components
from jaxlm.data.encoding import encode
from jaxlm.inference.cache import KVCache
from jaxlm.models.layers.attention import attention_scores, weighted_values
from jaxlm.models.masks import build_attention_mask
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.models.taps import Taps


def unrolled(model):
    """The same model with ``scan_layers=False`` (per-layer modules to call one at a time)."""
    if not model.config.scan_layers:
        return model
    return model_from_flat(model.config.replace(scan_layers=False), flat_params(model))


def _positions(valid):
    return jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)


def _qk_scores(attn, x, positions, mask):
    taps = Taps(frozenset({"q_rot", "k_rot"}))
    attn(x, positions, mask, None, taps)
    k = taps.values["k_rot"].transpose(0, 2, 1, 3)
    return attention_scores(taps.values["q_rot"], k, attn.config.head_dim**-0.5)  # [B, K, G, T, S]


def _ov_output(attn, x, probs):
    c = attn.config
    B, T, _ = x.shape
    v = attn.v_proj(x).reshape(B, T, c.n_kv_heads, c.v_head_dim).transpose(0, 2, 1, 3)
    grouped = probs.reshape(B, c.n_kv_heads, c.n_heads // c.n_kv_heads, T, -1)
    return attn.o_proj(weighted_values(grouped, v).reshape(B, T, c.o_dim))


@functools.partial(jax.jit, static_argnames=("graphdef", "new_graphdef", "components"))
def _layer_errors(graphdef, state, new_graphdef, new_state, tokens, valid, *, components):
    model, new = nnx.merge(graphdef, state), nnx.merge(new_graphdef, new_state)
    c = model.config
    sites = ("attn_in", "attn_probs", "mlp_in")
    got = model(tokens, mask=valid, collect=sites).collected
    positions = _positions(valid)
    T = tokens.shape[1]
    mask = build_attention_mask(kv_valid=valid, q_start=0, num_queries=T, full_mask=None,
                                sliding_window=c.sliding_window)
    pair_mask = (mask & valid[:, None, :, None]).astype(jnp.float32)  # [B, 1, T, S]
    tok = valid.astype(jnp.float32)[..., None]
    out = {comp: jnp.zeros(2) for comp in components}
    for i in range(c.n_layers):
        old_block, new_block = model.layers[i], new.layers[i]
        x = got["attn_in"][i]
        if "qk" in components:
            s0 = _qk_scores(old_block.attn, x, positions, mask)
            s1 = _qk_scores(new_block.attn, x, positions, mask)
            w = pair_mask[:, :, None]
            out["qk"] += jnp.stack([jnp.sum(w * (s1 - s0) ** 2), jnp.sum(w * s0**2)])
        if "ov" in components:
            probs = got["attn_probs"][i]
            o0, o1 = _ov_output(old_block.attn, x, probs), _ov_output(new_block.attn, x, probs)
            out["ov"] += jnp.stack([jnp.sum(tok * (o1 - o0) ** 2), jnp.sum(tok * o0**2)])
        if "mlp" in components:
            h = got["mlp_in"][i]
            m0 = old_block.mlp(h, Taps(frozenset()))
            m1 = new_block.mlp(h, Taps(frozenset()))
            out["mlp"] += jnp.stack([jnp.sum(tok * (m1 - m0) ** 2), jnp.sum(tok * m0**2)])
    return out


def component_errors(model, compressed, batches: Iterable[tuple[np.ndarray, np.ndarray]],
                     components: Iterable[str] = ("qk", "ov", "mlp")) -> dict[str, float]:
    """``{component: sum ||y' - y||^2 / sum ||y||^2}`` over all layers and ``batches``, with
    ``y`` the original model's component output and ``y'`` the compressed model's, both on
    the original model's layer inputs."""
    components = check_components(components)
    graphdef, state = nnx.split(unrolled(model))
    new_graphdef, new_state = nnx.split(unrolled(compressed))
    total = None
    for tokens, valid, *_ in batches:
        e = _layer_errors(graphdef, state, new_graphdef, new_state, jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(valid, bool), components=components)
        total = e if total is None else jax.tree.map(jnp.add, total, e)
    if total is None:
        raise ValueError("component_errors: no batches")
    return {k: float(v[0] / v[1]) for k, v in total.items()}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _nll_sums(graphdef, state, tokens, valid, targets):
    logits = nnx.merge(graphdef, state)(tokens, mask=valid).logits[:, :-1]
    keep = (targets[:, 1:] & valid[:, 1:] & valid[:, :-1]).astype(jnp.float32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(logp * keep), jnp.sum(keep)


def mean_token_nll(model, batches: Iterable[tuple[np.ndarray, ...]]) -> float:
    """Mean next-token negative log-likelihood (nats). Batches are ``(tokens, valid)`` (every
    valid token after the first is a target) or ``(tokens, valid, targets)`` with ``targets``
    marking the scored tokens (e.g. completions only, from `example_batches`)."""
    graphdef, state = nnx.split(model)
    total, count = 0.0, 0.0
    for tokens, valid, *rest in batches:
        targets = rest[0] if rest else valid
        s, n = _nll_sums(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool),
                         jnp.asarray(targets, bool))
        total, count = total + float(s), count + float(n)
    if count == 0:  # 0 nats would read as a perfect model
        raise ValueError("mean_token_nll: the batches hold no scored token (no batch, or every row masked)")
    return total / count


def example_batches(tokenizer, examples, *, batch_size: int, seq_len: int):
    """Right-padded ``(tokens, valid, targets)`` batches of prompt/completion examples encoded
    as in training (`jaxlm.data.encoding.encode`: BOS + prompt + completion + EOS, the
    completion and EOS are the targets); rows longer than ``seq_len`` are cut."""
    rows = [encode(e, tokenizer) for e in examples]
    out = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i: i + batch_size]
        tokens = np.zeros((len(chunk), seq_len), np.int32)
        valid = np.zeros((len(chunk), seq_len), bool)
        targets = np.zeros((len(chunk), seq_len), bool)
        for r, row in enumerate(chunk):
            n = min(len(row["tokens"]), seq_len)
            tokens[r, :n], valid[r, :n], targets[r, :n] = row["tokens"][:n], True, row["loss_mask"][:n]
        out.append((tokens, valid, targets))
    return out


def kv_cache_bytes(config, batch_size: int = 1, max_len: int | None = None) -> int:
    """Bytes of the K and V caches for ``batch_size`` sequences of ``max_len`` slots."""
    cache = jax.eval_shape(lambda: KVCache.init(config, batch_size, max_len or config.max_seq_len))
    return cache.nbytes  # stacked [L, ...] or per layer (mixed widths): the sum over layers
