"""A^3: analytical low-rank approximation of attention and MLP (Wong et al., arXiv 2505.12942).

A layer is split into three parts, each shrunk in place by a closed form that minimises
that part's output error on calibration statistics (`jaxlm.compress.calibrate`). The
compressed model is the same `Transformer` with smaller widths (``qk_head_dim``,
``v_head_dim``, ``ffn_dim``): no extra matmuls, a smaller KV cache.

A3-QK (query/key head width, minimises the pre-softmax score error)
  * ``rope="none"``: per KV group with query heads ``g = 1..G`` and ``C = E[x x^T]``
    (layer input, augmented with 1 for biases), the score error
    ``sum_g E(x_i^T (W_Qg W_K^T - W_Qg' W_K'^T) x_j)^2 = sum_g ||C^1/2 (W_Qg W_K^T - W_Qg' W_K'^T) C^1/2||_F^2``
    (query and key tokens independent) is minimised by the truncated SVD of the stacked
    ``[C^1/2 W_Q1; ...; C^1/2 W_QG] W_K^T C^1/2 = U S V^T``:
    ``W_Qg' = C^-1/2 U_g,r S_r^1/2`` and ``W_K' = C^-1/2 V_r S_r^1/2`` (shared by the group;
    for ``G = 1`` this is the paper's per-head form). Computed in the ``H``-dimensional column
    spaces of ``W_Q`` and ``W_K`` (``W' = W R^+ U_r S_r^1/2`` with ``R^T R = W^T C W``), which
    equals the formula above when ``C`` is invertible and never forms ``C^-1/2``.
  * RoPE (rotate-half layout): a head-width transform that keeps every score must commute
    with all rotations, so it cannot mix frequencies; rank reduction is the *selection* of
    frequency pairs ``(p, p + H/2)`` per KV head (the same pairs for all its query heads).
    Pairs are ranked by ``qk_score``: ``"score_energy"`` (default), the second moment of the
    pair's share of the scores ``sum_g E[(q_gp(i) . R k_p(j))^2]`` over causal token pairs, or
    ``"norm_product"``, ``sum_g E||q_gp||^2 * E||k_p||^2``. The kept pairs keep their original
    frequencies, stored per layer and KV head in the attention layer (``rope_inv_freq``,
    `jaxlm.models.layers.rope.RopeFrequencies`): heads differ in which frequencies they use,
    so one global choice of pairs in the config would throw away what A^3 selects.
  * ``qk_norm`` (Qwen3) is refused: the RMSNorm over the head width couples all pairs.

A3-OV (value/output head width, minimises the attention-output error)
  ``o_g = z_g W_V W_Og`` with ``z_g(i) = sum_j a_gij x_j`` the attention-weighted input.
  For ``G = 1`` the minimiser of ``||C_z^1/2 (W_V W_O - W_V' W_O')||_F^2`` is the SVD
  ``C_z^1/2 W_V W_O = U S V^T``, ``W_V' = C_z^-1/2 U_r S_r``, ``W_O' = V_r^T`` (exact). With GQA
  the ``G`` query heads share ``W_V'``: we use the group-averaged ``C_z = mean_g C_zg`` and the
  SVD of ``C_z^1/2 W_V [W_O1 ... W_OG]`` (shared ``W_V'``, per-head ``W_Og'``), which is exact
  for the averaged objective. ``ov_group="average_refit"`` then refits each ``W_Og'`` by
  least squares under its own ``C_zg`` (never increases the exact per-head objective).

A3-MLP (SwiGLU intermediate width; CUR)
  Keep a subset ``S`` of the ``F`` neurons (columns of gate/up, rows of down) and refit
  ``W_down' = (H_SS + lambda I)^-1 H_S: W_down`` with ``H = E[h h^T]`` of the hidden
  ``h = silu(gate x) * up x`` (the least-squares optimal read-out given ``S``;
  ``lambda = mlp_ridge * mean(diag H_SS)``, a small ridge for calibration sets with fewer
  tokens than neurons). ``mlp_select="energy"`` keeps the largest
  ``H_kk ||W_down[k, :]||^2``; ``"greedy"`` adds, one at a time, the neuron that most lowers
  the refit output error ``tr(W^T (H - H_:S H_SS^-1 H_S:) W)``.

Budgets are uniform over layers (scanned layers need equal shapes): ``budget`` is the kept
fraction of each compressed component's parameters (rounded to whole pairs / heads /
neurons), or explicit widths. Per-layer (mixed) ranks are not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from jaxlm.compress.calibrate import A3Statistics, check_components

QK_SCORES = ("score_energy", "norm_product")
OV_GROUPS = ("average", "average_refit")
MLP_SELECTS = ("energy", "greedy")


@dataclasses.dataclass(frozen=True)
class A3Config:
    """What to compress and how much.

    components: subset of ``("qk", "ov", "mlp")``.
    budget: kept fraction of each compressed component's parameters, in (0, 1].
    qk_head_dim / v_head_dim / ffn_dim: explicit target widths (override ``budget`` for that
      component).
    """

    components: tuple[str, ...] = ("qk", "ov", "mlp")
    budget: float | None = 0.5
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    ffn_dim: int | None = None
    qk_score: str = "score_energy"
    ov_group: str = "average"
    mlp_select: str = "energy"
    mlp_ridge: float = 1e-6
    eig_floor: float = 1e-10  # relative floor of the Gram eigenvalues in the pseudo-inverses

    def __post_init__(self):
        object.__setattr__(self, "components", check_components(self.components))
        if self.budget is not None and not (isinstance(self.budget, (int, float)) and 0 < self.budget <= 1):
            raise ValueError(f"A3Config.budget={self.budget!r} is invalid: must be in (0, 1] or None")
        for name in ("qk_head_dim", "v_head_dim", "ffn_dim"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"A3Config.{name}={v!r} is invalid: must be a positive int or None")
        for name, allowed in (("qk_score", QK_SCORES), ("ov_group", OV_GROUPS), ("mlp_select", MLP_SELECTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"A3Config.{name}={getattr(self, name)!r} is invalid: must be one of {allowed}")
        if not self.mlp_ridge >= 0:
            raise ValueError(f"A3Config.mlp_ridge={self.mlp_ridge!r} is invalid: must be >= 0")


# ------------------------------------------------------------------------------ budgets
def a3_widths(config, a3: A3Config) -> dict[str, int]:
    """Target ``{qk_head_dim, v_head_dim, ffn_dim}`` (unchanged for components not compressed)."""

    def pick(name, current, component, step):
        explicit = getattr(a3, name)
        if component not in a3.components:
            return current
        if explicit is not None:
            width = explicit
        elif a3.budget is None:
            raise ValueError(f"A3Config: component {component!r} needs budget or {name}")
        else:
            width = max(step, step * int(round(a3.budget * current / step)))
        if width > current or width % step:
            raise ValueError(f"A3Config.{name}={width} is invalid: must be <= the current {current}"
                             + (" and even (RoPE pairs)" if step == 2 else ""))
        return width

    qk_step = 1 if config.rope == "none" else 2
    return {
        "qk_head_dim": pick("qk_head_dim", config.qk_head_dim, "qk", qk_step),
        "v_head_dim": pick("v_head_dim", config.v_head_dim, "ov", 1),
        "ffn_dim": pick("ffn_dim", config.ffn_dim, "mlp", 1),
    }


def check_compressible(config, components) -> None:
    """Clear errors for the variants a component's closed form does not cover."""
    if "qk" in components:
        if config.qk_norm:
            raise ValueError(
                "A3-QK: ModelConfig.qk_norm=True (Qwen3) normalises q and k over the whole head, so "
                "dropping pairs changes the kept ones; compress with components=('ov', 'mlp')"
            )
        if config.rope not in ("default", "none"):
            raise ValueError(f"A3-QK: ModelConfig.rope={config.rope!r} is not supported: must be 'default' or 'none'")
    if "ov" in components and config.attention not in ("softmax", "sink"):
        raise ValueError(
            f"A3-OV: ModelConfig.attention={config.attention!r} is not supported: must be 'softmax' or 'sink'"
        )
    if "mlp" in components and config.mlp != "swiglu":
        raise ValueError(f"A3-MLP: ModelConfig.mlp={config.mlp!r} is not supported: must be 'swiglu'")


