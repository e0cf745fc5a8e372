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
    ``qk_rope_refit`` (default) then refits each query head's kept columns (the least-squares
    middle factor of CUR, as for the MLP) on the full model's RoPE'd scores over causal
    calibration token pairs (`qk_rope_refit`; optional alternating key refits), which absorbs
    much of what the dropped pairs carried.
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

Budgets: ``budget`` is the kept fraction of each compressed component's parameters (rounded
to whole pairs / heads / neurons), or explicit widths. ``allocation="uniform"`` (default) gives
every layer that width. ``allocation="global"`` (mixed ranks) keeps the same total width per
component, hence the same parameter count, but distributes it over layers to minimise the
summed calibration error of that component: each layer's closed form gives its error as a
function of its width (`a3_error_curves`: the discarded squared singular values for QK without
RoPE and for OV, the dropped pair scores for RoPE QK, the refit error along the selection order
for the MLP), and `allocate_widths` adds one unit (a pair / a head column / a neuron) at a time
where it lowers the summed error most (optimal for the convex QK/OV curves; for the MLP the
uniform split is kept if it scores better). The result has per-layer widths
(``ModelConfig.layer_qk_head_dims`` ...), which need unrolled layers: a scanned input model is
returned unrolled (``scan_layers=False``; flat parameters do not depend on the layout).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from jaxlm.compress.calibrate import QK_REFIT_WEIGHTS, A3Statistics, check_components, qk_refit_sums

QK_SCORES = ("score_energy", "norm_product")
OV_GROUPS = ("average", "average_refit")
MLP_SELECTS = ("energy", "greedy")
ALLOCATIONS = ("uniform", "global")
#: compressed width -> (component, per-layer config field)
_WIDTHS = {"qk_head_dim": ("qk", "layer_qk_head_dims"), "v_head_dim": ("ov", "layer_v_head_dims"),
           "ffn_dim": ("mlp", "layer_ffn_dims")}


