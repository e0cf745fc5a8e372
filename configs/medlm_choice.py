"""ME-DLM (edit-based refinement of a masked diffusion LM) on copying one of three listed words.

The model has the next-token head and a delete token (ids: [MASK] 259, ``<|del|>`` 260, past
the byte tokenizer's 259). As in ME-DLM, it starts from a trained masked diffusion LM whose
next-token head is a copy of its LM head (`jaxlm.models.edit_head`):

    jaxlm train diffusion_choice
    python -m jaxlm.models.edit_head runs/diffusion_choice/model runs/medlm_base
    jaxlm train medlm_choice init_from=runs/medlm_base trainer.out_dir=runs/medlm_stage3

``algorithm.edit_intermediate_ratio=0`` is ME-DLM's stage 2 (masked answers only, both heads
trained); the default 0.5 is stage 3 (half the batches are the model's own filled and
self-edited outputs, labelled by the canonical edit alignment). Few-step mask diffusion mixes
letters of different words here; the edit rounds can replace them.
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Choice
from jaxlm.models.config import ModelConfig
from trainers.config import DiffusionConfig, ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(vocab_size=261, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384,
                               max_seq_len=64, mode="diffusion", mask_token_id=259, next_token_head=True,
                               delete_token_id=260),
        data=DataConfig(source=Choice(words=3, length=6, letters="abcdefgh"), seq_len=40, batch_size=64),
        optimizer=OptimizerConfig(lr=5e-4, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=1000, out_dir="runs/medlm_choice", log_every=50, eval_every=500, eval_generate=200,
            eval_max_new_tokens=8, save_every=500,
        ),
        algorithm=DiffusionConfig(objective="edit", eval_steps=2, eval_edit_rounds=2),
        tokenizer="byte",
    )
