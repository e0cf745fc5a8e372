"""The quickstart: SFT of a tiny byte-level model on 2-digit addition, on one CPU in minutes.

The demonstrations come from a flawed teacher (``carry_slip=0.6``: 60% of the problems with a
carry out of the ones digit are shown with it dropped), so SFT learns the slip and the GRPO
stage (`configs/grpo_arithmetic.py`, the exact-match verifier) has something to fix. Held-out
problems and the verifier are always correct; ``data.source.carry_slip=0`` trains on clean
demonstrations (~97% held-out after 1000 steps).

    jaxlm train quickstart trainer.steps=400
    jaxlm quickstart            # SFT, then GRPO, evaluation, quantization and a summary
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64),
        data=DataConfig(source=Arithmetic(digits=2, ops=("+",), carry_slip=0.6), seq_len=32, batch_size=64, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1000, out_dir="runs/quickstart", log_every=20, eval_every=250, eval_generate=200,
            eval_max_new_tokens=6, save_every=250,
        ),
        algorithm=SFTConfig(),
        tokenizer="byte",
    )