@dataclasses.dataclass(frozen=True)
class A3Config:
    """What to compress and how much.

    components: subset of ``("qk", "ov", "mlp")``.
    budget: kept fraction of each compressed component's parameters, in (0, 1].
    qk_head_dim / v_head_dim / ffn_dim: explicit target widths (override ``budget`` for that
      component).
    allocation: ``"uniform"`` (every layer the same width) or ``"global"`` (the same total
      width per component, split over layers by greedy marginal gains of the closed-form
      error curves; the model gets per-layer widths and unrolled layers).
    qk_rope_refit: under RoPE, refit the kept query columns (and biases) of every query head by
      least squares on the full model's pre-softmax scores over calibration token pairs, after
      the pair selection (`qk_rope_refit`; CUR's middle factor for QK). Needs a second
      calibration pass: `compress_model` runs it; `a3_compress` takes its result as
      ``qk_refit``. Ignored without RoPE (the closed form is already the optimum there).
    qk_refit_ridge: ridge of the refit, relative to the mean diagonal of its normal matrix,
      pulling towards the selected (unrefit) columns (so directions the calibration inputs never
      reach keep their original weights, and full rank stays exact), >= 0.
    qk_refit_als: extra alternating rounds (refit the keys for the refit queries, then the
      queries again), >= 0; each is two more calibration passes and never increases the
      (ridge-regularised) calibration objective.
    qk_refit_weight: ``"uniform"`` (every causal token pair equally: the score error) or
      ``"attention"`` (each pair weighted by the full model's attention probability).
    qk_refit_rank: refit only along this many leading directions of the layer input's second
      moment (None: all ``d_model`` (+1 with biases) inputs). The normal matrices have
      ``(m * r)^2`` entries per KV group and layer (``r`` the kept width), so large models
      need it.
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
    allocation: str = "uniform"
    qk_rope_refit: bool = True
    qk_refit_ridge: float = 1e-4
    qk_refit_als: int = 0
    qk_refit_weight: str = "uniform"
    qk_refit_rank: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "components", check_components(self.components))
        if self.budget is not None and not (isinstance(self.budget, (int, float)) and 0 < self.budget <= 1):
            raise ValueError(f"A3Config.budget={self.budget!r} is invalid: must be in (0, 1] or None")
        for name in ("qk_head_dim", "v_head_dim", "ffn_dim"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"A3Config.{name}={v!r} is invalid: must be a positive int or None")
        for name, allowed in (("qk_score", QK_SCORES), ("ov_group", OV_GROUPS), ("mlp_select", MLP_SELECTS),
                              ("allocation", ALLOCATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"A3Config.{name}={getattr(self, name)!r} is invalid: must be one of {allowed}")
        if not self.mlp_ridge >= 0:
            raise ValueError(f"A3Config.mlp_ridge={self.mlp_ridge!r} is invalid: must be >= 0")
        if not isinstance(self.qk_rope_refit, bool):
            raise ValueError(f"A3Config.qk_rope_refit={self.qk_rope_refit!r} is invalid: must be a bool")
        if isinstance(self.qk_refit_ridge, bool) or not (isinstance(self.qk_refit_ridge, (int, float))
                                                        and self.qk_refit_ridge >= 0):
            raise ValueError(f"A3Config.qk_refit_ridge={self.qk_refit_ridge!r} is invalid: must be a number >= 0")
        if isinstance(self.qk_refit_als, bool) or not isinstance(self.qk_refit_als, int) or self.qk_refit_als < 0:
            raise ValueError(f"A3Config.qk_refit_als={self.qk_refit_als!r} is invalid: must be an int >= 0")
        if self.qk_refit_rank is not None and (isinstance(self.qk_refit_rank, bool)
                                               or not isinstance(self.qk_refit_rank, int) or self.qk_refit_rank <= 0):
            raise ValueError(f"A3Config.qk_refit_rank={self.qk_refit_rank!r} is invalid: must be a positive int or None")
        if self.qk_refit_weight not in QK_REFIT_WEIGHTS:
            raise ValueError(f"A3Config.qk_refit_weight={self.qk_refit_weight!r} is invalid: must be one of "
                             f"{QK_REFIT_WEIGHTS}")


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
        if config.k_shift:
            raise ValueError("A3-QK: ModelConfig.k_shift=True (a Q-FIT key shift) is not supported: compress "
                             "before Q-FIT, or with components=('ov', 'mlp')")
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


def _compress_qk(params, out, config, stats, a3, layer, width, refit=None):
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
        if refit is not None:  # qk_rope_refit's least-squares columns for these pairs
            if refit[0].shape != wq_new.shape or refit[1].shape != wk_new.shape:
                raise ValueError(f"qk_refit for layer {layer} has shapes {refit[0].shape}, {refit[1].shape}, "
                                 f"not {wq_new.shape}, {wk_new.shape}: refit with the same A3Config and statistics")
            wq_new, wk_new = refit
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


# --------------------------------------------------------- mixed ranks (allocation="global")
def _tail(values: np.ndarray) -> np.ndarray:
    """``[n]`` per-unit error shares, largest first -> ``err[r] = sum_{i >= r} values[i]``, r = 0..n."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0.0]])


def mlp_order(h: np.ndarray, w_down: np.ndarray, select: str = "energy") -> np.ndarray:
    """All ``F`` neurons in the order `mlp_cur` adds them (its first ``m`` are the kept set)."""
    if select == "energy":
        return np.argsort(-mlp_selection_scores(h, w_down), kind="stable")
    return np.asarray(_greedy_order(h, w_down, h.shape[0]), np.int64)


