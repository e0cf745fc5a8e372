"""CAMEL's second stage (method card B.7, `trainers.rl.camel`): GRPO with counterfactual prefix
augmentation from the SFT judge of `configs/camel_sft.py`. Each prompt's rollouts continue after
an initial verdict in the prompt, the judge's own or (half the time) the other letter, and the
reward is the final verdict's correctness, so the reflection learns to revise.

    jaxlm train camel_sft && jaxlm train camel_grpo
"""

import dataclasses

from configs.camel_sft import get_config as sft_config
from trainers.config import CamelConfig, ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    sft = sft_config()
    return ExperimentConfig(
        model=sft.model,
        data=dataclasses.replace(sft.data, source=dataclasses.replace(sft.data.source, revise_fraction=0.0), seq_len=88,
                                 batch_size=16, pack=False),
        optimizer=OptimizerConfig(lr=3e-4, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=40, out_dir="runs/camel_grpo", log_every=4, eval_every=20, eval_generate=100,
                              eval_max_new_tokens=32, save_every=20),
        algorithm=GRPOConfig(num_generations=4, max_new_tokens=24, mu=2, collector="camel",
                             camel=CamelConfig(flip_prob=0.5)),
        tokenizer="byte",
        init_from="runs/camel_sft/model",
    )
