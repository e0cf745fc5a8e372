"""RMSNorm (Zhang & Sennrich 2019): ``y = w * x / sqrt(mean(x^2) + eps)``, statistics in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.models.layers.linear import param


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """The weightless part, in float32, cast back to ``x.dtype`` (as HF Llama/Qwen do)."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, axis_name: str = "norm", param_dtype=jnp.float32):
        self.eps = eps
        self.scale = param(jnp.ones((dim,), param_dtype), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_normalize(x, self.eps) * self.scale[...].astype(x.dtype)
