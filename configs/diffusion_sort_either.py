"""A masked diffusion LM trained from scratch by SFT to sort eight digits ascending *or*
descending (`jaxlm.data.tasks.Sorting(order="either")`: ``sort 80353172:`` -> ``01233578`` or
``87533210``, drawn per example, both accepted).

The answer is bimodal: a position's marginal mixes its ascending and descending digit, so
committing many positions from one forward mixes the two orders, while one committed
position that tells them apart decides the rest. One token per step decodes it and a few
tokens per step do not: the task on which this project measures few-step diffusion decoding
(SPEED's and ME-DLM's miniatures, `bench/speed_claim.py`, `bench/medlm_claim.py`). Digits
are not separated, so every wrong position is a one-token substitution that an edit round
can repair.

    jaxlm train diffusion_sort_either     # ~12 min on 2 CPU cores
"""

import dataclasses

from configs.diffusion_sort import get_config as sort_config
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    """`configs/diffusion_sort.py`'s model at 6 layers, on eight digits in either order."""
    base = sort_config()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, n_layers=6),
        data=DataConfig(source=Sorting(length=8, max_value=9, separator="", order="either"), seq_len=40,
                        batch_size=64),
        trainer=dataclasses.replace(base.trainer, steps=4000, out_dir="runs/diffusion_sort_either",
                                    eval_max_new_tokens=12),
    )
