"""MeGan meta-gated SwiGLU (Ji et al., ICML 2026, arXiv 2605.01973; the released code's
``meta_swiglu_shared_modeling_llama.py`` as summarised in the method card, 3.1).

    FFN(x) = W_down( g * sigmoid((1 + beta) g) * u ),   g = W_gate x,  u = W_up x
    beta   = 0.5 tanh( W_beta ( CrossAttn(query=h, key=value=E(condition)) + e_layer ) )

``beta`` is per token and per FFN channel, produced by one hypernetwork shared by all layers
(`MetaGate`): the condition text (task / domain / persona / style) is embedded with the
LM's own token embeddings, a one-head cross-attention of width ``meta_rank`` reads it with
the layer's MLP input as query, a learned layer embedding is added, and ``W_beta`` maps to
``d_ff`` channels. ``W_beta`` starts at zero, so ``beta = 0`` and the model is exactly the
base model (also when no condition is given). The card's regulariser ``lambda * sum |beta|``
(named "l2" in the code, an L1 sum) is applied by the trainer (``algorithm.beta_l1``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.layers.linear import param
from jaxlm.models.layers.mlp import MLP, SwiGLU
from jaxlm.models.taps import Taps


class MetaGate(nnx.Module):
    """The shared hypernetwork's parameters."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        c = config
        r, std, pd = c.meta_rank, c.init_std, c.weight_dtype
        normal = lambda shape: std * jax.random.normal(rngs.params(), shape, pd)
        self.wq = param(normal((c.d_model, r)), ("embed", None))
        self.wk = param(normal((c.d_model, r)), ("embed", None))
        self.wv = param(normal((c.d_model, r)), ("embed", None))
        self.layer_emb = param(normal((c.n_layers, r)), ("layers", None))
        self.w_beta = param(jnp.zeros((r, c.ffn_dim), pd), (None, "mlp"))

    def prepare(self, cond_emb: jax.Array, cond_mask: jax.Array) -> dict:
        """Per-forward inputs for every layer: the condition's keys/values and the shared weights."""
        f32 = jnp.float32
        e = cond_emb.astype(f32)
        return {
            "k": e @ self.wk[...].astype(f32), "v": e @ self.wv[...].astype(f32), "mask": cond_mask.astype(bool),
            "wq": self.wq[...].astype(f32), "layer_emb": self.layer_emb[...].astype(f32),
            "w_beta": self.w_beta[...].astype(f32),
        }


def meta_beta(meta: dict, h: jax.Array, layer: jax.Array) -> jax.Array:
    """``beta [B, T, d_ff]`` for MLP input ``h [B, T, D]`` at layer ``layer``. A row whose
    condition is empty (every condition token masked) gets ``beta = 0``, the base SwiGLU, as
    with no condition at all (its softmax spread evenly over the masked padding ids)."""
    q = h.astype(jnp.float32) @ meta["wq"]  # [B, T, r]
    scores = jnp.einsum("btr,bcr->btc", q, meta["k"]) / jnp.sqrt(jnp.float32(q.shape[-1]))
    scores = jnp.where(meta["mask"][:, None, :], scores, jnp.finfo(jnp.float32).min)
    style = jnp.einsum("btc,bcr->btr", jax.nn.softmax(scores, axis=-1), meta["v"])
    style = style + meta["layer_emb"][layer]
    beta = 0.5 * jnp.tanh(style @ meta["w_beta"])
    return jnp.where(jnp.any(meta["mask"], axis=-1)[:, None, None], beta, 0.0)


@MLP.register("meta_swiglu")
class MetaSwiGLU(SwiGLU):
    """SwiGLU with the gate's Swish slope ``1 + beta`` set per token by `MetaGate`."""

    def __call__(self, x: jax.Array, taps: Taps, aux: dict | None = None) -> jax.Array:
        g, u = self.gate_proj(x), self.up_proj(x)
        meta = None if aux is None else aux.get("meta")
        if meta is None:  # no condition: exactly the base SwiGLU
            return self.down_proj(taps.put("mlp_act", jax.nn.silu(g) * u))
        beta = taps.put("mlp_beta", meta_beta(meta, x, aux["layer"]))
        act = g * jax.nn.sigmoid(((1.0 + beta) * g.astype(jnp.float32)).astype(g.dtype))
        return self.down_proj(taps.put("mlp_act", act * u))
