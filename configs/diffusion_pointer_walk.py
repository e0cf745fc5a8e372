"""A masked diffusion LM trained from scratch by SFT to follow a pointer table
(`jaxlm.data.tasks.PointerWalk`: ``walk 03 14 22 31 45 50 from 1:`` -> ``45031450``).

Each answer digit is one table lookup from the previous one, so one token per step decodes
left to right, while committing many positions per forward must chain several lookups at once:
the task on which this project measures few-step diffusion decoding (SPEED's and ME-DLM's
miniatures, `bench/speed_claim.py`, `bench/medlm_claim.py`).

    jaxlm train diffusion_pointer_walk     # ~20 min on 2 CPU cores

Measured (docs/benchmarks.md): 22% held-out exact match at one token per step after 4500
steps, too weak a base for those miniatures. With ``one_cycle=True`` (a cyclic table, whose
walks of ``symbols`` hops hold each digit once) the model learned the shortcut instead: the
missing digit is the one the other positions lack.
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import PointerWalk
from jaxlm.models.config import ModelConfig
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=260, d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=384,
                               max_seq_len=64, mode="diffusion", mask_token_id=259),
        data=DataConfig(source=PointerWalk(symbols=6, hops=8, one_cycle=False), seq_len=48, batch_size=64),
        optimizer=OptimizerConfig(lr=2e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=6000, out_dir="runs/diffusion_pointer_walk", log_every=50, eval_every=1500, eval_generate=200,
            eval_max_new_tokens=16, save_every=500,
        ),
        algorithm=DiffusionConfig(objective="sft"),
        tokenizer="byte",
    )
