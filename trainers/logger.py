"""One logger for a run: a live progress bar (tqdm), ``metrics.jsonl``, TensorBoard event
files (tensorboardX) and, at the end, ``curves.png`` (matplotlib).

On resume it drops the records of steps after the checkpoint it restarted from, so the
files describe exactly one run; a torn last line of ``metrics.jsonl`` (a kill mid-write)
is dropped with a warning. A record for a (step, kind) that the file already holds is
not written again, so re-running a finished run adds no duplicate points. Every record
is flushed to ``metrics.jsonl`` and to the TensorBoard event file as it is logged, so a
SIGKILL loses nothing that was logged.

In a multi-process run only process 0 (``process_index=0``) writes files or shows a bar;
the others keep the records in memory only (`MetricsLogger.logged` answers for what they
were given).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

from jaxlm.fileio import JSONFileError, atomic_write_text, read_jsonl


def _read_records(jsonl: Path) -> tuple[list[dict[str, Any]], bytes]:
    """metrics.jsonl's records (a torn last line dropped with a warning) and its bytes."""
    contents = read_jsonl(jsonl, what="metrics file")
    for i, r in enumerate(contents.records):
        if not isinstance(r, dict) or not isinstance(r.get("step"), int) or not isinstance(r.get("kind"), str):
            raise JSONFileError(
                f"metrics file {jsonl}: record {i + 1} is not an object with an integer 'step' and a "
                f"string 'kind': {str(r)[:120]}", path=jsonl,
            )
    return contents.records, jsonl.read_bytes() if jsonl.exists() else b""


class _EventFile:
    """A TensorBoard event file written synchronously: each write is flushed (and
    fsynced) before it returns. ``purge_step`` hides older files' events from that step on,
    as `tensorboardX.SummaryWriter(purge_step=...)` does."""

    def __init__(self, logdir: Path, *, purge_step: int | None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._Event, self._Summary = Event, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        # a unique suffix: two writers started in the same second must not share a file
        self._writer = EventsWriter(str(logdir / "events"), filename_suffix=f".{os.getpid()}.{secrets.token_hex(3)}")
        if purge_step is not None:
            self._writer.write_event(Event(step=purge_step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not values:
            return
        summary = self._Summary(value=[self._Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.write_event(self._Event(step=int(step), wall_time=time.time(), summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsLogger:
    """``process_index``: this process's index in a multi-process run; only process 0
    reads and writes ``metrics.jsonl``, TensorBoard and ``curves.png`` and shows the bar."""

    def __init__(self, out_dir: str | Path, *, total_steps: int, start_step: int = 0, progress: bool = True,
                 process_index: int = 0):
        self.out_dir = Path(out_dir)
        self.jsonl = self.out_dir / "metrics.jsonl"
        self.primary = process_index == 0
        self._logged: set[tuple[int, str]] = set()
        self._file = self._tb = self._bar = None
        self._last_time = time.perf_counter()
        self._tokens_since = 0.0
        if not self.primary:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        records, old_bytes = _read_records(self.jsonl)
        kept = [r for r in records if r["step"] <= start_step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        if self.jsonl.exists() and text.encode() != old_bytes:
            atomic_write_text(self.jsonl, text)
        self._logged = {(r["step"], r["kind"]) for r in kept}
        self._file = self.jsonl.open("a")
        self._tb = _EventFile(self.out_dir / "tensorboard", purge_step=start_step + 1)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def logged(self, step: int, kind: str = "train") -> bool:
        """Whether ``metrics.jsonl`` already holds a record for (step, kind) (e.g. the
        final eval of a finished run that is re-run); on processes other than 0, whether
        this logger was given one."""
        return (int(step), kind) in self._logged

    def count_tokens(self, n: float) -> None:
        self._tokens_since += n

    def start_clock(self) -> None:
        """Start the first throughput window now (setup before the first step is not training)."""
        self._last_time, self._tokens_since = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def untimed(self):
        """Time spent inside (an evaluation) is left out of the ``tokens_per_s`` window."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._last_time += time.perf_counter() - start

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train") -> dict[str, Any]:
        """Write one record to metrics.jsonl and TensorBoard (both flushed) and show it;
        a (step, kind) already logged is returned but not written again."""
        record = {"step": int(step), "kind": kind}
        for k, v in metrics.items():
            v = float(v) if hasattr(v, "__float__") and not isinstance(v, str) else v
            record[k] = v
        if kind == "train":
            now = time.perf_counter()
            record["tokens_per_s"] = self._tokens_since / max(now - self._last_time, 1e-9)
            self._last_time, self._tokens_since = now, 0.0
        record["time"] = time.time()
        if (record["step"], kind) in self._logged:
            return record
        self._logged.add((record["step"], kind))
        if not self.primary:
            return record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._tb.scalars(step, {f"{kind}/{k}": v for k, v in record.items()
                                if k not in ("step", "kind", "time") and isinstance(v, float) and math.isfinite(v)})
        if self._bar is not None and kind == "train":
            self._bar.set_postfix(loss=f"{record.get('loss', float('nan')):.4f}",
                                  tok_s=f"{record['tokens_per_s']:.0f}")
        elif self._bar is not None:
            self._bar.write(f"step {step} {kind}: " + ", ".join(
                f"{k}={v:.4g}" for k, v in record.items() if isinstance(v, float) and k != "time"))
        return record

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        elif self.primary:
            print(text)

    def close(self) -> Path | None:
        if not self.primary:
            return None
        if self._bar is not None:
            self._bar.close()
        self._tb.close()
        self._file.close()
        return plot_curves(self.jsonl, self.out_dir / "curves.png")


def plot_curves(jsonl: Path, png: Path) -> Path | None:
    """Training/eval curves from ``metrics.jsonl`` into a PNG (one panel per metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(jsonl, what="metrics file").records
    if not records:
        return None
    panels = [("train", "loss"), ("eval", "loss"), ("eval", "accuracy"), ("eval", "exact_match"),
              ("eval", "attn_entropy"), ("train", "lr"), ("train", "grad_norm")]
    panels = [(kind, key) for kind, key in panels
              if any(r["kind"] == kind and key in r for r in records)]
    width = 4.0 * len(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.2), squeeze=False)
    # fixed margins in inches (tight_layout measures every label: ~0.2 s a figure)
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.2 / width, bottom=0.5 / 3.2, top=1 - 0.35 / 3.2, wspace=0.3)
    for ax, (kind, key) in zip(axes[0], panels):
        pts = [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if kind == "eval" else None, lw=1.2)
        ax.set_title(f"{kind} {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
