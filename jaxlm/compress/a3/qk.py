"""A3-QK (Wong et al., arXiv 2505.12942): query/key head width, minimising the pre-softmax
score error.

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
  calibration token pairs (`jaxlm.compress.a3.refit.qk_rope_refit`; optional alternating key
  refits), which absorbs much of what the dropped pairs carried.
* ``qk_norm`` (Qwen3) is refused: the RMSNorm over the head width couples all pairs.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxlm.compress.a3.config import QK_SCORES
from jaxlm.compress.a3.linalg import _gram_root
from jaxlm.compress.a3.weights import _augmented, _store_augmented
from jaxlm.compress.calibrate import A3Statistics
from jaxlm.models.layers.rope import inv_frequencies


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
    if rank >= wk.shape[1]:  # full width: the same scores, also where the calibration never reached (C singular)
        return wq.copy(), wk.copy(), s
    root_s = np.sqrt(s[:rank])
    wq_new = np.einsum("gdh,hr->gdr", wq, rq_inv @ u[:, :rank] * root_s)
    wk_new = wk @ (rk_inv @ vt[:rank].T * root_s)
    return wq_new, wk_new, s


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


def current_rope_frequencies(params: Mapping, config, layer: int) -> np.ndarray:
    """``[K, qk_head_dim/2]`` inverse frequencies layer ``layer`` rotates its pairs with."""
    name = f"layers.{layer}.attn.rope_inv_freq"
    if name in params:
        return np.asarray(params[name], np.float32)
    return np.tile(np.asarray(inv_frequencies(config), np.float32), (config.n_kv_heads, 1))


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
        # qk_rope_refit's least-squares columns for these pairs; with every pair kept the score
        # error is 0 and the refit is the identity, which its solve (ill-conditioned where the
        # calibration is rank-deficient) would only perturb
        if refit is not None and width < config.qk_head_dim:
            if refit[0].shape != wq_new.shape or refit[1].shape != wk_new.shape:
                raise ValueError(f"qk_refit for layer {layer} has shapes {refit[0].shape}, {refit[1].shape}, "
                                 f"not {wq_new.shape}, {wk_new.shape}: refit with the same A3Config and statistics")
            wq_new, wk_new = refit
        freq = np.take_along_axis(current_rope_frequencies(params, config, layer), keep, axis=-1)
        out[p + "rope_inv_freq"] = freq.astype(np.float32)
    _store_augmented(out, params, p + "q_proj", wq_new)
    _store_augmented(out, params, p + "k_proj", wk_new)
