"""Compression that shrinks a model in place: A^3 analytical low-rank approximation of the
QK, OV and MLP parts (Wong et al., arXiv 2505.12942) and its per-matrix SVD baseline."""

from jaxlm.compress.a3 import (
    A3Config, QKRefit, a3_compress, a3_error_curves, a3_widths, allocate_widths, mlp_cur, needs_qk_refit, ov_factors,
    qk_factors, qk_rope_refit, rope_pair_selection, select_rope_pairs,
)
from jaxlm.compress.apply import METHODS, compress_model, compress_with, svd_model
from jaxlm.compress.calibrate import A3Statistics, QKRefitSums, a3_statistics, qk_refit_sums
from jaxlm.compress.metrics import component_errors, example_batches, kv_cache_bytes, mean_token_nll
from jaxlm.compress.svd import svd_baseline, truncated_svd

__all__ = [
    "A3Config", "a3_compress", "a3_error_curves", "a3_widths", "allocate_widths", "mlp_cur", "ov_factors",
    "qk_factors", "select_rope_pairs", "QKRefit", "qk_rope_refit", "rope_pair_selection", "needs_qk_refit",
    "METHODS", "compress_model", "compress_with", "svd_model", "A3Statistics", "a3_statistics", "QKRefitSums",
    "qk_refit_sums",
    "component_errors", "example_batches", "kv_cache_bytes", "mean_token_nll", "svd_baseline", "truncated_svd",
]
