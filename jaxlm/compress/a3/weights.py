"""Flat-parameter access for A^3 (Wong et al., arXiv 2505.12942): plain float64 weight arrays,
per-head views, and kernels augmented with their bias as the last input row."""

from __future__ import annotations

import numpy as np


def _np(x) -> np.ndarray:
    if not hasattr(x, "shape") or type(x).__name__ in ("QArray", "TransformedWeight", "LowRankTransformedWeight"):
        raise ValueError(f"A^3 needs plain weight arrays, got {type(x).__name__}: compress before quantizing")
    return np.asarray(x, np.float64)


def _heads(w: np.ndarray, n: int) -> np.ndarray:
    """``[D, n*H]`` -> ``[n, D, H]``."""
    return w.reshape(w.shape[0], n, -1).transpose(1, 0, 2)


def _unheads(w: np.ndarray) -> np.ndarray:
    return w.transpose(1, 0, 2).reshape(w.shape[1], -1)


def _augmented(params, prefix: str, n: int) -> np.ndarray:
    """``[n, D+1, H]``: kernel per head with the bias (or zeros) as the last input row."""
    w = _heads(_np(params[prefix + ".kernel"]), n)
    b = params.get(prefix + ".bias")
    b = np.zeros((n, 1, w.shape[-1])) if b is None else _np(b).reshape(n, 1, -1)
    return np.concatenate([w, b], axis=1)


def _store_augmented(out: dict, params, prefix: str, w: np.ndarray) -> None:
    out[prefix + ".kernel"] = _unheads(w[:, :-1]).astype(np.float32)
    if prefix + ".bias" in params:
        out[prefix + ".bias"] = w[:, -1].reshape(-1).astype(np.float32)
