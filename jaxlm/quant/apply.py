"""One entry point for post-training quantization of a model: ``quantize_with(model,
method, fmt, calibration_texts)`` -> a new model (what ``jaxlm quantize`` and the
quickstart stage run)."""

from __future__ import annotations

from typing import Sequence

from jaxlm.quant.formats import get_format

PTQ_METHODS = ("rtn", "hadamard", "wush", "quarot")


def calibration_batches(tokenizer, texts: Sequence[str], *, batch_size: int = 64, seq_len: int = 64):
    from jaxlm.editing.kfac import token_batches

    return list(token_batches(tokenizer, texts, batch_size=batch_size, seq_len=seq_len))


def quantize_with(model, method: str, fmt: str, calibration_texts: Sequence[str] = (), *,
                  weights_only: bool = False, seq_len: int = 64):
    """``method`` in `PTQ_METHODS` (W4A4, or W4A16 with ``weights_only``) in format ``fmt``.
    ``"quarot"``: `jaxlm.quant.quarot.quarot_quantize` (norms fused, residual stream and V/O
    heads rotated, then RTN; needs no calibration)."""
    from jaxlm.quant.w4a4 import transform_quantize_model

    if method not in PTQ_METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {PTQ_METHODS}")
    fmt = get_format(fmt)
    if method == "wush" and not calibration_texts:
        raise ValueError("wush needs calibration texts (second moments of each layer's inputs)")
    if getattr(model, "tokenizer", None) is None and calibration_texts:
        raise ValueError("the model has no tokenizer to encode the calibration texts")
    if method == "quarot":
        from jaxlm.quant.quarot import quarot_quantize

        return quarot_quantize(model, fmt, quantize_activations=not weights_only)
    batches = calibration_batches(model.tokenizer, calibration_texts, seq_len=seq_len) if calibration_texts else None
    return transform_quantize_model(model, method, fmt, batches, quantize_activations=not weights_only)