# ------------------------------------------------------------------------ linear algebra
def _gram_root(gram: np.ndarray, eig_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """``(R, R^+)`` with ``R^T R = gram`` (``R = L^1/2 E^T``), eigenvalues below
    ``eig_floor * max`` dropped from the pseudo-inverse."""
    lam, vec = np.linalg.eigh((gram + gram.T) / 2)
    lam = np.clip(lam, 0.0, None)
    root = np.sqrt(lam)[:, None] * vec.T
    keep = lam > eig_floor * max(lam.max(), 1e-300)
    inv_root = np.where(keep, 1.0 / np.sqrt(np.where(keep, lam, 1.0)), 0.0)
    return root, vec * inv_root[None, :]


def qk_factors(wq: np.ndarray, wk: np.ndarray, c: np.ndarray, rank: int, *, eig_floor: float = 1e-10):
    """A3-QK without RoPE for one KV group.

    wq ``[G, D, H]`` (the group's query heads), wk ``[D, H]``, c ``[D, D]`` input second moment.
    Returns ``wq' [G, D, r]``, ``wk' [D, r]`` and the singular values ``[H]`` of the stacked,
    whitened score map; the score error ``sum_g ||C^1/2 (W_Qg W_K^T - W_Qg' W_K'^T) C^1/2||_F^2``
    equals ``sum_{i > r} s_i^2``.
    """
    gram_q = np.einsum("gdh,de,gef->hf", wq, c, wq)
    gram_k = wk.T @ c @ wk
    rq, rq_inv = _gram_root(gram_q, eig_floor)
    rk, rk_inv = _gram_root(gram_k, eig_floor)
    u, s, vt = np.linalg.svd(rq @ rk.T)
    root_s = np.sqrt(s[:rank])
    wq_new = np.einsum("gdh,hr->gdr", wq, rq_inv @ u[:, :rank] * root_s)
    wk_new = wk @ (rk_inv @ vt[:rank].T * root_s)
    return wq_new, wk_new, s


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
    wv_new = wv @ (rv_inv @ u[:, :rank] * s[:rank])
    wo_new = vt[:rank].reshape(rank, G, Dout).transpose(1, 0, 2)
    if group == "average_refit":
        for g in range(G):  # W_Og' = (W_V'^T C_g W_V')^+ W_V'^T C_g W_V W_Og
            lhs = wv_new.T @ cz[g] @ wv_new
            rhs = wv_new.T @ cz[g] @ wv @ wo[g]
            wo_new[g] = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
    return wv_new, wo_new, s


def mlp_selection_scores(h: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    """``diag(H)_k ||W_down[k, :]||^2``: the output energy neuron ``k`` carries alone."""
    return np.diag(h) * np.sum(w_down * w_down, axis=1)


def _greedy_neurons(h: np.ndarray, w_down: np.ndarray, m: int) -> np.ndarray:
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
    return np.sort(np.asarray(chosen, np.int64))


def mlp_cur(h: np.ndarray, w_down: np.ndarray, m: int, *, select: str = "energy", ridge: float = 1e-6):
    """A3-MLP: kept neuron indices ``[m]`` (sorted) and the refit ``W_down' [m, D]``."""
    if select not in MLP_SELECTS:
        raise ValueError(f"select={select!r} is invalid: must be one of {MLP_SELECTS}")
    if select == "energy":
        keep = np.sort(np.argsort(-mlp_selection_scores(h, w_down), kind="stable")[:m])
    else:
        keep = _greedy_neurons(h, w_down, m)
    h_ss = h[np.ix_(keep, keep)]
    lam = ridge * float(np.mean(np.diag(h_ss)))
    w_new = np.linalg.solve(h_ss + lam * np.eye(m), h[keep] @ w_down)
    return keep, w_new


def select_rope_pairs(score: np.ndarray, n_keep: int) -> np.ndarray:
    """``score [K, P]`` -> the ``n_keep`` best pairs per KV head ``[K, n_keep]``, in increasing
    order (keeping every pair is the identity)."""
    order = np.argsort(-score, axis=-1, kind="stable")[:, :n_keep]
    return np.sort(order, axis=-1)


def qk_pair_scores(stats: A3Statistics, layer: int, n_kv_heads: int, kind: str) -> np.ndarray:
    """``[K, P]`` pair scores of layer ``layer``, summed over each group's query heads."""
    if kind not in QK_SCORES:
        raise ValueError(f"qk_score={kind!r} is invalid: must be one of {QK_SCORES}")
    if kind == "score_energy":
        e = np.asarray(stats.pair_score_energy[layer], np.float64)
        return e.reshape(n_kv_heads, -1, e.shape[-1]).sum(1)
    q = np.asarray(stats.q_pair_energy[layer], np.float64)
    q = q.reshape(n_kv_heads, -1, q.shape[-1]).sum(1)
    return q * np.asarray(stats.k_pair_energy[layer], np.float64)


# ---------------------------------------------------------------------------- the method
def _np(x) -> np.ndarray:
    if not hasattr(x, "shape") or type(x).__name__ in ("QArray", "TransformedWeight", "LowRankTransformedWeight"):
        raise ValueError(f"A^3 needs plain weight arrays, got {type(x).__name__}: compress before quantizing")
    return np.asarray(x, np.float64)


def current_rope_frequencies(params: Mapping, config, layer: int) -> np.ndarray:
    """``[K, qk_head_dim/2]`` inverse frequencies layer ``layer`` rotates its pairs with."""
    name = f"layers.{layer}.attn.rope_inv_freq"
    if name in params:
        return np.asarray(params[name], np.float32)
    from jaxlm.models.layers.rope import inv_frequencies

    return np.tile(np.asarray(inv_frequencies(config), np.float32), (config.n_kv_heads, 1))


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


def _compress_qk(params, out, config, stats, a3, layer, width):
    N, K = config.n_heads, config.n_kv_heads
    G = N // K
    p = f"layers.{layer}.attn."
    wq = _augmented(params, p + "q_proj", N)  # [N, D+1, H]
    wk = _augmented(params, p + "k_proj", K)
    if config.rope == "none":
        c = np.asarray(stats.attn_in[layer], np.float64)
        new_q, new_k = [], []
        for k in range(K):
            q_g, k_new, _ = qk_factors(wq[k * G:(k + 1) * G], wk[k], c, width, eig_floor=a3.eig_floor)
            new_q.append(q_g)
            new_k.append(k_new)
        wq_new, wk_new = np.concatenate(new_q), np.stack(new_k)
    else:
        half = config.qk_head_dim // 2
        keep = select_rope_pairs(qk_pair_scores(stats, layer, K, a3.qk_score), width // 2)  # [K, r/2]
        cols = np.concatenate([keep, keep + half], axis=-1)  # [K, r]
        wk_new = np.take_along_axis(wk, cols[:, None, :], axis=-1)
        wq_new = np.take_along_axis(wq, np.repeat(cols, G, axis=0)[:, None, :], axis=-1)
        freq = np.take_along_axis(current_rope_frequencies(params, config, layer), keep, axis=-1)
        out[p + "rope_inv_freq"] = freq.astype(np.float32)
    _store_augmented(out, params, p + "q_proj", wq_new)
    _store_augmented(out, params, p + "k_proj", wk_new)


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


def _compress_mlp(params, out, config, stats, a3, layer, width):
    p = f"layers.{layer}.mlp."
    h = np.asarray(stats.mlp_act[layer], np.float64)
    keep, w_down = mlp_cur(h, _np(params[p + "down_proj.kernel"]), width, select=a3.mlp_select, ridge=a3.mlp_ridge)
    for name in ("gate_proj", "up_proj"):
        out[p + name + ".kernel"] = _np(params[p + name + ".kernel"])[:, keep].astype(np.float32)
    out[p + "down_proj.kernel"] = w_down.astype(np.float32)


def a3_compress(params: Mapping[str, object], config, stats: A3Statistics, a3: A3Config = A3Config()):
    """``(flat params, ModelConfig, statistics) -> (flat params, compressed ModelConfig)``.

    ``params``: the flat view (`jaxlm.models.params.flat_params`); ``stats`` from
    `jaxlm.compress.a3_statistics` on the same model with (at least) ``a3.components``.
    Untouched parameters are passed through; `jaxlm.models.params.model_from_flat` builds the
    compressed model.
    """
    check_compressible(config, a3.components)
    widths = a3_widths(config, a3)
    need = {"qk": "attn_in" if config.rope == "none" else
            ("pair_score_energy" if a3.qk_score == "score_energy" else "q_pair_energy"),
            "ov": "attn_z", "mlp": "mlp_act"}
    for comp in a3.components:
        if getattr(stats, need[comp]) is None:
            raise ValueError(f"A3Statistics.{need[comp]} is missing: collect the statistics with {comp!r} "
                             "in components")
    new_config = config.replace(**widths)
    out = dict(params)
    for layer in range(config.n_layers):
        if "qk" in a3.components:
            _compress_qk(params, out, config, stats, a3, layer, widths["qk_head_dim"])
        if "ov" in a3.components:
            _compress_ov(params, out, config, stats, a3, layer, widths["v_head_dim"])
        if "mlp" in a3.components:
            _compress_mlp(params, out, config, stats, a3, layer, widths["ffn_dim"])
        name = f"layers.{layer}.attn.rope_inv_freq"
        if not new_config.rope_pairs_selected:
            out.pop(name, None)
    return out, new_config
