"""Model-level entry points: calibrate, compress and rebuild in one call (`compress_with`),
and load, compress, measure and save (`compress_checkpoint`, what ``jaxlm compress`` runs)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from jaxlm.checkpoint import transform_checkpoint
from jaxlm.compress.a3.compress import a3_compress
from jaxlm.compress.a3.config import A3Config, check_compressible, needs_qk_refit
from jaxlm.compress.a3.refit import qk_rope_refit
from jaxlm.compress.calibrate import a3_statistics
from jaxlm.compress.metrics import kv_cache_bytes
from jaxlm.compress.svd import svd_baseline
from jaxlm.data.tasks import Arithmetic
from jaxlm.eval.accuracy import task_texts
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.quant.apply import calibration_batches

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
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    if not calibration_texts:
        raise ValueError("compress_with: A^3 needs calibration texts")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the model has no tokenizer to encode the calibration texts")
    batches = calibration_batches(model.tokenizer, calibration_texts, batch_size=batch_size, seq_len=seq_len)
    return compress_model(model, batches, a3)


@dataclasses.dataclass
class CompressReport:
    """What `compress_checkpoint` did: sizes, KV cache ratio, held-out accuracy before and
    after, and where the compressed model went."""

    method: str
    a3: A3Config
    before_config: Any
    after_config: Any
    kv_cache_ratio: float
    before: float | None  # None: not measured (eval_n=0)
    after: float | None
    out: Path
    n: int

    def summary(self) -> str:
        c0, c1 = self.before_config, self.after_config
        w = lambda c, n: getattr(c, f"layer_{n}s") or getattr(c, n)  # noqa: E731 (per-layer widths when mixed)
        lines = [f"{self.method} ({','.join(self.a3.components)}, budget {self.a3.budget}, {self.a3.allocation}): "
                 f"qk_head_dim {c0.qk_head_dim}->{w(c1, 'qk_head_dim')}, v_head_dim {c0.v_head_dim}->"
                 f"{w(c1, 'v_head_dim')}, ffn_dim {c0.ffn_dim}->{w(c1, 'ffn_dim')}; parameters "
                 f"{c0.num_params():,} -> {c1.num_params():,}; KV cache x{self.kv_cache_ratio:.3f}"]
        acc = ("" if self.before is None else
               f"held-out accuracy {self.before:.1%} -> {self.after:.1%} ({self.n} problems) ")
        return "\n".join(lines + [f"{acc}-> {self.out}"])


def compress_checkpoint(
    model,
    out: str | os.PathLike,
    *,
    method: str = "a3",
    a3: A3Config = A3Config(),
    task=None,
    calibration_n: int = 256,
    eval_n: int = 200,
    overwrite: bool = False,
    overwrite_hint: str = "pass overwrite=True to replace it",
    progress: bool = False,
) -> CompressReport:
    """Load (a checkpoint or HF directory, or take a model), compress with `compress_with` on
    ``calibration_n`` texts of ``task``'s train split (default: `Arithmetic`), measure held-out
    accuracy before and after on ``eval_n`` examples (0: skip), and save to ``out``: what
    ``jaxlm compress`` runs. ``out`` is locked while it is written and replaced atomically,
    so it may be the input directory itself."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    if isinstance(calibration_n, bool) or not isinstance(calibration_n, int) or calibration_n < 1:
        raise ValueError(f"calibration_n={calibration_n!r} is invalid: must be an int >= 1 (A^3's closed forms "
                         "need calibration texts)")
    task = Arithmetic() if task is None else task
    run = transform_checkpoint(
        model, out, lambda m: compress_with(m, method, task_texts(task, calibration_n), a3), task=task, eval_n=eval_n,
        overwrite=overwrite, overwrite_hint=overwrite_hint, desc=f"compress {method}",
        what="compressed model being written", progress=progress,
    )
    kv = kv_cache_bytes(run.result.config, 1, 1) / kv_cache_bytes(run.source.config, 1, 1)
    return CompressReport(method=method, a3=a3, before_config=run.source.config, after_config=run.result.config,
                          kv_cache_ratio=kv, before=run.before, after=run.after, out=run.out, n=eval_n)
