"""CCC-GRPO, step 1: SFT a tiny byte-level model on the long-tailed regression task (card B.2).

    jaxlm train configs/ccc_sft.py      # -> runs/ccc_sft/model, the start of configs/ccc_grpo.py
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.regression import LongTailedRegression
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32),
        data=DataConfig(source=LongTailedRegression(imbalance=1000.0), seq_len=16, batch_size=32, pack=False),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=100, out_dir="runs/ccc_sft", log_every=50, eval_every=0, eval_generate=200,
            eval_max_new_tokens=4, save_every=100,
        ),
        algorithm=SFTConfig(),
        tokenizer="byte",
    )
