"""`jaxlm judge`: pairwise judgments of a jsonl of (question, a, b) rows, both orders in one
batched call, with SCOPE's acceptance threshold when a labelled calibration file is given.

Input rows: ``{"question": str, "a": str, "b": str}`` plus, for calibration, ``"label": "A"
| "B"`` (the better response). Output rows: the input keys plus ``p_ab``, ``p_ba``, ``p_a``
(the order-averaged P(A better)), ``verdict``, ``bpe`` and ``margin``; with a calibration
file, ``accepted`` (BPE at most SCOPE's threshold at ``alpha``), and the returned summary
(printed by the CLI) holds the threshold and the calibration coverage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxlm.data.files import DataError
from jaxlm.eval.conformal import scope_threshold, selective_report
from jaxlm.eval.judge import JudgeTemplate, judge_pairs
from jaxlm.fileio import atomic_write_text, jsonl_lines

FIELDS = ("question", "a", "b")


def read_pairs(path: str | Path, *, labelled: bool = False) -> list[dict[str, Any]]:
    """The rows of a jsonl of pairs, each checked for string ``question``/``a``/``b`` (and a
    ``label`` of "A" or "B" when ``labelled``); errors name the line."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: `jaxlm judge` reads .jsonl files (one {{\"question\", \"a\", \"b\"}} object per line)")
    rows = []
    for n, line in jsonl_lines(path):
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, very deep nesting
            raise DataError(f"{where}: cannot be read as JSON ({e})") from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with {list(FIELDS)}, got {type(row).__name__}")
        bad = [k for k in FIELDS if not isinstance(row.get(k), str)]
        if bad:
            raise DataError(f"{where}: {bad} must be strings (rows need {list(FIELDS)})")
        if labelled and row.get("label") not in ("A", "B"):
            raise DataError(f"{where}: a calibration row needs \"label\": \"A\" or \"B\", got {row.get('label')!r}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no pairs")
    return rows


def _judge(model, rows, template, both_orders, batch_size):
    return judge_pairs(model, [r["question"] for r in rows], [r["a"] for r in rows], [r["b"] for r in rows],
                       template=template, both_orders=both_orders, batch_size=batch_size)


def judge_file(model, pairs: str | Path, out: str | Path, *, calibration: str | Path | None = None,
               alpha: float = 0.1, template: JudgeTemplate = JudgeTemplate(), both_orders: bool = True,
               batch_size: int = 32, overwrite: bool = False) -> dict[str, Any]:
    """Judge ``pairs`` into ``out``; returns a summary (counts, and the threshold/coverage
    when ``calibration`` is given)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    if batch_size < 1:
        raise ValueError(f"--batch-size={batch_size} must be >= 1")
    rows = read_pairs(pairs)
    cal = None if calibration is None else read_pairs(calibration, labelled=True)
    # after the inputs are read (bad input leaves nothing behind), before the model's work
    out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"pairs": len(rows)}
    threshold = None
    if cal is not None:
        cj = _judge(model, cal, template, both_orders, batch_size)
        errors = (cj.decision != np.asarray([0 if r["label"] == "A" else 1 for r in cal])).astype(int)
        threshold = scope_threshold(cj.entropy, errors, alpha)
        report = selective_report(cj.entropy, errors, threshold)
        summary.update(alpha=alpha, threshold=threshold, calibration_pairs=len(cal),
                       calibration_coverage=report.coverage, calibration_error=report.error_rate)
    j = _judge(model, rows, template, both_orders, batch_size)
    lines = []
    for i, row in enumerate(rows):
        rec = dict(row)
        rec.update(p_ab=float(j.p_ab[i]), p_ba=float(j.p_ba[i]), p_a=float(j.p[i]),
                   verdict="AB"[int(j.decision[i])], bpe=float(j.entropy[i]), margin=float(j.margin[i]))
        if threshold is not None:
            rec["accepted"] = bool(j.entropy[i] <= threshold)
        lines.append(json.dumps(rec) + "\n")
    atomic_write_text(out, "".join(lines))
    if threshold is not None:
        summary["accepted"] = int(np.sum(j.entropy <= threshold))
    return summary
