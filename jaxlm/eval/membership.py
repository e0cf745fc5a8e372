"""HaloScope's membership score (Du et al. 2024, "HaloScope: Harnessing Unlabeled LLM
Generations for Hallucination Detection", arXiv 2409.17504): an unsupervised hallucination
score from the embeddings of unlabeled generations, one of the detectors ARS's shaped
embeddings feed (method card §7.3).

With ``F`` the centred embeddings ``[N, D]`` and ``v_j`` / ``sigma_j`` the top singular
vectors and values of ``F``, sample ``i`` scores

    paper:     zeta_i = 1/k  sum_{j<=k} sigma_j     <f_i, v_j>^2
    whitened:  zeta_i =      sum_{j<=k} sigma_j^-2  <f_i, v_j>^2     (the ARS authors' script)

Truthful and hallucinated generations separate along the top subspace, but which end is
which, and ``k``, are not known without labels: `select_membership` picks both on a small
labelled subset. The paper weights by ``sigma_j`` and averages; the ARS authors' script
whitens instead: ``weighting`` chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from jaxlm.eval.selective import auroc

Weighting = Literal["paper", "whitened"]


def membership_scores(x, k: int, *, weighting: Weighting = "paper", fit=None) -> np.ndarray:
    """``zeta [N]`` for embeddings ``x [N, D]`` (module docstring). The subspace and mean come
    from ``fit [M, D]`` (default: ``x`` itself, the unlabeled set being scored)."""
    x = np.asarray(x, np.float64)
    ref = x if fit is None else np.asarray(fit, np.float64)
    if x.ndim != 2 or ref.ndim != 2 or ref.shape[1] != x.shape[1]:
        raise ValueError(f"x and fit must be [N, D] with the same D, got {x.shape} and {ref.shape}")
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or not 1 <= k <= min(ref.shape):
        raise ValueError(f"k={k!r} must be an int in [1, {min(ref.shape)}] (min of the fit set's N and D)")
    k = int(k)
    if weighting not in ("paper", "whitened"):
        raise ValueError(f"weighting={weighting!r} must be 'paper' or 'whitened'")
    mean = ref.mean(axis=0)
    _, sigma, vt = np.linalg.svd(ref - mean, full_matrices=False)
    if weighting == "whitened" and k > _rank(sigma, ref.shape):
        # whitening divides by sigma^2: a direction the centred fit set does not span (sigma at
        # rounding level, e.g. the N-th one of N points) would dominate every score
        raise ValueError(f"k={k} exceeds the rank {_rank(sigma, ref.shape)} of the centred fit set (N points span "
                         "at most N - 1 directions): weighting='whitened' needs k <= that rank")
    proj = (x - mean) @ vt[:k].T
    if weighting == "paper":
        return (proj**2 * sigma[:k]).sum(axis=1) / k
    return (proj**2 / np.maximum(sigma[:k], 1e-12) ** 2).sum(axis=1)


def _rank(sigma: np.ndarray, shape: tuple[int, int]) -> int:
    """Numerical rank: singular values above ``max(N, D) * eps * sigma_max`` (numpy's rule)."""
    if not sigma.size:
        return 0
    return int((sigma > max(shape) * np.finfo(np.float64).eps * sigma[0]).sum())


def select_membership(x, labelled: np.ndarray, correct: np.ndarray, *, ks: Sequence[int] | None = None,
                      weighting: Weighting = "paper") -> tuple[int, float, float]:
    """``(k, sign, auroc)``: the ``k`` and orientation whose score ``sign * zeta`` best ranks
    the labelled rows ``x[labelled]`` by ``correct`` (AUROC; a higher score means "right");
    ``labelled``: row indices or a boolean mask over the rows, ``correct`` one per labelled row.
    The scores are computed on all of ``x`` (the unlabeled set). ``ks``: the candidates
    (default 1..10, those up to ``min(N, D)``)."""
    if ks is None:
        shape = np.shape(x)
        top = min(10, *shape) if len(shape) == 2 else 1
        if weighting == "whitened" and len(shape) == 2:
            xx = np.asarray(x, np.float64)
            top = min(top, max(1, _rank(np.linalg.svd(xx - xx.mean(0), compute_uv=False), xx.shape)))
        ks = tuple(range(1, top + 1))
    if not len(ks):
        raise ValueError("ks is empty: give at least one subspace dimension k")
    labelled = np.asarray(labelled)
    if labelled.dtype == bool:  # a mask over the rows of x
        if labelled.shape != np.shape(x)[:1]:
            raise ValueError(f"labelled is a boolean mask of shape {labelled.shape}: it must have one entry per row "
                             f"of x ({np.shape(x)[0]})")
        labelled = np.flatnonzero(labelled)
    raw = np.asarray(correct)
    if raw.dtype != bool and not np.isin(raw, (0, 1)).all():  # 2 or 0.5 were read as True
        raise ValueError(f"correct must hold 0/1 (or bools), got values {np.unique(raw)[:5].tolist()}")
    correct = raw.astype(bool)
    if correct.shape != labelled.shape:
        raise ValueError(f"correct {correct.shape} must match labelled {labelled.shape}")
    best = (ks[0], 1.0, -1.0)
    for k in ks:
        zeta = membership_scores(x, k, weighting=weighting)[labelled]
        for sign in (1.0, -1.0):
            a = auroc(sign * zeta, correct)
            if a > best[2]:
                best = (k, sign, a)
    return best
