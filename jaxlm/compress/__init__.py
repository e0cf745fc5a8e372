"""Compression that shrinks a model in place: A^3 analytical low-rank approximation of the
QK, OV and MLP parts (Wong et al., arXiv 2505.12942) and its per-matrix SVD baseline.

The closed forms and helpers live in their modules: `jaxlm.compress.a3` (a package, one
module per part), `calibrate` (statistics), `apply` (model-level entry points), `metrics`
(component errors, NLL, KV cache size) and `svd` (the baseline)."""

from jaxlm.compress.a3 import (
    A3Config,
    a3_compress,
    a3_error_curves,
    allocate_widths,
    needs_qk_refit,
    qk_rope_refit,
)
from jaxlm.compress.apply import compress_model, compress_with, svd_model
from jaxlm.compress.calibrate import a3_statistics
from jaxlm.compress.metrics import component_errors, kv_cache_bytes

__all__ = [
    "A3Config", "a3_statistics", "qk_rope_refit", "needs_qk_refit", "a3_compress", "a3_error_curves",
    "allocate_widths", "compress_model", "compress_with", "svd_model", "component_errors", "kv_cache_bytes",
]
