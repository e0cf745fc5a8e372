"""One logger for a run: a live progress bar (tqdm), ``metrics.jsonl``, TensorBoard event
files (tensorboardX) and, at the end, ``curves.png`` (matplotlib).

On resume it drops the records of steps after the checkpoint it restarted from, so the
files describe exactly one run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, out_dir: str | Path, *, total_steps: int, start_step: int = 0, progress: bool = True):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        if self.jsonl.exists():
            kept = [line for line in self.jsonl.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
            self.jsonl.write_text("".join(k + "\n" for k in kept))
        self._file = self.jsonl.open("a")
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self._last_time = time.perf_counter()
        self._tokens_since = 0.0

    def count_tokens(self, n: float) -> None:
        self._tokens_since += n

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train") -> dict[str, Any]:
        record = {"step": int(step), "kind": kind}
        for k, v in metrics.items():
            v = float(v) if hasattr(v, "__float__") and not isinstance(v, str) else v
            record[k] = v
        if kind == "train":
            now = time.perf_counter()
            record["tokens_per_s"] = self._tokens_since / max(now - self._last_time, 1e-9)
            self._last_time, self._tokens_since = now, 0.0
        record["time"] = time.time()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for k, v in record.items():
            if k not in ("step", "kind", "time") and isinstance(v, float) and math.isfinite(v):
                self._tb.add_scalar(f"{kind}/{k}", v, step)
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
        else:
            print(text)

    def close(self) -> Path | None:
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

    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    if not records:
        return None
    panels = [("train", "loss"), ("eval", "loss"), ("eval", "accuracy"), ("eval", "exact_match"),
              ("eval", "attn_entropy"), ("train", "lr"), ("train", "grad_norm")]
    panels = [(kind, key) for kind, key in panels
              if any(r["kind"] == kind and key in r for r in records)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (kind, key) in zip(axes[0], panels):
        pts = [(r["step"], r[key]) for r in records if r["kind"] == kind and key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if kind == "eval" else None, lw=1.2)
        ax.set_title(f"{kind} {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
