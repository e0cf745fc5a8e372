"""`jaxlm quickstart`: the main job on the embedded default (no downloads, CPU, minutes).

1. SFT of a tiny byte-level model on held-out-split 2-digit addition (`configs/quickstart.py`)
   whose demonstrations come from a flawed teacher: 60% of the problems with a carry out of
   the ones digit are shown with that carry dropped (57+68= "115"). The model imitates it.
2. GRPO (`configs/grpo_arithmetic.py`) from the SFT model with the exact-match verifier as the
   reward: it visibly raises held-out accuracy, fixing what imitation learned.
3. Quantization: the final model's projections in NVFP4 W4A4 with plain RTN and with WUSH
   transforms (`jaxlm.quant`), held-out accuracy before and after; the WUSH model is saved
   to ``model_w4a4``.

It prints sampled answers and a summary table and leaves checkpoints, ``metrics.jsonl`` and
``curves.png`` in the output directory (the GRPO stage's own in ``grpo/``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

import jaxlm
from jaxlm.eval import task_accuracy
from jaxlm.quant.apply import quantize_with
from trainers.config import ConfigError, ExperimentConfig
from trainers.loop import TrainResult, train
from trainers.recipes import apply_overrides, load_config


def run_quickstart(
    *, steps: int | None = None, out_dir: str | Path = "runs/quickstart", overrides: Sequence[str] = (),
    progress: bool = True, console=None, quantize: bool = True, rl_steps: int | None = None,
    rl_overrides: Sequence[str] = (),
) -> TrainResult:
    """The three stages; ``rl_steps=0`` skips GRPO (None: the config's iterations). Returns
    the last training stage's result."""
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
    if rl_steps == 0 and rl_overrides:
        raise ConfigError(f"rl_overrides={list(rl_overrides)} with rl_steps=0: the GRPO stage is skipped")
    # the GRPO stage's config is checked before SFT runs, with the SFT model's shape
    rl_cfg = _grpo_config(cfg, rl_steps, rl_overrides, progress) if rl_steps != 0 else None
    task = cfg.data.source
    console.print(
        f"[bold]jaxlm quickstart[/bold]: SFT of a {cfg.model.num_params() / 1e6:.2f}M-parameter model "
        f"(byte tokenizer) on {task.digits}-digit {'/'.join(task.ops)} for {cfg.trainer.steps} steps "
        f"-> {cfg.trainer.out_dir}"
        + (f"\n  the demonstrations drop the ones carry in {task.carry_slip:.0%} of the problems that have "
           "one (a flawed teacher); held-out answers and the verifier are correct"
           if getattr(task, "carry_slip", 0) else "")
    )
    start = time.perf_counter()
    result = train(cfg)
    elapsed = time.perf_counter() - start

    console.print(_samples_table(result.samples))

    chance = task.chance_accuracy()
    summary = Table(title="Summary")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    summary.add_row("SFT steps", str(result.step))
    summary.add_row("SFT wall time", f"{elapsed:.0f} s")
    summary.add_row("held-out loss (nats/token)", f"{result.final_eval.get('loss', float('nan')):.4f}")
    summary.add_row("held-out exact-match accuracy, SFT", f"{result.final_eval.get('accuracy', float('nan')):.1%}")
    summary.add_row("chance accuracy", f"{chance:.2%}")
    out = Path(cfg.trainer.out_dir)
    final_model = out / "model"
    names = ["model", "metrics.jsonl", "curves.png", "checkpoints"]
    if rl_steps != 0:
        sft_samples = result.samples
        result = _grpo_stage(rl_cfg, console, summary)
        console.print(_samples_table(sft_samples, result.samples))
        final_model = out / "grpo" / "model"
        names += ["grpo/model", "grpo/curves.png"]
    if quantize:
        for method, acc in _quantization_stage(cfg, final_model, out, console).items():
            summary.add_row(f"held-out accuracy, NVFP4 W4A4 {method}", f"{acc:.1%}")
        names.append("model_w4a4")
    for name in names:
        summary.add_row(name, str(out / name))
    console.print(summary)
    return result


def _samples_table(sft: list[dict], grpo: list[dict] | None = None, n: int = 8):
    """The first ``n`` held-out problems' greedy answers after SFT (and after GRPO, matched by
    prompt), with the reference and whether each is correct."""
    from rich.table import Table

    mark = lambda s: "ok" if s["correct"] else "x"  # noqa: E731
    table = Table(title="Sampled answers (held-out problems, greedy)" + (" before and after GRPO" if grpo else ""))
    for col in ("prompt", "reference", "SFT", "") + (("GRPO", "") if grpo else ()):
        table.add_column(col)
    after = {s["prompt"]: s for s in grpo or ()}
    for s in sft[:n]:
        row = [s["prompt"], s["reference"], s["completion"], mark(s)]
        if grpo:
            g = after.get(s["prompt"])
            row += [g["completion"], mark(g)] if g else ["-", ""]
        table.add_row(*row)
    return table


def _grpo_config(sft: ExperimentConfig, rl_steps, rl_overrides, progress) -> ExperimentConfig:
    """`configs/grpo_arithmetic.py` from the SFT model (its shape: ``sft.model``) into ``out/grpo``."""
    out = Path(sft.trainer.out_dir)
    extra = [f"init_from={out / 'model'}", f"trainer.out_dir={out / 'grpo'}", f"trainer.progress={progress}"]
    if rl_steps is not None:
        every = max(rl_steps // 3, 1)
        extra += [f"trainer.steps={rl_steps}", f"trainer.eval_every={every}", f"trainer.save_every={every}",
                  f"trainer.log_every={max(min(5, rl_steps // 3), 1)}"]
    base = dataclasses.replace(load_config("grpo_arithmetic"), model=sft.model)
    return apply_overrides(base, [*extra, *rl_overrides])


def _grpo_stage(cfg: ExperimentConfig, console, summary) -> TrainResult:
    """GRPO from the SFT model into ``out/grpo``."""
    a = cfg.algorithm
    console.print(
        f"[bold]GRPO stage[/bold]: {cfg.trainer.steps} iterations of {cfg.data.batch_size} prompts x "
        f"{a.num_generations} samples, reward = the exact-match verifier -> {cfg.trainer.out_dir}"
    )
    start = time.perf_counter()
    result = train(cfg)
    summary.add_row("GRPO iterations", str(result.step))
    summary.add_row("GRPO wall time", f"{time.perf_counter() - start:.0f} s")
    summary.add_row("held-out exact-match accuracy, GRPO", f"{result.final_eval.get('accuracy', float('nan')):.1%}")
    return result


def _quantization_stage(cfg, model_dir: Path, out: Path, console) -> dict[str, float]:
    """Quantize the final model (NVFP4 W4A4: RTN and WUSH) and re-measure accuracy."""
    task = cfg.data.source
    model = jaxlm.load_checkpoint(model_dir)
    texts = [e["prompt"] + e["completion"] for e in (task.example(i, "train") for i in range(256))]
    held = [task.example(i, "eval") for i in range(cfg.trainer.eval_generate)]
    accs = {}
    for method in ("rtn", "wush"):
        if not held and method == "rtn":  # trainer.eval_generate=0: loss only, no accuracy to compare
            continue
        q = quantize_with(model, method, "nvfp4", texts)
        if held:
            accs[method] = task_accuracy(q, held, task.verify, tokenizer=model.tokenizer,
                                         max_new_tokens=cfg.trainer.eval_max_new_tokens).accuracy
        if method == "wush":
            jaxlm.save_checkpoint(q, out / "model_w4a4", overwrite=True)
    if held:
        console.print(f"quantization stage (NVFP4 W4A4, {len(held)} held-out problems): "
                      + ", ".join(f"{m} {a:.1%}" for m, a in accs.items()))
    else:
        console.print("quantization stage (NVFP4 W4A4 by WUSH): accuracy not measured (trainer.eval_generate=0)")
    return accs
