"""Which implementation the quantized matmuls run: read when a function is traced.

``auto`` (the Pallas kernel on GPU/TPU, the jnp reference on CPU), ``kernel``,
``interpret`` (the kernel in Pallas interpret mode: slow, for tests) or ``reference``; see
`jaxlm.kernel_backend`.
"""

from __future__ import annotations

from jaxlm.kernel_backend import KernelBackend

QUANT_BACKEND = KernelBackend("quantized linear backend")

set_backend = QUANT_BACKEND.set
resolved_backend = QUANT_BACKEND.resolved
backend = QUANT_BACKEND.use  # with jaxlm.quant.backend("interpret"): ...
