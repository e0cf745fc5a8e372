"""A tiny omni model (video + audio + text) trained from scratch on the synthetic audio-visual
task: a textured square moving on a 4 x 4 patch grid and a tone whose pitch encodes a label;
questions ask for the square's texture (``look:``) or the tone's label (``tone:``).

The language model uses three-axis positions (``rope="mrope"``); placeholders for video
patches and audio frames are ids 259 and 260, past the byte tokenizer's. The encoders and the
language model train together; ``out_dir/model`` is an omni checkpoint (`jaxlm.load_omni`).

    jaxlm train omni_av                 # ~70 s on 2 CPU cores, 100% held-out accuracy
    jaxlm train omni_av algorithm.task.questions=move:,look:,tone:   # motion too (harder: 32% at 800 steps)
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OmniTrainConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=261, rope="mrope", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=192, max_seq_len=128),
        data=DataConfig(batch_size=32),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.0),
        trainer=TrainerConfig(steps=800, out_dir="runs/omni_av", log_every=50, eval_every=400, eval_generate=8,
                              save_every=200),
        algorithm=OmniTrainConfig(encoder_hidden=64),
        tokenizer="byte",
    )
