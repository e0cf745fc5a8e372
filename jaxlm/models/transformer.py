"""The decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral family) in Flax NNX.

``Transformer(config, rngs=...)`` builds embeddings, ``n_layers`` pre-norm blocks
(RMSNorm -> attention -> residual, RMSNorm -> MLP -> residual), a final norm and
the LM head (or the tied embedding). One forward signature::

    out = model(tokens, positions, cache=None, mask=None, collect=())
    out.logits  # [B, T, V] float32
    out.cache   # the updated KVCache (None when none was passed)
    out.hidden  # final-normed hidden states [B, T, D]
    out.collected["hidden"]  # [L, B, T, D] for each name in `collect`

With ``config.scan_layers`` the blocks' parameters are stacked ``[L, ...]`` and the
forward is a `lax.scan`, so compile time does not grow with depth.
"""

from __future__ import annotations

from typing import Iterable

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxlm.inference.cache import KVCache, LayerKV
from jaxlm.models.config import ModelConfig
from jaxlm.models.interventions import check_interventions
from jaxlm.models.layers.attention import ATTENTION
from jaxlm.models.layers.linear import Linear, linear, param
from jaxlm.models.layers.meta_gate import MetaGate
from jaxlm.models.layers.mlp import MLP
from jaxlm.models.layers.norms import RMSNorm
from jaxlm.models.masks import build_attention_mask
from jaxlm.models.taps import Taps, check_collect

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@struct.dataclass
class ModelOutput:
    logits: jax.Array | None  # [B, T, V] float32
    cache: KVCache | None
    hidden: jax.Array  # [B, T, D] after the final norm
    collected: dict[str, jax.Array]  # name -> [L, ...]
    next_logits: jax.Array | None = None  # [B, T, V] float32: ModelConfig.next_token_head (ME-DLM)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = c.weight_dtype
        self.attn_norm = RMSNorm(c.d_model, eps=c.norm_eps, param_dtype=pd)
        self.attn = ATTENTION[c.attention](c, rngs=rngs)
        self.mlp_norm = RMSNorm(c.d_model, eps=c.norm_eps, param_dtype=pd)
        self.mlp = MLP[c.mlp](c, rngs=rngs)

    def __call__(self, x, positions, mask, kv: LayerKV | None, taps: Taps, aux: dict | None = None):
        h = taps.put("attn_in", self.attn_norm(x))
        a, new_kv = self.attn(h, positions, mask, kv, taps)
        x = x + taps.put("attn_out", a)
        h = taps.put("mlp_in", self.mlp_norm(x))
        x = x + taps.put("mlp_out", self.mlp(h, taps, aux))
        return taps.put("hidden", x), new_kv


def _apply_block(graphdef, layer_state, x, positions, mask, kv, names, aux):
    """Pure block application (merge -> call), the unit that is scanned and rematerialised.
    ``aux``: per-forward inputs shared by all layers (e.g. the MeGan condition) + ``layer``."""
    block = nnx.merge(graphdef, layer_state)
    taps = Taps(names, aux.get("interventions", ()), aux.get("layer"))
    x, new_kv = block(x, positions, mask, kv, taps, aux)
    return x, new_kv, taps.values


