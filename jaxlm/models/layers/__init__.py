"""Layer building blocks and their registries (``ATTENTION``, ``MLP``, ``ROPE``)."""

from jaxlm.models.layers import (
    attention_variants,  # noqa: F401  (registers affine_scaled, sink)
    meta_gate,  # noqa: F401  (registers meta_swiglu)
)
from jaxlm.models.layers.attention import ATTENTION, Attention, dot_product_attention
from jaxlm.models.layers.linear import Linear, linear, param
from jaxlm.models.layers.mlp import MLP, SwiGLU
from jaxlm.models.layers.norms import RMSNorm, rms_normalize
from jaxlm.models.layers.rope import ROPE, ROPE_SCALING, apply_rope, inv_frequencies

__all__ = [
    "ATTENTION", "Attention", "dot_product_attention", "Linear", "linear", "param", "MLP",
    "SwiGLU", "RMSNorm", "rms_normalize", "ROPE", "ROPE_SCALING", "apply_rope", "inv_frequencies",
]
