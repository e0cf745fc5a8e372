"""The editing comparison in one call: the same requests, the same capability corpus and
the same metrics for CrispEdit, plain fine-tuning, AlphaEdit and MEMIT.

``jaxlm edit MODEL --method all --requests FILE`` and ``bench/editing.py`` run it;
`EditEvaluator` (``jaxlm.editing.metrics``) defines the metrics.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np

from jaxlm.editing.crispedit import GradientEditConfig, sequential_edit
from jaxlm.editing.kfac import kfac_factors, token_batches
from jaxlm.editing.locate import LocateEditConfig, locate_edit
from jaxlm.editing.metrics import EditEvaluator

METHODS = ("crispedit", "finetune", "alphaedit", "memit")


def corpus_texts(task, n: int, split: str = "train") -> list[str]:
    """``n`` prompt+completion texts of a task: the corpus whose curvature an edit protects
    (CrispEdit uses Wikipedia for a pretrained LM; here, the model's own training mixture)."""
    return [e["prompt"] + e["completion"] for e in (task.example(i, split) for i in range(n))]


@dataclasses.dataclass
class EditRun:
    method: str
    metrics: dict[str, float]
    seconds: float
    model: Any
    per_batch: list[dict[str, float]]
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_method(
    model,
    requests: Sequence[dict[str, Any]],
    method: str,
    *,
    tokenizer,
    corpus: Sequence[str],
    evaluator: EditEvaluator,
    batches: int = 1,
    gradient: GradientEditConfig = GradientEditConfig(),
    locate: LocateEditConfig = LocateEditConfig(),
    corpus_batch: int = 64,
    seq_len: int = 64,
) -> EditRun:
    """Apply ``requests`` in ``batches`` sequential chunks with ``method``; metrics after
    the last chunk are over all requests, ``per_batch`` after each chunk."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS}")
    if not 1 <= batches <= len(requests):
        raise ValueError(f"batches={batches!r} is invalid: must be in [1, {len(requests)}]")
    chunks = [list(c) for c in np.array_split(np.asarray(requests, dtype=object), batches)]
    corpus_batches = lambda: token_batches(tokenizer, corpus, batch_size=corpus_batch, seq_len=seq_len)  # noqa: E731
    per_batch: list[dict[str, float]] = []
    t0 = time.perf_counter()
    if method in ("crispedit", "finetune"):
        result = sequential_edit(
            model, chunks, gradient, tokenizer=tokenizer,
            capability_batches=corpus_batches if method == "crispedit" else None, method=method,
            on_batch=lambda k, m: per_batch.append(evaluator(m)) if batches > 1 else None,
        )
        edited, info = result.model, dict(result.info)
    else:
        info = {}
        capability = kfac_factors(model, corpus_batches(), module=locate.module, layers=locate.layers)
        edited, keys_cov = model, None
        for chunk in chunks:
            result = locate_edit(edited, chunk, capability, locate, tokenizer=tokenizer, method=method,
                                 previous_keys=keys_cov)
            edited, keys_cov = result.model, result.info["keys_cov"]
            if batches > 1:
                per_batch.append(evaluator(edited))
    seconds = time.perf_counter() - t0
    return EditRun(method=method, metrics=evaluator(edited), seconds=seconds, model=edited, per_batch=per_batch,
                   info=info)


COLUMNS = ("efficacy_exact", "generalization_exact", "locality", "capability_retention", "ES", "PS", "NS")


def markdown_table(runs: Sequence[EditRun], unedited: dict[str, float] | None = None) -> str:
    head = "| method | " + " | ".join(COLUMNS) + " | time (s) |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    if unedited is not None:
        lines.append("| unedited | " + " | ".join(f"{unedited.get(c, float('nan')):.3f}" for c in COLUMNS) + " | - |")
    for r in runs:
        lines.append(
            f"| {r.method} | " + " | ".join(f"{r.metrics.get(c, float('nan')):.3f}" for c in COLUMNS)
            + f" | {r.seconds:.1f} |"
        )
    return "\n".join(lines)
