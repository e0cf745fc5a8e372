"""ME-DLM (edit-based refinement of a masked diffusion LM) on sorting eight digits.

The model has the next-token head and a delete token (ids: [MASK] 259, ``<|del|>`` 260, past
the byte tokenizer's 259). As in ME-DLM, it starts from a trained masked diffusion LM whose
next-token head is a copy of its LM head (`jaxlm.models.edit_head`):

    jaxlm train diffusion_sort model.n_layers=6 data.source.length=8 data.seq_len=48 \\
        trainer.steps=2000 trainer.out_dir=runs/diffusion_sort8 trainer.eval_max_new_tokens=16
    python -m jaxlm.models.edit_head runs/diffusion_sort8/model runs/medlm_base
    jaxlm train medlm_sort init_from=runs/medlm_base trainer.out_dir=runs/medlm_stage3

``algorithm.edit_intermediate_ratio=0`` is ME-DLM's stage 2 (masked answers only, both heads
trained); the default 0.5 is stage 3 (half the batches are the model's own filled and
self-edited outputs, labelled by the canonical edit alignment).
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from jaxlm.models.config import ModelConfig
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=261, d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=384,
                               max_seq_len=64, mode="diffusion", mask_token_id=259, next_token_head=True,
                               delete_token_id=260),
        data=DataConfig(source=Sorting(length=8, max_value=9), seq_len=48, batch_size=64),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1000, out_dir="runs/medlm_sort", log_every=50, eval_every=500, eval_generate=200,
            eval_max_new_tokens=16, save_every=500,
        ),
        algorithm=DiffusionConfig(objective="edit", eval_steps=4, eval_edit_rounds=4),
        tokenizer="byte",
    )
