"""A^3 on a whole model (Wong et al., arXiv 2505.12942): flat parameters, config and
statistics in, the compressed flat parameters and config out."""

from __future__ import annotations

from typing import Mapping

from jaxlm.compress.a3.allocation import _plan
from jaxlm.compress.a3.config import A3Config, _check_inputs, needs_qk_refit
from jaxlm.compress.a3.mlp import _compress_mlp
from jaxlm.compress.a3.ov import _compress_ov
from jaxlm.compress.a3.qk import _compress_qk
from jaxlm.compress.a3.refit import QKRefit
from jaxlm.compress.calibrate import A3Statistics


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
