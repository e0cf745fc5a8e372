"""Linear algebra shared by the A^3 closed forms (Wong et al., arXiv 2505.12942)."""

from __future__ import annotations

import numpy as np


def _gram_root(gram: np.ndarray, eig_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """``(R, R^+)`` with ``R^T R = gram`` (``R = L^1/2 E^T``), eigenvalues below
    ``eig_floor * max`` dropped from the pseudo-inverse."""
    lam, vec = np.linalg.eigh((gram + gram.T) / 2)
    lam = np.clip(lam, 0.0, None)
    root = np.sqrt(lam)[:, None] * vec.T
    keep = lam > eig_floor * max(lam.max(), 1e-300)
    inv_root = np.where(keep, 1.0 / np.sqrt(np.where(keep, lam, 1.0)), 0.0)
    return root, vec * inv_root[None, :]
