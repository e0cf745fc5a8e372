"""The per-matrix truncated-SVD baseline A^3 is compared against, at the same parameter count.

For each projection A^3 shrinks, ``W [d_in, d_out]`` is replaced by its best rank-``r``
approximation in the plain Frobenius norm (Eckart-Young), with ``r = floor(n_A3 / (d_in +
d_out))`` where ``n_A3`` is the number of weights A^3 keeps for that matrix: a factored
``U_r (S_r V_r^T)`` would store about as many numbers. The result is returned as the
reconstructed *dense* weights with the original shapes (for error and loss comparisons;
it does not make the model smaller).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

#: component -> (projection, which axis A^3 shrinks: 0 = input rows, 1 = output columns)
PROJECTIONS: dict[str, tuple[tuple[str, int], ...]] = {
    "qk": (("attn.q_proj", 1), ("attn.k_proj", 1)),
    "ov": (("attn.v_proj", 1), ("attn.o_proj", 0)),
    "mlp": (("mlp.gate_proj", 1), ("mlp.up_proj", 1), ("mlp.down_proj", 0)),
}


def truncated_svd(w: np.ndarray, rank: int) -> np.ndarray:
    """The best rank-``rank`` approximation of ``w`` (dense)."""
    u, s, vt = np.linalg.svd(np.asarray(w, np.float64), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vt[:rank]


def svd_rank(shape: tuple[int, int], kept_params: int) -> int:
    """Rank whose factors ``r * (d_in + d_out)`` fit in ``kept_params`` (at least 1)."""
    return max(1, min(min(shape), kept_params // (shape[0] + shape[1])))


def svd_baseline(params: Mapping[str, object], config, compressed_config, components) -> tuple[dict, dict]:
    """Flat params with every projection of ``components`` replaced by its truncated SVD at
    the parameter count of the same projection in ``compressed_config`` (A^3's shapes).
    Returns the new flat params (original shapes) and ``{parameter name: rank}`` (one per
    layer and projection: with per-layer widths the ranks differ by layer)."""
    def widths(c):
        return {"attn.q_proj": c.q_dim, "attn.k_proj": c.k_dim, "attn.v_proj": c.v_dim, "attn.o_proj": c.o_dim,
                "mlp.gate_proj": c.ffn_dim, "mlp.up_proj": c.ffn_dim, "mlp.down_proj": c.ffn_dim}

    out, ranks = dict(params), {}
    for comp in components:
        for proj, _axis in PROJECTIONS[comp]:
            for layer in range(config.n_layers):
                # per-layer widths (A^3 mixed ranks): each layer at its own parameter count
                old_out = widths(config.layer_config(layer))
                new_out = widths(compressed_config.layer_config(layer))
                name = f"layers.{layer}.{proj}.kernel"
                w = np.asarray(params[name], np.float64)
                kept = w.size // old_out[proj] * new_out[proj]
                rank = svd_rank(w.shape, kept)
                ranks[name] = rank
                out[name] = truncated_svd(w, rank).astype(np.float32)
    return out, ranks
