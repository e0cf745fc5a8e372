"""Feed-forward variants. ``MLP`` maps ``ModelConfig.mlp`` to a module class."""

from __future__ import annotations

import jax
from flax import nnx

from jaxlm.models.layers.linear import Linear
from jaxlm.models.taps import Taps
from jaxlm.registry import Registry

MLP: Registry = Registry("mlp")


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` (Shazeer 2020, GLU variants eq. 6). Rematerialised: the backward
    keeps only ``gate`` and ``up`` (the projections' outputs) and recomputes the sigmoid
    inside its own elementwise pass, instead of the forward writing out the sigmoid and the
    derivative's factors ``[B, T, F]`` for it to read back."""
    return jax.nn.silu(gate) * up


@MLP.register("swiglu")
class SwiGLU(nnx.Module):
    """``down(silu(gate x) * up x)`` (Shazeer 2020, GLU variants eq. 6)."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        c = config
        kw = dict(std=c.init_std, param_dtype=c.weight_dtype, fake_quant=c.qat_format, rngs=rngs)
        self.gate_proj = Linear(c.d_model, c.ffn_dim, axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(c.d_model, c.ffn_dim, axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(c.ffn_dim, c.d_model, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array, taps: Taps, aux: dict | None = None) -> jax.Array:
        h = taps.put("mlp_act", swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(h)
