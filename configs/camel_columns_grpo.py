"""CAMEL's second stage on the column-reflection judge of `configs/camel_columns_sft.py`: GRPO
with counterfactual prefix augmentation (method card B.7, `trainers.rl.camel`). Each prompt's
rollouts continue after an initial verdict placed in the prompt, the judge's own or, with
probability ``algorithm.camel.flip_prob``, the other letter; the reward is the final verdict's
correctness, so only a reflection that checks the answer earns it after a wrong verdict.
``algorithm.camel.flip_prob=0`` is the same GRPO without counterfactual prefixes (rollouts after
the judge's own verdict only). `bench/camel_claim.py --recipe camel_columns_sft` compares the
judges. Measured (docs/benchmarks.md): from a judge trained with 5% revision demonstrations,
both forms raise the final verdict's accuracy after a forced wrong verdict from 0.55 to 0.89;
from the judge of `camel_columns_sft` (half revisions) neither adds more than noise.

    jaxlm train camel_columns_sft && jaxlm train camel_columns_grpo
"""

import dataclasses

from configs.camel_columns_sft import get_config as sft_config
from trainers.config import (
    CamelConfig,
    ExperimentConfig,
    GRPOConfig,
    OptimizerConfig,
    TrainerConfig,
)


def get_config() -> ExperimentConfig:
    sft = sft_config()
    return ExperimentConfig(
        model=sft.model,
        data=dataclasses.replace(sft.data, source=dataclasses.replace(sft.data.source, revise_fraction=0.0),
                                 seq_len=180, batch_size=16, pack=False),
        optimizer=OptimizerConfig(lr=3e-5, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=200, out_dir="runs/camel_columns_grpo", log_every=5, eval_every=50,
                              eval_generate=100, eval_max_new_tokens=100, save_every=50),
        algorithm=GRPOConfig(num_generations=8, max_new_tokens=96, mu=2, collector="camel",
                             camel=CamelConfig(flip_prob=0.5)),
        tokenizer="byte",
        init_from="runs/camel_columns_sft/model",
    )
