"""Post-training quantization of a model in one call: ``quantize_with(model, method, fmt,
calibration_texts)`` -> a new model (the quickstart's stage), and
``quantize_checkpoint(src, out, ...)``: load, quantize, measure, save (``jaxlm quantize``)."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Sequence

from jaxlm.checkpoint import transform_checkpoint
from jaxlm.data.tasks import Arithmetic
from jaxlm.editing.kfac import token_batches
from jaxlm.eval.accuracy import task_texts
from jaxlm.quant.formats import get_format
from jaxlm.quant.gptq import INNER
from jaxlm.quant.qat_export import export_for_quantize
from jaxlm.quant.quarot import quarot_quantize
from jaxlm.quant.twinquant import twinquant_quantize_model
from jaxlm.quant.w4a4 import transform_quantize_model

PTQ_METHODS = ("rtn", "hadamard", "wush", "quarot", "twinquant")


def calibration_batches(tokenizer, texts: Sequence[str], *, batch_size: int = 64, seq_len: int = 64):
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
    if method == "qat" or getattr(model.config, "qat_format", None) is not None:
        # a quantization-aware-trained model: its trained weights stored in the trained format
        return export_for_quantize(model, method, fmt, weights_only=weights_only, inner=inner)
    if method not in PTQ_METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {PTQ_METHODS}")
    fmt = get_format(fmt)
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
        return quarot_quantize(model, fmt, quantize_activations=not weights_only)
    batches = calibration_batches(model.tokenizer, calibration_texts, seq_len=seq_len) if calibration_texts else None
    if method == "twinquant":
        return twinquant_quantize_model(model, fmt, batches, rank=rank, quantize_activations=not weights_only)
    return transform_quantize_model(model, method, fmt, batches, quantize_activations=not weights_only, inner=inner)


@dataclasses.dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did: held-out accuracy before and after, and where the
    quantized model went."""

    method: str
    format: str
    inner: str
    mode: str  # "W4A4" or "W4A16"
    before: float | None  # None: not measured (eval_n=0)
    after: float | None
    out: Path
    n: int

    def summary(self) -> str:
        inner = f" (inner {self.inner})" if self.inner != "rtn" else ""
        acc = ("" if self.before is None else
               f": held-out accuracy {self.before:.1%} -> {self.after:.1%} ({self.n} problems)")
        return f"{self.method}{inner} {self.format} {self.mode}{acc} -> {self.out}"


def quantize_checkpoint(
    model,
    out: str | os.PathLike,
    *,
    method: str = "wush",
    fmt: str = "mxfp4",
    inner: str = "rtn",
    weights_only: bool = False,
    rank: int | float | None = None,
    task=None,
    calibration_n: int = 256,
    eval_n: int = 200,
    overwrite: bool = False,
    overwrite_hint: str = "pass overwrite=True to replace it",
    progress: bool = False,
) -> QuantizeReport:
    """Load (a checkpoint or HF directory, or take a model), quantize with `quantize_with`
    on ``calibration_n`` texts of ``task``'s train split (default: `Arithmetic`), measure
    held-out accuracy before and after on ``eval_n`` examples (0: skip), and save to
    ``out``: what ``jaxlm quantize`` runs. ``out`` is locked while it is written (a second
    writer is refused) and replaced atomically (`jaxlm.fileio.atomic_directory`), so
    ``out`` may be the input directory itself."""
    get_format(fmt)  # a bad format fails before anything is loaded
    if inner not in INNER:
        raise ValueError(f"inner={inner!r} is invalid: must be one of {INNER}")
    if inner != "rtn" and method not in ("rtn", "hadamard", "wush"):
        raise ValueError(f"inner={inner!r} applies to method rtn | hadamard | wush (got method={method!r})")
    if rank is not None and method != "twinquant":
        raise ValueError(f"rank applies to method twinquant only (got method={method!r})")
    if isinstance(calibration_n, bool) or not isinstance(calibration_n, int) or calibration_n < 0:
        raise ValueError(f"calibration_n={calibration_n!r} is invalid: must be an int >= 0")
    # before anything is loaded: these failed only once the transform had started
    if calibration_n == 0 and (method in ("wush", "twinquant") or inner == "gptq"):
        needs = f"inner={inner!r}" if inner == "gptq" else f"method={method!r}"
        raise ValueError(f"calibration_n=0 is invalid: {needs} needs calibration texts (inputs of each layer)")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, float)) or not 0 < rank < math.inf):
        raise ValueError(f"rank={rank!r} is invalid: an integer >= 1 or a fraction in (0, 1)")
    task = Arithmetic() if task is None else task
    run = transform_checkpoint(
        model, out,
        lambda m: quantize_with(m, method, fmt, task_texts(task, calibration_n), weights_only=weights_only, rank=rank,
                                inner=inner),
        task=task, eval_n=eval_n, overwrite=overwrite, overwrite_hint=overwrite_hint, desc=f"quantize {method} {fmt}",
        what="quantized model being written", progress=progress,
    )
    return QuantizeReport(method=method, format=str(fmt), inner=inner, mode="W4A16" if weights_only else "W4A4",
                          before=run.before, after=run.after, out=run.out, n=eval_n)
