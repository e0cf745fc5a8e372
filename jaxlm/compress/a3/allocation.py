"""A^3 budgets over layers (Wong et al., arXiv 2505.12942): per-layer error curves and mixed ranks.

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

from typing import Mapping

import numpy as np

from jaxlm.compress.a3.config import _WIDTHS, A3Config, a3_steps, a3_widths
from jaxlm.compress.a3.mlp import mlp_error_curve
from jaxlm.compress.a3.ov import ov_factors
from jaxlm.compress.a3.qk import qk_factors, qk_pair_scores
from jaxlm.compress.a3.weights import _augmented, _np
from jaxlm.compress.calibrate import A3Statistics


def _tail(values: np.ndarray) -> np.ndarray:
    """``[n]`` per-unit error shares, largest first -> ``err[r] = sum_{i >= r} values[i]``, r = 0..n."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0.0]])


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
        steps = a3_steps(config)  # RoPE pairs, kv_quant / qat_format blocks
        for name, c in curves.items():
            layer_widths[name] = allocate_widths(c, L * widths[name], steps[name][0])
        new_config = config.replace(scan_layers=False, **{
            _WIDTHS[name][1]: tuple(int(w) for w in layer_widths[name]) for name in curves})
    else:
        layer_widths = {name: [widths[name]] * L for name in widths}
        new_config = config.replace(**widths)
    return layer_widths, new_config
