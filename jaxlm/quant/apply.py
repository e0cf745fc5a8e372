"""One entry point for post-training quantization of a model: ``quantize_with(model,
method, fmt, calibration_texts)`` -> a new model (what ``jaxlm quantize`` and the
quickstart stage run)."""

from __future__ import annotations

from typing import Sequence

from jaxlm.quant.formats import get_format

PTQ_METHODS = ("rtn", "hadamard", "wush", "quarot", "twinquant")


def calibration_batches(tokenizer, texts: Sequence[str], *, batch_size: int = 64, seq_len: int = 64):
    from jaxlm.editing.kfac import token_batches

    return list(token_batches(tokenizer, texts, batch_size=batch_size, seq_len=seq_len))


def quantize_with(model, method: str, fmt: str, calibration_texts: Sequence[str] = (), *,
                  weights_only: bool = False, seq_len: int = 64, rank: int | float | None = None,
                  inner: str = "rtn"):
    """``method`` in `PTQ_METHODS` (W4A4, or W4A16 with ``weights_only``) in format ``fmt``.
    ``"quarot"``: `jaxlm.quant.quarot.quarot_quantize` (norms fused, residual stream and V/O
    heads rotated, then RTN; needs no calibration). ``"twinquant"``:
    `jaxlm.quant.twinquant.twinquant_quantize_model` (low-rank high-precision part + 4-bit
    residual, learned on calibration inputs; ``rank`` an int or a fraction, default 16).
    ``inner``: rounding of the transformed weights of ``rtn`` / ``hadamard`` / ``wush``,
    ``"rtn"`` or ``"gptq"`` (WUSH's GPTQ mode, `jaxlm.quant.gptq`; needs calibration).
    ``"qat"`` (required for, and only for, a model with ``config.qat_format``):
    `jaxlm.quant.qat_export.export_qat`, its trained weights stored in that format (``fmt``
    None or the same format)."""
    from jaxlm.quant.w4a4 import transform_quantize_model

    if method == "qat" or getattr(model.config, "qat_format", None) is not None:
        # a quantization-aware-trained model: its trained weights stored in the trained format
        from jaxlm.quant.qat_export import export_for_quantize

        return export_for_quantize(model, method, fmt, weights_only=weights_only, inner=inner)
    if method not in PTQ_METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {PTQ_METHODS}")
    fmt = get_format(fmt)
    from jaxlm.quant.gptq import INNER

    if inner not in INNER:
        raise ValueError(f"inner={inner!r} is invalid: must be one of {INNER}")
    if inner != "rtn" and method in ("quarot", "twinquant"):
        raise ValueError(f"inner={inner!r} applies to the rtn / hadamard / wush methods, not {method!r}")
    if method in ("wush", "twinquant") and not calibration_texts:
        raise ValueError(f"{method} needs calibration texts (inputs of each layer)")
    if inner == "gptq" and not calibration_texts:
        raise ValueError("inner='gptq' needs calibration texts (second moments of each layer's inputs)")
    if getattr(model, "tokenizer", None) is None and calibration_texts:
        raise ValueError("the model has no tokenizer to encode the calibration texts")
    if method == "quarot":
        from jaxlm.quant.quarot import quarot_quantize

        return quarot_quantize(model, fmt, quantize_activations=not weights_only)
    batches = calibration_batches(model.tokenizer, calibration_texts, seq_len=seq_len) if calibration_texts else None
    if method == "twinquant":
        from jaxlm.quant.twinquant import twinquant_quantize_model

        return twinquant_quantize_model(model, fmt, batches, rank=rank, quantize_activations=not weights_only)
    return transform_quantize_model(model, method, fmt, batches, quantize_activations=not weights_only, inner=inner)
