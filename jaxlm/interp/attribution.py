"""Which components write a direction: per-neuron MLP contributions and per-head attention
contributions / importances, at each sequence's last real token (Wang et al. 2025, "Do
LLMs 'Feel'?", arXiv 2510.11328, Sec. 4; code: Aurora-cx/EmotionCircuits-LLM
``04_local_components_identification``)::

    c = neuron_contributions(model, tokens, mask, v, layer=3)       # [B, F]
    d = head_contributions(model, tokens, mask, v, layer=3)         # [B, N], direct, linear
    i = head_importance(model, tokens, mask, v, layer=3)            # [B, N], by masking

``direction`` is ``[D]`` or per-layer ``[L, D]`` (e.g. ``mean_difference_directions(...)[e]``);
it is used as given, so pass a unit vector for projections. Kernels are stored ``[in, out]``
(``y = x @ W``), so the paper's ``W_down^T v`` is ``W_down @ v`` here.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.interp.directions import capture, last_token_index
from jaxlm.interp.interventions import mask_heads
from jaxlm.models.layers.linear import linear
from jaxlm.quant.formats import fake_quant, fake_quant_tokens

#: Sites `head_importance` can read: residual-width [D] values a head of the layer can change.
READ_SITES = ("attn_out", "resid_mid", "mlp_in", "mlp_out", "hidden")


def _check_layer(name: str, layer, n_layers: int) -> int:
    """An integer scalar (Python, numpy, or a 0-d JAX array such as ``jnp.argmax``'s) in range."""
    if isinstance(layer, jax.Array) and layer.ndim == 0 and jnp.issubdtype(layer.dtype, jnp.integer):
        layer = int(layer)
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n_layers:
        raise ValueError(f"{name}={layer!r} is invalid: must be an int in [0, {n_layers})")
    return int(layer)


def _direction_at(direction, layer: int, config) -> jax.Array:
    v = jnp.asarray(direction, jnp.float32)
    if v.shape == (config.n_layers, config.d_model):
        v = v[layer]
    if v.shape != (config.d_model,):
        raise ValueError(
            f"direction must be [D] = ({config.d_model},) or [L, D] = ({config.n_layers}, {config.d_model}), "
            f"got shape {v.shape}"
        )
    return v


def _kernel(model, layer: int, path: tuple[str, ...]):
    """``(W, act_format)`` of ``model.layers[layer].<path>`` (stacked layers sliced): the weight
    the projection multiplies by and the format its input is fake-quantized in per token (None
    for a float forward). A quantization-aware (``qat_format``) projection multiplies
    ``fake_quant_tokens(x) @ fake_quant(W)``; an exported one (`ActQuantWeight`) the same
    with its stored weight."""
    module = model.layers if model.config.scan_layers else model.layers[layer]
    for name in path:
        module = getattr(module, name)
    if getattr(module, "bias", None) is not None:
        raise ValueError(f"{'.'.join(path)} has a bias: the contributions below assume a bias-free projection")
    w = module.kernel.get_value()
    w = jax.tree.map(lambda x: x[layer], w) if model.config.scan_layers else w
    fmt = getattr(module, "fake_quant", None)
    if fmt is not None and isinstance(w, jax.Array):  # QAT: the forward's quantized weight
        return fake_quant(w, fmt, axis=-2), fmt
    act_format = getattr(w, "act_format", None)  # an exported QAT weight (ActQuantWeight)
    if act_format is not None:
        return w.weight, act_format
    return w, None


def _read_back(w, v: jax.Array, in_features: int) -> jax.Array:
    """``W @ v [in]`` for ``y = linear(x, W)``: the pullback of ``v`` through the projection
    (works for any weight type `linear` dispatches on)."""
    _, pullback = jax.vjp(lambda x: linear(x, w), jnp.zeros((in_features,), jnp.float32))
    return pullback(v)[0]


def _as_multiplied(x: jax.Array, act_format) -> jax.Array:
    """The projection's input as its forward multiplies it (fake-quantized per token under QAT)."""
    return x if act_format is None else fake_quant_tokens(x, act_format)


def neuron_contributions(model, tokens, mask, direction, layer: int) -> jax.Array:
    """``c_i = a_i (W_down @ v)_i`` ``[B, F]`` at layer ``layer``: ``a = mlp_act`` (the down
    projection's input) at each row's last real token. ``sum_i c_i = <mlp_out, v>`` exactly
    (the down projection is linear and bias-free)."""
    c = model.config
    layer = _check_layer("layer", layer, c.n_layers)
    v = _direction_at(direction, layer, c)
    act = capture(model, tokens, mask, sites=("mlp_act",))["mlp_act"][layer]  # [B, F]
    F = c.layer_config(layer).ffn_dim  # this layer's width (per-layer widths after A^3 mixed ranks)
    w, act_format = _kernel(model, layer, ("mlp", "down_proj"))
    out = _as_multiplied(act, act_format) * _read_back(w, v, F)[None]
    chex.assert_shape(out, (act.shape[0], F))
    return out


def head_contributions(model, tokens, mask, direction, layer: int) -> jax.Array:
    """Direct per-head projections ``[B, N]``: head ``h``'s channels of ``attn_ctx`` through its
    rows of ``o_proj``, dotted with ``v``; they sum to ``<attn_out, v>`` (o_proj is linear and
    bias-free), and equal `head_importance` read at ``attn_out`` of the same layer for float
    projections (under QAT, o_proj's input quantizer scales depend on every head, so masking
    one head is not linear and the two differ)."""
    c = model.config
    layer = _check_layer("layer", layer, c.n_layers)
    v = _direction_at(direction, layer, c)
    ctx = capture(model, tokens, mask, sites=("attn_ctx",))["attn_ctx"][layer]  # [B, N*H]
    lc = c.layer_config(layer)  # this layer's widths (per-layer widths after A^3 mixed ranks)
    w, act_format = _kernel(model, layer, ("attn", "o_proj"))
    g = _read_back(w, v, lc.o_dim)
    out = (_as_multiplied(ctx, act_format) * g[None]).reshape(ctx.shape[0], c.n_heads, lc.v_head_dim).sum(-1)
    chex.assert_shape(out, (ctx.shape[0], c.n_heads))
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "site", "read_layer"))
def _projection(graphdef, state, tokens, mask, index, v, interventions, *, site, read_layer):
    model = nnx.merge(graphdef, state)
    names = ("hidden", "mlp_out") if site == "resid_mid" else (site,)
    out = model.backbone(tokens, mask=mask, collect=names, interventions=interventions).collected
    h = out["hidden"] - out["mlp_out"] if site == "resid_mid" else out[site]
    h = h[read_layer, jnp.arange(tokens.shape[0]), index]
    return h @ v


