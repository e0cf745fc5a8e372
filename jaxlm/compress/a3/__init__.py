"""A^3: analytical low-rank approximation of attention and MLP (Wong et al., arXiv 2505.12942).

A layer is split into three parts, each shrunk in place by a closed form that minimises
that part's output error on calibration statistics (`jaxlm.compress.calibrate`). The
compressed model is the same `Transformer` with smaller widths (``qk_head_dim``,
``v_head_dim``, ``ffn_dim``): no extra matmuls, a smaller KV cache.

* `config`: `A3Config`, target widths of a budget, what each closed form supports.
* `qk`: A3-QK (whitened SVD without RoPE, frequency-pair selection under RoPE).
* `refit`: the least-squares refit of the RoPE pairs A3-QK keeps (`qk_rope_refit`).
* `ov`: A3-OV (whitened SVD of the value/output map per KV group).
* `mlp`: A3-MLP (CUR: neuron selection and the least-squares down-projection refit).
* `allocation`: per-layer error curves and widths (uniform or mixed ranks).
* `compress`: `a3_compress`, flat parameters -> compressed flat parameters and config.
* `linalg`, `weights`: Gram roots; per-head, bias-augmented views of the flat parameters.
"""

from jaxlm.compress.a3.allocation import a3_error_curves, allocate_widths
from jaxlm.compress.a3.compress import a3_compress
from jaxlm.compress.a3.config import A3Config, check_compressible, needs_qk_refit
from jaxlm.compress.a3.refit import qk_rope_refit

__all__ = [
    "A3Config", "a3_compress", "a3_error_curves", "allocate_widths", "check_compressible", "needs_qk_refit",
    "qk_rope_refit",
]