def mlp_error_curve(h: np.ndarray, w_down: np.ndarray, select: str = "energy", ridge: float = 1e-6) -> np.ndarray:
    """``err[m]``, m = 0..F: the least-squares refit output error ``tr(W^T (H - H_:S H_SS^-1 H_S:) W)``
    of the first ``m`` neurons of `mlp_order` (Cholesky of ``H`` in that order; a ridge of
    ``max(ridge, 1e-9) * mean(diag H)`` keeps it defined for rank-deficient ``H``)."""
    order = mlp_order(h, w_down, select)
    hp = h[np.ix_(order, order)]
    lam = max(ridge, 1e-9) * float(np.mean(np.diag(h)))
    chol = np.linalg.cholesky(hp + lam * np.eye(len(order)))
    y = np.linalg.solve(chol, h[order] @ w_down)  # row j: the error drop of the j-th added neuron
    gains = np.sum(y * y, axis=1)
    err = float(np.trace(w_down.T @ h @ w_down)) - np.concatenate([[0.0], np.cumsum(gains)])
    return np.minimum.accumulate(np.clip(err, 0.0, None))


def a3_error_curves(params: Mapping[str, object], config, stats: A3Statistics, a3: A3Config) -> dict[str, list]:
    """``{width field: [err_l]}`` for the compressed components: ``err_l[w]`` is layer ``l``'s
    calibration error of that component at width ``w`` (0..current; under RoPE only even
    ``w`` are reachable, odd entries repeat the lower even one). Same units across layers, so
    sums over layers are the component's total error."""
    N, K = config.n_heads, config.n_kv_heads
    G = N // K
    out = {}
    for name, (comp, _) in _WIDTHS.items():
        if comp not in a3.components:
            continue
        curves = []
        for layer in range(config.n_layers):
            p = f"layers.{layer}."
            if comp == "qk" and config.rope != "none":
                score = qk_pair_scores(stats, layer, K, a3.qk_score)  # [K, P]
                pairs = _tail(np.sort(score, axis=-1)[:, ::-1].sum(0))  # err at n kept pairs per head
                curves.append(np.repeat(pairs, 2)[: config.qk_head_dim + 1])
            elif comp == "qk":
                wq, wk = _augmented(params, p + "attn.q_proj", N), _augmented(params, p + "attn.k_proj", K)
                c = np.asarray(stats.attn_in[layer], np.float64)
                s2 = sum(qk_factors(wq[k * G:(k + 1) * G], wk[k], c, 1, eig_floor=a3.eig_floor)[2] ** 2
                         for k in range(K))
                curves.append(_tail(s2))
            elif comp == "ov":
                wv = _augmented(params, p + "attn.v_proj", K)
                wo = _np(params[p + "attn.o_proj.kernel"]).reshape(N, config.v_head_dim, -1)
                cz = np.asarray(stats.attn_z[layer], np.float64)
                per_head = cz.shape[0] == N
                s2 = sum(ov_factors(wv[k], wo[k * G:(k + 1) * G], cz[k * G:(k + 1) * G] if per_head else cz[k][None],
                                    1, eig_floor=a3.eig_floor)[2] ** 2 for k in range(K))
                curves.append(_tail(np.pad(s2, (0, config.v_head_dim - len(s2)))))
            else:
                curves.append(mlp_error_curve(np.asarray(stats.mlp_act[layer], np.float64),
                                              _np(params[p + "mlp.down_proj.kernel"]), a3.mlp_select, a3.mlp_ridge))
        out[name] = curves
    return out


