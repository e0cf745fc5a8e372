"""The quickstart: SFT of a tiny byte-level model on 2-digit addition, on one CPU in minutes.

    jaxlm train quickstart trainer.steps=400
    jaxlm quickstart            # the same, then evaluation, samples and a summary
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64),
        data=DataConfig(source=Arithmetic(digits=2, ops=("+",)), seq_len=32, batch_size=64, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1000, out_dir="runs/quickstart", log_every=20, eval_every=250, eval_generate=200,
            eval_max_new_tokens=6, save_every=250,
        ),
        algorithm=SFTConfig(),
        tokenizer="byte",
    )
