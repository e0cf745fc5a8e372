"""The point-wise baseline of CCC-GRPO (card B.2): `configs/ccc_grpo.py` with the reward
``-|prediction - target|`` (scaled; `trainers.rl.ccc`) instead of the swap-in batch CCC.

    jaxlm train configs/ccc_grpo_mae.py     # -> runs/ccc_grpo_mae
"""

import dataclasses

from configs.ccc_grpo import get_config as ccc_config
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    cfg = ccc_config()
    return dataclasses.replace(
        cfg,
        algorithm=dataclasses.replace(cfg.algorithm, rewards=("neg_abs_error", "format")),
        trainer=dataclasses.replace(cfg.trainer, out_dir="runs/ccc_grpo_mae"),
    )
