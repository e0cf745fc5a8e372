"""The base model for the MeGan experiment: digits in, the same digits out (no condition).

    jaxlm train megan_base trainer.out_dir=runs/megan/base
"""

from jaxlm.data.conditioned import ConditionedDigits
from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64),
        data=DataConfig(source=ConditionedDigits(conditions=("copy",), held_out=(), condition_in="none"),
                        seq_len=32, batch_size=32, pack=False, eval_examples=128),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=20),
        trainer=TrainerConfig(steps=200, out_dir="runs/megan/base", log_every=20, eval_generate=0, save_every=200),
    )
