"""A3-MLP (Wong et al., arXiv 2505.12942): SwiGLU intermediate width by CUR.

Keep a subset ``S`` of the ``F`` neurons (columns of gate/up, rows of down) and refit
``W_down' = (H_SS + lambda I)^-1 H_S: W_down`` with ``H = E[h h^T]`` of the hidden
``h = silu(gate x) * up x`` (the least-squares optimal read-out given ``S``;
``lambda = mlp_ridge * mean(diag H_SS)``, a small ridge for calibration sets with fewer
tokens than neurons). ``mlp_select="energy"`` keeps the largest
``H_kk ||W_down[k, :]||^2``; ``"greedy"`` adds, one at a time, the neuron that most lowers
the refit output error ``tr(W^T (H - H_:S H_SS^-1 H_S:) W)``.

`mlp_error_curve` gives the refit error at every width along the selection order (mixed ranks).
"""

from __future__ import annotations

import numpy as np

from jaxlm.compress.a3.config import MLP_SELECTS
from jaxlm.compress.a3.weights import _np


def mlp_selection_scores(h: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """``diag(H)_k ||W_down[k, :]||^2``: the output energy neuron ``k`` carries alone."""
    return np.diag(h) * np.sum(w_down * w_down, axis=1)


def _greedy_neurons(h: np.ndarray, w_down: np.ndarray, m: int) -> np.ndarray:
    """The first ``m`` neurons of `_greedy_order`, sorted."""
    return np.sort(np.asarray(_greedy_order(h, w_down, m), np.int64))


def _greedy_order(h: np.ndarray, w_down: np.ndarray, m: int) -> list[int]:
    """Forward selection on the refit error: the Schur complement ``R = H - H_:S H_SS^-1 H_S:``
    is updated by one rank-one step per added neuron; adding ``k`` lowers the error by
    ``||W^T R_:k||^2 / R_kk``."""
    res = h.astype(np.float64).copy()
    proj = res @ w_down  # [F, D]: R W, row k = W^T R_:k
    chosen: list[int] = []
    floor = 1e-12 * max(np.max(np.diag(h)), 1e-300)
    for _ in range(m):
        diag = np.diag(res).copy()
        gain = np.where(diag > floor, np.sum(proj * proj, axis=1) / np.maximum(diag, floor), -np.inf)
        gain[chosen] = -np.inf
        k = int(np.argmax(gain))
        if not np.isfinite(gain[k]):  # the rest is linearly dependent: fill by energy
            rest = [i for i in np.argsort(-mlp_selection_scores(h, w_down)) if i not in chosen]
            chosen.extend(int(i) for i in rest[: m - len(chosen)])
            break
        chosen.append(k)
        col = res[:, k] / np.sqrt(diag[k])
        res -= np.outer(col, col)
        proj -= np.outer(col, proj[k] / np.sqrt(diag[k]))
    return chosen


def mlp_cur(h: np.ndarray, w_down: np.ndarray, m: int, *, select: str = "energy", ridge: float = 1e-6):
    """A3-MLP: kept neuron indices ``[m]`` (sorted) and the refit ``W_down' [m, D]``."""
    if select not in MLP_SELECTS:
        raise ValueError(f"select={select!r} is invalid: must be one of {MLP_SELECTS}")
    if m >= h.shape[0]:  # every neuron kept: the original MLP
        return np.arange(h.shape[0]), np.array(w_down, copy=True)
    if select == "energy":
        keep = np.sort(np.argsort(-mlp_selection_scores(h, w_down), kind="stable")[:m])
    else:
        keep = _greedy_neurons(h, w_down, m)
    h_ss = h[np.ix_(keep, keep)]
    # the ridge pulls toward the kept neurons' own rows, so directions the calibration never
    # reached keep their weights and the full width is exactly the original MLP (a ridge
    # toward 0 would zero them); a floor keeps a dead layer (H = 0) solvable
    lam = max(ridge * float(np.mean(np.diag(h_ss))), 1e-12 * max(float(np.mean(np.diag(h))), 1.0))
    w_new = np.linalg.solve(h_ss + lam * np.eye(m), h[keep] @ w_down + lam * w_down[keep])
    return keep, w_new


def _compress_mlp(params, out, config, stats, a3, layer, width):
    p = f"layers.{layer}.mlp."
    h = np.asarray(stats.mlp_act[layer], np.float64)
    keep, w_down = mlp_cur(h, _np(params[p + "down_proj.kernel"]), width, select=a3.mlp_select, ridge=a3.mlp_ridge)
    for name in ("gate_proj", "up_proj"):
        out[p + name + ".kernel"] = _np(params[p + name + ".kernel"])[:, keep].astype(np.float32)
    out[p + "down_proj.kernel"] = w_down.astype(np.float32)


def mlp_order(h: np.ndarray, w_down: np.ndarray, select: str = "energy") -> np.ndarray:
    """All ``F`` neurons in the order `mlp_cur` adds them (its first ``m`` are the kept set)."""
    if select == "energy":
        return np.argsort(-mlp_selection_scores(h, w_down), kind="stable")
    return np.asarray(_greedy_order(h, w_down, h.shape[0]), np.int64)


def _cholesky_with_ridge(a: np.ndarray, lam: float, tries: int = 8) -> np.ndarray:
    """Cholesky factor of ``a + lam I``; a second moment accumulated in float32 can have
    eigenvalues a little below zero, so ``lam`` grows tenfold until the factor exists."""
    eye = np.eye(len(a), dtype=a.dtype)
    for _ in range(tries):
        try:
            return np.linalg.cholesky(a + lam * eye)
        except np.linalg.LinAlgError:
            lam *= 10.0
    raise np.linalg.LinAlgError(f"the MLP second moment is not positive semidefinite even with ridge {lam:.3g}")


def mlp_error_curve(h: np.ndarray, w_down: np.ndarray, select: str = "energy", ridge: float = 1e-6) -> np.ndarray:
    """``err[m]``, m = 0..F: the least-squares refit output error ``tr(W^T (H - H_:S H_SS^-1 H_S:) W)``
    of the first ``m`` neurons of `mlp_order` (Cholesky of ``H`` in that order; a ridge of
    ``max(ridge, 1e-9) * mean(diag H)`` keeps it defined for rank-deficient ``H``, raised
    tenfold at a time only if rounding left ``H`` indefinite by more than that)."""
    order = mlp_order(h, w_down, select)
    hp = h[np.ix_(order, order)]
    lam = max(ridge, 1e-9) * max(float(np.mean(np.diag(h))), 1e-12)  # defined for a dead layer (H = 0) too
    chol = _cholesky_with_ridge(hp, lam)
    y = np.linalg.solve(chol, h[order] @ w_down)  # row j: the error drop of the j-th added neuron
    gains = np.sum(y * y, axis=1)
    err = float(np.trace(w_down.T @ h @ w_down)) - np.concatenate([[0.0], np.cumsum(gains)])
    return np.minimum.accumulate(np.clip(err, 0.0, None))
