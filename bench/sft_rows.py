"""Shared by the claim benches: train a byte-level model from scratch on prompt/completion
rows (packed SFT, train-only run) and load the result."""

from __future__ import annotations

import json
from pathlib import Path

import jaxlm
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train


def sft_on_rows(out: Path, rows: list[dict], model: jaxlm.ModelConfig, *, steps: int, seq_len: int,
                lr: float = 3e-3, warmup_steps: int = 50, batch_size: int = 32, init_from: str | None = None,
                trainable: str = ""):
    """Write ``rows`` to ``out/rows.jsonl``, train ``steps`` steps into ``out`` (from the
    weights at ``init_from``, else from scratch; ``trainable``: a regex over parameter names,
    empty = all), return the model."""
    data = Path(out) / "rows.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(ExperimentConfig(
        model=model,
        data=DataConfig(source=Files(path=str(data), eval_fraction=0.01), seq_len=seq_len, batch_size=batch_size,
                        pack=True, eval_examples=200),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=warmup_steps, min_lr_ratio=0.1, trainable=trainable),
        trainer=TrainerConfig.quiet(steps=steps, out_dir=str(out)),
        algorithm=SFTConfig(), tokenizer="byte", init_from=init_from,
    ))
    return jaxlm.load_checkpoint(Path(out) / "model")