def head_importance(model, tokens, mask, direction, layer: int, *, read_site: str = "mlp_in",
                    read_layer: int | None = None) -> jax.Array:
    """``[B, N]``: for each head ``h`` of ``layer``, the baseline projection ``<x, v>`` minus the
    projection with ``h`` zeroed at the o_proj input (`mask_heads`, all positions), where
    ``x`` is ``read_site`` of ``read_layer`` (default: ``layer``) at each row's last real token.
    The default ``"mlp_in"`` (the normed MLP input after attention) is where the reference
    code reads it; ``v`` is taken at ``read_layer`` when per-layer. Average over rows for the
    paper's per-head score."""
    c = model.config
    layer = _check_layer("layer", layer, c.n_layers)
    read_layer = layer if read_layer is None else _check_layer("read_layer", read_layer, c.n_layers)
    if read_layer < layer:
        raise ValueError(f"read_layer={read_layer} is before layer={layer}: masking a head cannot change it")
    if read_site not in READ_SITES:
        raise ValueError(f"read_site={read_site!r} is invalid: must be a residual-width site after attention, one of {READ_SITES}")
    v = _direction_at(direction, read_layer, c)
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"tokens must be [B, T] with at least one row, got shape {tokens.shape}")
    mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask, bool)
    index = last_token_index(mask)
    graphdef, state = nnx.split(model)
    run = functools.partial(_projection, graphdef, state, tokens, mask, index, v, site=read_site, read_layer=read_layer)
    base = run(())
    masked = []
    for h in range(c.n_heads):
        scale = jnp.ones((c.n_heads,)).at[h].set(0.0)
        masked.append(run((mask_heads(scale, n_layers=c.n_layers, layers=[layer]),)))
    out = base[:, None] - jnp.stack(masked, axis=1)
    chex.assert_shape(out, (tokens.shape[0], c.n_heads))
    return out
