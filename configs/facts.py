"""The editing benchmark's base model: a tiny byte-level model that memorises a synthetic
fact world (100 subjects x city/job, 3 templates each) and learns 2-digit addition (the
capability an edit must keep).

    jaxlm train facts                      # -> runs/facts/model
    jaxlm edit runs/facts/model --method crispedit --requests runs/facts/requests.jsonl
"""

from jaxlm.data.facts import FactWorld
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64),
        data=DataConfig(
            source=FactWorld(n_subjects=100, relations=("city", "job"), capability=Arithmetic(digits=2)),
            seq_len=48, batch_size=64, pack=True,
        ),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1500, out_dir="runs/facts", log_every=50, eval_every=500, eval_generate=200,
            eval_max_new_tokens=8, save_every=500,
        ),
        algorithm=SFTConfig(),
        tokenizer="byte",
    )
