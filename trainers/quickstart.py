"""`jaxlm quickstart`: the main job on the embedded default (no downloads, CPU, minutes).

Trains a tiny byte-level model with SFT on held-out-split 2-digit addition
(`configs/quickstart.py`), evaluates exact-match accuracy on problems it never saw,
prints sampled answers and a summary table, and leaves a checkpoint, ``metrics.jsonl``
and ``curves.png`` in the output directory. Later stages (RL, quantization) append here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

from trainers.config import load_config
from trainers.loop import TrainResult, train


def run_quickstart(
    *, steps: int | None = None, out_dir: str | Path = "runs/quickstart", overrides: Sequence[str] = (),
    progress: bool = True, console=None,
) -> TrainResult:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    extra = [f"trainer.out_dir={out_dir}", f"trainer.progress={progress}"]
    if steps is not None:
        every = max(steps // 3, 1)
        extra += [f"trainer.steps={steps}", f"trainer.save_every={every}", f"trainer.eval_every={every}",
                  f"trainer.log_every={max(min(20, steps // 5), 1)}",
                  f"optimizer.warmup_steps={min(50, max(steps // 10, 1))}"]
    cfg = load_config("quickstart", [*extra, *overrides])
    task = cfg.data.source
    console.print(
        f"[bold]jaxlm quickstart[/bold]: SFT of a {cfg.model.num_params() / 1e6:.2f}M-parameter model "
        f"(byte tokenizer) on {task.digits}-digit {'/'.join(task.ops)} for {cfg.trainer.steps} steps "
        f"-> {cfg.trainer.out_dir}"
    )
    start = time.perf_counter()
    result = train(cfg)
    elapsed = time.perf_counter() - start

    samples = Table(title="Sampled answers (held-out problems, greedy)")
    for col in ("prompt", "model", "reference", ""):
        samples.add_column(col)
    for s in result.samples[:8]:
        samples.add_row(s["prompt"], s["completion"], s["reference"], "ok" if s["correct"] else "x")
    console.print(samples)

    chance = task.chance_accuracy()
    summary = Table(title="Summary")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    summary.add_row("steps", str(result.step))
    summary.add_row("wall time", f"{elapsed:.0f} s")
    summary.add_row("held-out loss (nats/token)", f"{result.final_eval.get('loss', float('nan')):.4f}")
    summary.add_row("held-out exact-match accuracy", f"{result.final_eval.get('accuracy', float('nan')):.1%}")
    summary.add_row("chance accuracy", f"{chance:.2%}")
    out = Path(cfg.trainer.out_dir)
    for name in ("model", "metrics.jsonl", "curves.png", "checkpoints"):
        summary.add_row(name, str(out / name))
    console.print(summary)
    return result
