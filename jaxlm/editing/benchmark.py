"""The editing comparison in one call: the same requests, the same capability corpus and
the same metrics for CrispEdit, plain fine-tuning, AlphaEdit and MEMIT.

`edit_checkpoint` loads, edits, measures and saves (``jaxlm edit MODEL --method all
--requests FILE``; ``bench/editing.py``); `EditEvaluator` (``jaxlm.editing.metrics``) defines
the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxlm.checkpoint import _check_source_exists, load_model, save_checkpoint
from jaxlm.data.facts import FactWorld, check_request, read_requests
from jaxlm.data.tasks import Arithmetic
from jaxlm.editing.crispedit import GradientEditConfig, sequential_edit
from jaxlm.editing.kfac import kfac_factors, token_batches
from jaxlm.editing.locate import LocateEditConfig, locate_edit
from jaxlm.editing.metrics import EditEvaluator
from jaxlm.fileio import DirectoryLock

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


def edit_checkpoint(
    model,
    requests: str | os.PathLike | Sequence[dict[str, Any]],
    *,
    method: str = "crispedit",
    batches: int = 1,
    corpus=None,
    corpus_size: int = 512,
    capability=None,
    capability_n: int = 200,
    gradient: GradientEditConfig = GradientEditConfig(),
    locate: LocateEditConfig = LocateEditConfig(),
    out: str | os.PathLike | None = None,
    overwrite: bool = False,
    overwrite_hint: str = "pass overwrite=True to replace it",
    progress: bool = False,
    length_normalized: bool = True,
) -> tuple[dict[str, Any], list[EditRun]]:
    """Load a model (a checkpoint or HF directory, or take one), apply ``requests`` (a jsonl
    file or a list) with ``method`` (one of `METHODS`, or ``"all"``) in ``batches`` sequential
    chunks, measure every method against the unedited model, and save the edited model to
    ``out`` (one method only; locked and written atomically): what ``jaxlm edit`` runs.
    ``corpus`` (default `FactWorld`): the texts whose curvature / key covariance the edit
    protects; ``capability`` (default `Arithmetic`): the task whose held-out exact match
    measures retention; ``length_normalized``: ES/PS/NS compare per-token NLL (CounterFact)
    or, when False, summed log-probabilities (`EditEvaluator`). Returns the report (``"unedited"`` and one entry per method) and the
    runs."""
    methods = METHODS if method == "all" else (method,)
    if method != "all" and method not in METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {METHODS} or 'all'")
    if out is not None and method == "all":
        raise ValueError("out saves one edited model: pick one method, not 'all'")
    for name, value in (("corpus_size", corpus_size), ("capability_n", capability_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} is invalid: must be a positive int")
    if isinstance(requests, (str, os.PathLike)):
        requests = read_requests(requests)
    else:
        requests = [check_request(r, f"requests[{i}]") for i, r in enumerate(requests)]
        if not requests:
            raise ValueError("requests is empty: give at least one edit request")
    corpus = FactWorld() if corpus is None else corpus
    capability = Arithmetic() if capability is None else capability
    _check_source_exists(model)  # before the lock, which creates the output's parent directories
    lock = DirectoryLock(out, beside=True, what="edited model being written") if out is not None else None
    with lock or contextlib.nullcontext():
        if out is not None and Path(out).exists() and not overwrite:
            raise FileExistsError(f"{out} exists; {overwrite_hint}")
        source = load_model(model) if isinstance(model, (str, os.PathLike)) else model
        if getattr(source, "tokenizer", None) is None:
            raise ValueError(f"{model} has no tokenizer; cannot encode edit requests")
        held = [capability.example(i, "eval") for i in range(capability_n)]
        evaluator = EditEvaluator(source, requests, source.tokenizer, held, length_normalized=length_normalized)
        texts = corpus_texts(corpus, corpus_size)
        runs = []
        with tqdm(total=len(methods) + 1, desc="edit", disable=not progress) as bar:
            bar.set_postfix_str("unedited")
            unedited = evaluator(source)
            bar.update()
            for m in methods:
                bar.set_postfix_str(m)
                runs.append(run_method(source, requests, m, tokenizer=source.tokenizer, corpus=texts,
                                       evaluator=evaluator, batches=batches, gradient=gradient, locate=locate))
                bar.update()
        if out is not None:
            save_checkpoint(runs[0].model, out, overwrite=overwrite)
    report = {"unedited": unedited, **{r.method: {**r.metrics, "seconds": r.seconds, "per_batch": r.per_batch,
                                                  **r.info} for r in runs}}
    return report, runs
