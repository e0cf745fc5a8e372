"""A3-OV (Wong et al., arXiv 2505.12942): value/output head width, minimising the
attention-output error.

``o_g = z_g W_V W_Og`` with ``z_g(i) = sum_j a_gij x_j`` the attention-weighted input.
For ``G = 1`` the minimiser of ``||C_z^1/2 (W_V W_O - W_V' W_O')||_F^2`` is the SVD
``C_z^1/2 W_V W_O = U S V^T``, ``W_V' = C_z^-1/2 U_r S_r``, ``W_O' = V_r^T`` (exact). With GQA
the ``G`` query heads share ``W_V'``: we use the group-averaged ``C_z = mean_g C_zg`` and the
SVD of ``C_z^1/2 W_V [W_O1 ... W_OG]`` (shared ``W_V'``, per-head ``W_Og'``), which is exact
for the averaged objective. ``ov_group="average_refit"`` then refits each ``W_Og'`` by
least squares under its own ``C_zg`` (never increases the exact per-head objective).
"""

from __future__ import annotations

import numpy as np

from jaxlm.compress.a3.config import OV_GROUPS
from jaxlm.compress.a3.linalg import _gram_root
from jaxlm.compress.a3.weights import _augmented, _np, _store_augmented


def ov_factors(wv: np.ndarray, wo: np.ndarray, cz: np.ndarray, rank: int, *, group: str = "average",
               eig_floor: float = 1e-10):
    """A3-OV for one KV group.

    wv ``[D, Hv]``, wo ``[G, Hv, Dout]`` (the group's rows of ``o_proj``), cz ``[G, D, D]`` each
    query head's ``E[z z^T]``. Returns ``wv' [D, r]``, ``wo' [G, r, Dout]`` and the singular
    values of ``C_z^1/2 W_V [W_O1 ... W_OG]`` (``C_z`` the group mean); with ``group="average"``
    ``||C_z^1/2 W_V [W_Og]_g - C_z^1/2 W_V' [W_Og']_g||_F^2 = sum_{i > r} s_i^2``.
    """
    if group not in OV_GROUPS:
        raise ValueError(f"group={group!r} is invalid: must be one of {OV_GROUPS}")
    G, Hv, Dout = wo.shape
    c_mean = cz.mean(0)
    rv, rv_inv = _gram_root(wv.T @ c_mean @ wv, eig_floor)
    wo_cat = wo.transpose(1, 0, 2).reshape(Hv, G * Dout)
    u, s, vt = np.linalg.svd(rv @ wo_cat, full_matrices=False)
    if rank >= Hv:  # full width: the same function, also where the calibration never reached (C_z singular)
        return wv.copy(), wo.copy(), s
    wv_new = wv @ (rv_inv @ u[:, :rank] * s[:rank])
    wo_new = vt[:rank].reshape(rank, G, Dout).transpose(1, 0, 2)
    if group == "average_refit":
        for g in range(G):  # W_Og' = (W_V'^T C_g W_V')^+ W_V'^T C_g W_V W_Og
            lhs = wv_new.T @ cz[g] @ wv_new
            rhs = wv_new.T @ cz[g] @ wv @ wo[g]
            wo_new[g] = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
    return wv_new, wo_new, s


def _compress_ov(params, out, config, stats, a3, layer, width):
    N, K = config.n_heads, config.n_kv_heads
    G = N // K
    p = f"layers.{layer}.attn."
    wv = _augmented(params, p + "v_proj", K)  # [K, D+1, Hv]
    wo = _np(params[p + "o_proj.kernel"]).reshape(N, config.v_head_dim, -1)  # [N, Hv, D]
    cz = np.asarray(stats.attn_z[layer], np.float64)  # [N or K, D+1, D+1]
    per_head = cz.shape[0] == N
    if a3.ov_group == "average_refit" and G > 1 and not per_head:
        raise ValueError('A3Config.ov_group="average_refit" needs per-head statistics: '
                         "a3_statistics(..., per_head_z=True)")
    new_v, new_o = [], []
    for k in range(K):
        cz_group = cz[k * G:(k + 1) * G] if per_head else cz[k][None]  # the mean is all "average" uses
        v_new, o_new, _ = ov_factors(wv[k], wo[k * G:(k + 1) * G], cz_group, width,
                                     group=a3.ov_group, eig_floor=a3.eig_floor)
        new_v.append(v_new)
        new_o.append(o_new)
    _store_augmented(out, params, p + "v_proj", np.stack(new_v))
    out[p + "o_proj.kernel"] = np.concatenate(new_o).reshape(N * width, -1).astype(np.float32)
