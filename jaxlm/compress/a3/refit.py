"""A3-QK under RoPE (Wong et al., arXiv 2505.12942): the pairs the selection keeps, and their
least-squares refit on the full model's scores (the middle factor of CUR, as for the MLP)."""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from jaxlm.compress.a3.allocation import _plan
from jaxlm.compress.a3.config import A3Config, _check_inputs
from jaxlm.compress.a3.qk import current_rope_frequencies, qk_pair_scores, select_rope_pairs
from jaxlm.compress.a3.weights import _augmented
from jaxlm.compress.calibrate import A3Statistics, qk_refit_sums
from jaxlm.models.params import flat_params


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
