"""GRPO on 2-digit addition from a briefly SFT'd quickstart model (the verifier's 0/1 reward).

    jaxlm train quickstart trainer.steps=150 trainer.out_dir=runs/sft150
    jaxlm train grpo_arithmetic init_from=runs/sft150/model

`jaxlm quickstart` runs the two stages back to back (`--rl-steps`).
"""

import dataclasses

from configs import quickstart
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    base = quickstart.get_config()
    return dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, batch_size=16, pack=False, seq_len=24),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(
            steps=40, out_dir="runs/grpo_arithmetic", log_every=5, eval_every=20, eval_generate=200,
            save_every=20,
        ),
        algorithm=GRPOConfig(num_generations=8, max_new_tokens=6, temperature=1.0, mu=2, minibatches=2),
        init_from="runs/quickstart/model",
    )