def _head_logits(h: jax.Array, kernel) -> jax.Array:
    """An untied head's logits in float32: a dense kernel accumulates and returns float32 (as
    the tied head does); a structured (quantized) kernel goes through `linear`."""
    if isinstance(kernel, jax.Array):
        flat = jnp.dot(h.reshape(-1, h.shape[-1]), kernel.astype(h.dtype), preferred_element_type=jnp.float32)
        return flat.reshape(*h.shape[:-1], kernel.shape[-1])
    return linear(h, kernel).astype(jnp.float32)


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, tokenizer=None):
        c = self.config = config
        self.tokenizer = tokenizer  # static: used by generate() for text prompts, saved with the model
        pd = c.weight_dtype
        self.embed = param(
            c.init_std * jax.random.normal(rngs.params(), (c.vocab_size, c.d_model), pd),
            ("vocab", "embed"),
        )
        if c.scan_layers:

            @nnx.split_rngs(splits=c.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def stacked(rngs):
                return Block(c, rngs=rngs)

            self.layers = stacked(rngs)
        else:
            # c.layer_config(i) is c itself unless widths differ per layer (A^3 mixed ranks)
            self.layers = nnx.List([Block(c.layer_config(i), rngs=rngs) for i in range(c.n_layers)])
        self.final_norm = RMSNorm(c.d_model, eps=c.norm_eps, param_dtype=pd)
        # MeGan: one hypernetwork shared by all layers (None for other MLPs)
        self.meta_gate = MetaGate(c, rngs=rngs) if c.mlp == "meta_swiglu" else None
        if c.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                c.d_model, c.vocab_size, axes=("embed", "vocab"), std=c.init_std, param_dtype=pd,
                rngs=rngs,
            )
        if c.next_token_head:  # ME-DLM: logits at i predict the token that follows i
            self.next_head = Linear(
                c.d_model, c.vocab_size, axes=("embed", "vocab"), std=c.init_std, param_dtype=pd,
                rngs=rngs,
            )
        else:
            self.next_head = None

    # ---------------------------------------------------------------- pieces
    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        return KVCache.init(self.config, batch_size, max_len, dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """Final hidden ``[..., D]`` -> logits ``[..., V]`` in float32."""
        if self.lm_head is None:
            emb = self.embed[...].astype(h.dtype)
            return jnp.einsum("...d,vd->...v", h, emb, preferred_element_type=jnp.float32)
        return _head_logits(h, self.lm_head.kernel.get_value())

    def unembed_next(self, h: jax.Array) -> jax.Array:
        """Final hidden ``[..., D]`` -> the next-token head's logits ``[..., V]`` in float32
        (accumulated as `unembed`'s, so the two heads agree while their kernels do)."""
        return _head_logits(h, self.next_head.kernel.get_value())

    def backbone(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        mask: jax.Array | None = None,
        collect: Iterable[str] = (),
        condition: jax.Array | tuple[jax.Array, jax.Array] | None = None,
        interventions=(),
        embeds: jax.Array | None = None,
    ) -> ModelOutput:
        """Everything but the LM head (``logits`` is None): for chunked log-prob code.
        A ``mode="diffusion"`` model attends bidirectionally unless a full mask is given.
        ``embeds [B, T, D]``: the input embeddings, used instead of looking ``tokens`` up
        (a multimodal front end's sequence with media spliced in, `jaxlm.models.omni`)."""
        c = self.config
        names = check_collect(collect)
        chex.assert_rank(tokens, 2)
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        B, T = tokens.shape

        token_mask, full_mask = None, None
        if mask is not None:
            if mask.ndim == 2:
                chex.assert_shape(mask, (B, T))
                token_mask = mask.astype(bool)
            elif mask.ndim in (3, 4):
                if jnp.issubdtype(mask.dtype, jnp.floating):  # an additive mask (0 / -inf) would read inverted
                    raise TypeError(f"a full mask must be bool (True = may attend) or 0/1 integers, got dtype "
                                    f"{mask.dtype}: an additive float mask (0 = keep, -inf = drop) reads inverted")
                if mask.ndim == 4 and mask.shape[1] not in (1, c.n_heads):
                    raise ValueError(f"mask [B, 1|N, T, S] has {mask.shape[1]} heads; the model has "
                                     f"n_heads={c.n_heads} (or pass 1 for every head)")
                full_mask = mask.astype(bool)
            else:
                raise ValueError(
                    f"mask must be [B, T] (padding) or [B, T, S] / [B, 1|N, T, S] (full), "
                    f"got shape {mask.shape}"
                )
        if token_mask is None:
            token_mask = jnp.ones((B, T), bool)

        if positions is None:
            offset = 0 if cache is None else cache.lengths[:, None]
            positions = jnp.maximum(jnp.cumsum(token_mask, axis=1) - 1, 0) + offset
        if positions.ndim == 3:  # (sequence, graph) for rope="graph"; (time, height, width) for "mrope"
            chex.assert_shape(positions, (B, T, 3 if c.rope == "mrope" else 2))
        else:
            chex.assert_shape(positions, (B, T))

        if cache is None:
            write_index = None
            kv_valid = token_mask
            q_start = 0
        else:
            chex.assert_equal(cache.batch_size, B)
            if not isinstance(cache.end_index, jax.core.Tracer) and int(jnp.max(cache.end_index)) + T > cache.max_len:
                raise ValueError(
                    f"cache overflow: writing {T} tokens at slot {int(jnp.max(cache.end_index))} "
                    f"exceeds the cache length {cache.max_len}"
                )
            write_index = cache.end_index
            if cache.per_row_index:  # one write slot per row
                kv_valid = jax.vmap(lambda v, m, i: jax.lax.dynamic_update_slice(v, m, (i,)))(
                    cache.valid, token_mask, write_index)
            else:
                kv_valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, write_index))
            q_start = write_index
        if full_mask is None and c.mode == "diffusion":  # bidirectional: every real slot
            full_mask = jnp.ones((1, 1, T, kv_valid.shape[1]), bool)
        if full_mask is not None:
            chex.assert_axis_dimension(full_mask, -1, kv_valid.shape[1])
            chex.assert_axis_dimension(full_mask, -2, T)
        attn_mask = build_attention_mask(
            kv_valid=kv_valid, q_start=q_start, num_queries=T, full_mask=full_mask,
            sliding_window=c.sliding_window,
        )

        if embeds is None:
            x = jnp.take(self.embed[...], tokens, axis=0).astype(c.compute_dtype)
        else:
            chex.assert_shape(embeds, (B, T, c.d_model))
            x = embeds.astype(c.compute_dtype)
        aux = {
            "meta": self._meta_inputs(condition),
            "interventions": check_interventions(interventions, c.n_layers, c.n_heads, tokens_shape=(B, T)),
        }
        k_all = v_all = None
        if cache is not None:
            k_all, v_all = cache.k, cache.v
        x, k_all, v_all, collected = self._run_layers(
            x, positions, attn_mask, k_all, v_all, write_index, names, aux
        )
        h = self.final_norm(x)
        chex.assert_shape(h, (B, T, c.d_model))
        if cache is not None and isinstance(cache.end_index, jax.core.Tracer):
            # under jit the overflow check above cannot raise, and the cache write clamps (it
            # overwrites the last slots): the rows that overflowed read NaN, not wrong numbers
            over = cache.end_index + T > cache.max_len  # scalar, or [B] with per-row write slots
            h = jnp.where(jnp.reshape(over, (-1, 1, 1)), jnp.nan, h).astype(h.dtype)

        new_cache = None
        if cache is not None:
            new_cache = cache.replace(
                k=k_all, v=v_all, valid=kv_valid, end_index=cache.end_index + T,
                lengths=cache.lengths + token_mask.sum(axis=1, dtype=jnp.int32),
            )
        return ModelOutput(logits=None, cache=new_cache, hidden=h, collected=collected)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        mask: jax.Array | None = None,
        collect: Iterable[str] = (),
        condition: jax.Array | tuple[jax.Array, jax.Array] | None = None,
        interventions=(),
        embeds: jax.Array | None = None,
    ) -> ModelOutput:
        """Logits for ``tokens [B, T]`` at ``positions [B, T]`` (default: 0.. per sequence,
        continuing from the cache; ``[B, T, 2]`` for rope="graph"). ``mask``: padding
        ``[B, T]`` or full ``[B, (N,) T, S]``. ``condition``: token ids ``[B, C]`` (or
        ``(ids, mask)``) of the condition text a ``meta_swiglu`` model is gated by.
        ``interventions``: `jaxlm.interp.Intervention` s applied at their tap sites
        (steering, ablation, head masking). ``embeds``: input embeddings instead of the
        token lookup (`backbone`)."""
        out = self.backbone(
            tokens, positions, cache=cache, mask=mask, collect=collect, condition=condition,
            interventions=interventions, embeds=embeds,
        )
        logits = self.unembed(out.hidden)
        chex.assert_shape(logits, (*tokens.shape, self.config.vocab_size))
        chex.assert_type(logits, jnp.float32)
        next_logits = self.unembed_next(out.hidden) if self.next_head is not None else None
        return out.replace(logits=logits, next_logits=next_logits)

    def _meta_inputs(self, condition):
        if condition is None or self.meta_gate is None:
            return None
        ids, cmask = condition if isinstance(condition, tuple) else (condition, jnp.ones(condition.shape, bool))
        chex.assert_rank(ids, 2)
        emb = jnp.take(self.embed[...], ids, axis=0)
        return self.meta_gate.prepare(emb, cmask)

    # ------------------------------------------------ layer by layer (early exit)
    def layer_inputs(self, tokens: jax.Array, cache: KVCache):
        """What `backbone` builds before its first layer, for ``tokens [B, T]`` appended to
        ``cache`` (shared write slot): embeddings, positions, the attention mask and the
        updated slot validity. For decoders that run the layers one at a time."""
        c = self.config
        B, T = tokens.shape
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        kv_valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((B, T), bool), (0, cache.end_index))
        mask = build_attention_mask(kv_valid=kv_valid, q_start=cache.end_index, num_queries=T,
                                    sliding_window=c.sliding_window)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(c.compute_dtype)
        return x, positions, mask, kv_valid

    def apply_layer(self, i: int, x, positions, mask, kv: LayerKV, *, attention_only: bool = False):
        """Block ``i`` on ``x``: ``(x, kv)``. ``attention_only``: run only its attention, for
        the key/value write, and return ``x`` unchanged (a layer an early exit skips)."""
        block = self.layers[i]
        taps = Taps(frozenset())
        if attention_only:
            _, kv = block.attn(block.attn_norm(x), positions, mask, kv, taps)
            return x, kv
        return block(x, positions, mask, kv, taps)

    # --------------------------------------------------------------- layers
    def _run_layers(self, x, positions, mask, k_all, v_all, write_index, names, aux):
        c = self.config
        apply = _apply_block
        if c.remat != "none":
            apply = jax.checkpoint(_apply_block, policy=_REMAT_POLICIES[c.remat], static_argnums=(0, 6))

        def layer_kv(k_all, v_all, i):
            if k_all is None:
                return None
            if isinstance(k_all, tuple):  # per-layer widths: this layer's own arrays
                return LayerKV(k=k_all[i], v=v_all[i], layer=None, index=write_index)
            return LayerKV(k=k_all, v=v_all, layer=i, index=write_index)

        if c.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                x, k_all, v_all = carry
                layer_state, i = xs
                x, kv, taps = apply(
                    graphdef, layer_state, x, positions, mask, layer_kv(k_all, v_all, i), names, {**aux, "layer": i}
                )
                if kv is not None:
                    k_all, v_all = kv.k, kv.v
                return (x, k_all, v_all), taps

            (x, k_all, v_all), collected = jax.lax.scan(
                body, (x, k_all, v_all), (state, jnp.arange(c.n_layers))
            )
            return x, k_all, v_all, collected

        per_layer = []
        for i, block in enumerate(self.layers):
            graphdef, state = nnx.split(block)
            x, kv, taps = apply(
                graphdef, state, x, positions, mask, layer_kv(k_all, v_all, i), names,
                {**aux, "layer": jnp.asarray(i, jnp.int32)},
            )
            if kv is not None and isinstance(k_all, tuple):
                k_all = k_all[:i] + (kv.k,) + k_all[i + 1:]
                v_all = v_all[:i] + (kv.v,) + v_all[i + 1:]
            elif kv is not None:
                k_all, v_all = kv.k, kv.v
            per_layer.append(taps)
        collected = {n: _stack_layers([t[n] for t in per_layer]) for n in names if n in per_layer[0]}
        return x, k_all, v_all, collected


def _stack_layers(values: list[jax.Array]):
    """Per-layer tap values ``[L, ...]``; a tuple of per-layer arrays where their shapes differ
    (per-layer widths: e.g. ``mlp_act`` with ``layer_ffn_dims``), so ``collected[name][layer]``
    reads the same in both cases."""
    if len({v.shape for v in values}) > 1:
        return tuple(values)
    return jnp.stack(values)


def build_model(config: ModelConfig, *, seed: int = 0, tokenizer=None) -> Transformer:
    """A randomly initialised model (weights ~ N(0, init_std), norms = 1)."""
    return Transformer(config, rngs=nnx.Rngs(params=seed), tokenizer=tokenizer)


def abstract_model(config: ModelConfig) -> Transformer:
    """The model with `jax.ShapeDtypeStruct` leaves: shapes without allocating weights."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
