"""Small-LM pretraining on a synthetic Markov corpus, to compare attention variants:

    jaxlm train attn_pretrain model.attention=softmax       trainer.out_dir=runs/attn/softmax
    jaxlm train attn_pretrain model.attention=affine_scaled trainer.out_dir=runs/attn/affine
    jaxlm train attn_pretrain model.attention=sink          trainer.out_dir=runs/attn/sink

Eval reports held-out loss, attention entropy and first-token attention mass.
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import MarkovText
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=128),
        data=DataConfig(source=MarkovText(), seq_len=96, batch_size=32, pack=True, eval_examples=128),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.01),
        trainer=TrainerConfig(steps=400, out_dir="runs/attn/softmax", log_every=5, eval_every=100,
                              eval_generate=0, eval_attention_stats=True, save_every=200),
    )
