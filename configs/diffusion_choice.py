"""A masked diffusion LM (LLaDA-style) trained by SFT to copy any one of three listed words.

Every listed word is a right answer, so the answer distribution is multimodal: decoding many
positions from one forward can mix letters of different words, and the number of denoising
steps matters (unlike sorting, which this model size decodes in one step). The base of the
SPEED and ME-DLM miniatures (`bench/speed_claim.py`, `bench/medlm_claim.py`).

    jaxlm train diffusion_choice          # ~5 min on 2 CPU cores
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Choice
from jaxlm.models.config import ModelConfig
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                               max_seq_len=64, mode="diffusion", mask_token_id=259),
        data=DataConfig(source=Choice(words=3, length=6, letters="abcdefgh"), seq_len=40, batch_size=64),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1500, out_dir="runs/diffusion_choice", log_every=50, eval_every=500, eval_generate=200,
            eval_max_new_tokens=8, save_every=500,
        ),
        algorithm=DiffusionConfig(objective="sft"),
        tokenizer="byte",
    )
