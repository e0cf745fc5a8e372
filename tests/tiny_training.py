"""Train a tiny byte-level model inside a test fixture (claim miniatures, calibration fixtures):
packed SFT on ``source`` with no periodic evaluation or checkpointing, then the saved model."""

from pathlib import Path

from jaxlm.data.pipeline import DataConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train


def train_tiny(out, source, model, *, steps: int, lr: float = 3e-3, warmup_steps: int = 20,
               min_lr_ratio: float = 0.1, batch_size: int = 32, seq_len: int = 32,
               eval_examples: int = 200, init_from: str | Path | None = None, shuffle_seed: int = 0,
               sem_lambda: float = 0.0) -> Path:
    """Returns the directory of the trained jaxlm checkpoint (``out/model``). ``init_from``:
    start from a checkpoint's weights (e.g. QAT after SFT); ``shuffle_seed``: the data order;
    ``sem_lambda``: ReQAT's selective entropy minimisation term."""
    train(ExperimentConfig(
        model=model,
        data=DataConfig(source=source, seq_len=seq_len, batch_size=batch_size, pack=True, eval_examples=eval_examples,
                        shuffle_seed=shuffle_seed),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio),
        trainer=TrainerConfig(steps=steps, out_dir=str(out), progress=False, log_every=100, eval_every=0,
                              save_every=10_000, eval_generate=0),
        algorithm=SFTConfig(sem_lambda=sem_lambda), tokenizer="byte",
        init_from=None if init_from is None else str(init_from),
    ))
    return Path(out) / "model"
