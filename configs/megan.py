"""MeGan on a multi-condition task, starting from `configs/megan_base.py`'s model. Three arms:

    # meta-gating, base frozen (only the shared hypernetwork trains); condition -> hypernetwork
    jaxlm train megan trainer.out_dir=runs/megan/hyper
    # meta-gating, everything trains
    jaxlm train megan optimizer.trainable= trainer.out_dir=runs/megan/hyper_full
    # plain fine-tuning of the whole model with the condition written in the prompt
    jaxlm train megan model.mlp=swiglu data.source.condition_in=prompt optimizer.trainable= \\
        trainer.out_dir=runs/megan/prompt_ft

Held-out conditions ("add 3", "add 7") are never trained; evaluate them with
data.source.eval_on=held_out (bench/architectures.py does).
"""

import dataclasses

from configs.megan_base import get_config as base_config
from jaxlm.data.conditioned import ConditionedDigits
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    base = base_config()
    return ExperimentConfig(
        model=dataclasses.replace(base.model, mlp="meta_swiglu", meta_rank=64),
        data=dataclasses.replace(base.data, source=ConditionedDigits(condition_in="hyper"), eval_examples=256),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=20, trainable="meta_gate"),
        trainer=TrainerConfig(steps=400, out_dir="runs/megan/hyper", log_every=20, eval_every=200,
                              eval_generate=0, save_every=200),
        algorithm=SFTConfig(beta_l1=0.0),
        init_from="runs/megan/base/model",
    )
