"""Distil the quickstart model into a smaller student on the same task: forward KL on the
teacher's top-16 log-probs plus a tail bucket (`trainers.distill`), half the data CE.

    jaxlm train quickstart && jaxlm train distill
    jaxlm train distill algorithm.distill.divergence=tail_aware algorithm.distill.teacher_logprobs=full \\
        algorithm.distill.top_k=2 algorithm.distill.tail_beta=0.05
"""

import dataclasses

from configs import quickstart
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, SFTConfig, TrainerConfig
from trainers.distill.config import DistillConfig


def get_config() -> ExperimentConfig:
    base = quickstart.get_config()
    return dataclasses.replace(
        base,
        model=ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=64),
        trainer=dataclasses.replace(base.trainer, steps=600, out_dir="runs/distill"),
        algorithm=SFTConfig(distill=DistillConfig(teacher="runs/quickstart/model", divergence="forward_kl",
                                                  teacher_logprobs="topk", top_k=16, ce_weight=0.5)),
    )
