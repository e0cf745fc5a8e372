"""Model-level entry points: calibrate, compress and rebuild in one call (what ``jaxlm
compress`` runs)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from jaxlm.compress.a3 import A3Config, needs_qk_refit, a3_compress, check_compressible, qk_rope_refit
from jaxlm.compress.calibrate import a3_statistics
from jaxlm.compress.svd import svd_baseline
from jaxlm.models.params import flat_params, model_from_flat

METHODS = ("a3",)


def _rebuild(model, flat, config):
    new = model_from_flat(config, flat)
    new.tokenizer = getattr(model, "tokenizer", None)
    return new


def compress_model(model, batches: Iterable[tuple[np.ndarray, np.ndarray]], a3: A3Config = A3Config()):
    """A new, smaller model: A^3 statistics from ``batches`` (right-padded ``(tokens, valid)``),
    closed forms, and the model rebuilt with the compressed config (the input is unchanged).
    With ``a3.qk_rope_refit`` under RoPE, ``batches`` is iterated again for the refit
    (`qk_rope_refit`)."""
    check_compressible(model.config, a3.components)
    batches = list(batches)
    stats = a3_statistics(model, batches, a3.components, per_head_z=a3.ov_group == "average_refit")
    refit = qk_rope_refit(model, batches, stats, a3) if needs_qk_refit(model.config, a3) else None
    flat, config = a3_compress(flat_params(model), model.config, stats, a3, qk_refit=refit)
    return _rebuild(model, flat, config)


def svd_model(model, compressed_config, components: Sequence[str]):
    """The per-matrix truncated-SVD baseline at the parameter count of ``compressed_config``
    (dense weights, the original config)."""
    flat, _ = svd_baseline(flat_params(model), model.config, compressed_config, components)
    return _rebuild(model, flat, model.config)


def compress_with(model, method: str, calibration_texts: Sequence[str], a3: A3Config = A3Config(), *,
                  seq_len: int = 64, batch_size: int = 64):
    """``method`` in `METHODS` on the tokenized ``calibration_texts``."""
    from jaxlm.quant.apply import calibration_batches

    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    if not calibration_texts:
        raise ValueError("compress_with: A^3 needs calibration texts")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the model has no tokenizer to encode the calibration texts")
    batches = calibration_batches(model.tokenizer, calibration_texts, batch_size=batch_size, seq_len=seq_len)
    return compress_model(model, batches, a3)