def allocate_widths(curves, total: int, step: int = 1) -> list[int]:
    """Per-layer widths (multiples of ``step``, at least ``step``, summing to ``total``) that
    minimise ``sum_l curves[l][w_l]``: greedy, one ``step`` at a time to the layer whose error
    drops most (optimal when every curve is convex, as the discarded-spectrum curves are).
    The uniform split ``total / L`` is returned instead when it scores lower."""
    L = len(curves)
    units = [np.asarray(c, np.float64)[::step] for c in curves]  # error at 0, step, 2 step, ...
    n = total // step
    if total % step or not L <= n <= sum(len(u) - 1 for u in units):
        raise ValueError(f"allocate_widths: total={total} must be a multiple of step={step} between "
                         f"{L * step} and the full width")
    kept = [1] * L
    for _ in range(n - L):
        gains = [u[r] - u[r + 1] if r + 1 < len(u) else -np.inf for u, r in zip(units, kept)]
        kept[int(np.argmax(gains))] += 1
    if n % L == 0:
        uniform = [n // L] * L
        if sum(u[r] for u, r in zip(units, uniform)) < sum(u[r] for u, r in zip(units, kept)):
            kept = uniform
    return [r * step for r in kept]


def _plan(params: Mapping[str, object], config, stats: A3Statistics, a3: A3Config):
    """``(per-layer widths {field: [w_l]}, compressed ModelConfig)``."""
    widths = a3_widths(config, a3)
    L = config.n_layers
    if a3.allocation == "global":
        curves = a3_error_curves(params, config, stats, a3)
        layer_widths = {name: [widths[name]] * L for name in widths}
        for name, c in curves.items():
            step = 1 if name != "qk_head_dim" or config.rope == "none" else 2
            if config.kv_quant is not None and name != "ffn_dim":
                step = np.lcm(step, 16)  # a low-bit KV cache quantizes blocks of 16
            layer_widths[name] = allocate_widths(c, L * widths[name], int(step))
        new_config = config.replace(scan_layers=False, **{
            _WIDTHS[name][1]: tuple(int(w) for w in layer_widths[name]) for name in curves})
    else:
        layer_widths = {name: [widths[name]] * L for name in widths}
        new_config = config.replace(**widths)
    return layer_widths, new_config


def _check_inputs(config, stats: A3Statistics, a3: A3Config) -> None:
    check_compressible(config, a3.components)
    if config.per_layer_dims:
        raise ValueError("a3_compress: the model already has per-layer widths (ModelConfig.layer_*_dims); "
                         "compress the uncompressed model instead")
    need = {"qk": "attn_in" if config.rope == "none" else
            ("pair_score_energy" if a3.qk_score == "score_energy" else "q_pair_energy"),
            "ov": "attn_z", "mlp": "mlp_act"}
    for comp in a3.components:
        if getattr(stats, need[comp]) is None:
            raise ValueError(f"A3Statistics.{need[comp]} is missing: collect the statistics with {comp!r} "
                             "in components")


def needs_qk_refit(config, a3: A3Config) -> bool:
    """Whether `a3_compress` needs `qk_rope_refit`'s result (``qk_rope_refit`` on, QK compressed, RoPE)."""
    return a3.qk_rope_refit and "qk" in a3.components and config.rope != "none"


# ------------------------------------------------------------- RoPE refit of the kept pairs
@dataclasses.dataclass
class QKRefit:
    """Result of `qk_rope_refit`: ``weights {layer: (wq [N, D+1, r], wk [K, D+1, r])}`` (kept
    columns with the bias as the last row) and ``errors {layer: [relative calibration score
    error]}``: after the selection, then after each least-squares step (query, then key + query
    per ALS round), each ``sum w (s' - s)^2 / sum w s^2`` over the calibration token pairs."""

    weights: dict
    errors: dict


def rope_pair_selection(params: Mapping[str, object], config, stats: A3Statistics, a3: A3Config) -> dict:
    """``{layer: (keep [K, r/2] pair indices, columns [K, r], inverse frequencies [K, r/2])}``: what
    A3-QK keeps under RoPE at the widths `a3_compress` uses."""
    layer_widths, _ = _plan(params, config, stats, a3)
    half = config.qk_head_dim // 2
    out = {}
    for layer, width in enumerate(layer_widths["qk_head_dim"]):
        keep = select_rope_pairs(qk_pair_scores(stats, layer, config.n_kv_heads, a3.qk_score), width // 2)
        freq = np.take_along_axis(current_rope_frequencies(params, config, layer), keep, axis=-1)
        out[layer] = (keep, np.concatenate([keep, keep + half], axis=-1), freq)
    return out


_REFIT_MAX_ENTRIES = 2**28  # float64 normal-matrix entries over all layers (2 GiB)


def refit_basis(c: np.ndarray, bias: bool, rank: int | None) -> np.ndarray:
    """``[D+1, m]`` input basis of the refit steps: all inputs (``rank=None``: the unit vectors,
    without the bias coordinate unless the model has that bias), or the ``rank`` leading
    eigenvectors of the (augmented) input second moment ``c = E[x x^T]`` (cheaper: ``(rank r)^2``
    normal matrices; the columns outside it keep their current weights)."""
    d1 = c.shape[0]
    n = d1 if bias else d1 - 1
    if rank is None or rank >= n:
        return np.eye(d1)[:, :n]
    lam, vec = np.linalg.eigh(c[:n, :n])
    basis = np.zeros((d1, rank))
    basis[:n] = vec[:, ::-1][:, :rank]
    return basis


def _refit_step(gram: np.ndarray, rhs: np.ndarray, ridge: float) -> np.ndarray:
    """``argmin Delta^T A Delta - 2 Delta . b + ridge * mean(diag A) ||Delta||^2`` (``ridge = 0``:
    the minimum-norm least-squares step)."""
    lam = ridge * float(np.mean(np.diag(gram)))
    if lam > 0:
        return np.linalg.solve(gram + lam * np.eye(len(rhs)), rhs)
    return np.linalg.lstsq(gram, rhs, rcond=None)[0]


def qk_rope_refit(model, batches, stats: A3Statistics, a3: A3Config) -> QKRefit:
    """RoPE-aware least-squares refit of the pairs A3-QK keeps (the middle factor of CUR).

    After `rope_pair_selection` keeps ``S`` per KV head, every query head's kept columns
    ``W_Q' [D+1, r]`` (the bias as the last row, refit only if the model has q biases) are refit
    so that the score ``s'_ij = sum_{p in S} q'_p(i)^T R_p(t_j - t_i) k_p(j)`` best matches the
    full model's ``s_ij`` over the causal pairs ``j <= i`` of each calibration sequence (all
    pairs equally, or weighted by attention: ``qk_refit_weight``). For fixed keys the score is
    linear in ``W_Q'``: a linear least-squares problem in ``m r`` unknowns per head (``m = D+1``,
    or ``qk_refit_rank`` leading input directions), whose normal equations
    `jaxlm.compress.calibrate.qk_refit_sums` streams (features ``x_i (x) R(-t_i) k_S(j)``).
    ``qk_refit_als`` rounds then refit the keys for the refit queries and the queries again.
    The ridge pulls towards the current columns. ``batches`` is iterated ``1 + 2 qk_refit_als``
    times; the statistics' ``attn_in`` gives the basis for ``qk_refit_rank``."""
    from jaxlm.models.params import flat_params

    config = model.config
    _check_inputs(config, stats, a3)
    if "qk" not in a3.components:
        raise ValueError(f"qk_rope_refit: A3Config.components={a3.components!r} does not compress 'qk'")
    if config.rope == "none":
        raise ValueError("qk_rope_refit: the model has no RoPE (rope='none'): A3-QK's closed form is already optimal")
    if a3.qk_refit_rank is not None and stats.attn_in is None:
        raise ValueError("A3Config.qk_refit_rank needs A3Statistics.attn_in: collect the statistics with 'qk'")
    batches = list(batches)
    params = flat_params(model)
    N, K = config.n_heads, config.n_kv_heads
    G = N // K
    layer_widths, _ = _plan(params, config, stats, a3)
    m = min(config.d_model + 1, a3.qk_refit_rank or config.d_model + 1)
    blocks = (N if a3.qk_refit_weight == "attention" else K)
    entries = sum(blocks * (m * w) ** 2 for w in layer_widths["qk_head_dim"])
    if entries > _REFIT_MAX_ENTRIES:
        raise ValueError(f"A3Config.qk_rope_refit: the normal matrices would hold {entries:.3g} entries "
                         f"(({m} inputs x r)^2 per block, {blocks} blocks per layer), over {_REFIT_MAX_ENTRIES:.3g}: "
                         "set qk_refit_rank (the refit's input directions) lower, or qk_rope_refit=False")
    weights, fixed, errors = {}, {}, {}
    for layer, (_, cols, freq) in rope_pair_selection(params, config, stats, a3).items():
        p = f"layers.{layer}.attn."
        wq = np.take_along_axis(_augmented(params, p + "q_proj", N), np.repeat(cols, G, axis=0)[:, None, :], axis=-1)
        wk = np.take_along_axis(_augmented(params, p + "k_proj", K), cols[:, None, :], axis=-1)
        c = None if stats.attn_in is None else np.asarray(stats.attn_in[layer], np.float64)
        c = np.eye(config.d_model + 1) if c is None else c
        bases = {name: refit_basis(c, p + name + ".bias" in params, a3.qk_refit_rank) for name in ("q_proj", "k_proj")}
        weights[layer], fixed[layer], errors[layer] = (wq, wk), (freq, bases), []

    def step(side):
        name = "q_proj" if side == "q" else "k_proj"
        sums = qk_refit_sums(model, batches, {layer: (*weights[layer], fixed[layer][0], fixed[layer][1][name])
                                              for layer in weights}, side=side, weight=a3.qk_refit_weight)
        for layer, st in sums.items():
            wq, wk = weights[layer]
            basis = fixed[layer][1][name]
            total = float(st.target.sum())
            if not errors[layer]:
                errors[layer].append(float(st.residual.sum()) / total)
            err = float(st.residual.sum())
            if side == "q":
                new = wq.copy()
                for n in range(N):
                    gram = st.gram[n // G] if st.gram.shape[0] == K else st.gram[n]
                    delta = _refit_step(gram, st.rhs[n], a3.qk_refit_ridge)
                    err += float(delta @ gram @ delta - 2 * delta @ st.rhs[n])
                    new[n] += basis @ delta.reshape(basis.shape[1], -1)
                weights[layer] = (new, wk)
            else:
                new = wk.copy()
                for k in range(K):
                    delta = _refit_step(st.gram[k], st.rhs[k], a3.qk_refit_ridge)
                    err += float(delta @ st.gram[k] @ delta - 2 * delta @ st.rhs[k])
                    new[k] += basis @ delta.reshape(basis.shape[1], -1)
                weights[layer] = (wq, new)
            errors[layer].append(max(err, 0.0) / total)

    step("q")
    for _ in range(a3.qk_refit_als):
        step("k")
        step("q")
    return QKRefit(weights=weights, errors=errors)


def a3_compress(params: Mapping[str, object], config, stats: A3Statistics, a3: A3Config = A3Config(), *,
                qk_refit: QKRefit | None = None):
    """``(flat params, ModelConfig, statistics) -> (flat params, compressed ModelConfig)``.

    ``params``: the flat view (`jaxlm.models.params.flat_params`); ``stats`` from
    `jaxlm.compress.a3_statistics` on the same model with (at least) ``a3.components``.
    ``qk_refit``: `qk_rope_refit`'s result, needed (only) with ``a3.qk_rope_refit`` under RoPE.
    Untouched parameters are passed through; `jaxlm.models.params.model_from_flat` builds the
    compressed model.
    """
    _check_inputs(config, stats, a3)
    if needs_qk_refit(config, a3) and qk_refit is None:
        raise ValueError("A3Config.qk_rope_refit=True needs a second calibration pass: pass "
                         "qk_refit=qk_rope_refit(model, batches, stats, a3) (compress_model does this)")
    L = config.n_layers
    layer_widths, new_config = _plan(params, config, stats, a3)
    out = dict(params)
    for layer in range(L):
        if "qk" in a3.components:
            refit = qk_refit.weights.get(layer) if needs_qk_refit(config, a3) else None
            _compress_qk(params, out, config, stats, a3, layer, layer_widths["qk_head_dim"][layer], refit)
        if "ov" in a3.components:
            _compress_ov(params, out, config, stats, a3, layer, layer_widths["v_head_dim"][layer])
        if "mlp" in a3.components:
            _compress_mlp(params, out, config, stats, a3, layer, layer_widths["ffn_dim"][layer])
        name = f"layers.{layer}.attn.rope_inv_freq"
        if not new_config.layer_config(layer).rope_pairs_selected:
            out.pop(name, None)
    return out, new_config
