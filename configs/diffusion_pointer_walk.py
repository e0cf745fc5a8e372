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

import dataclasses

from configs.diffusion_sort import get_config as sort_config
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import PointerWalk
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    """`configs/diffusion_sort.py`'s model at 6 layers and trainer, on pointer walks."""
    base = sort_config()
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, n_layers=6),
        data=DataConfig(source=PointerWalk(symbols=6, hops=8, one_cycle=False), seq_len=48, batch_size=64),
        optimizer=dataclasses.replace(base.optimizer, lr=2e-3),
        trainer=dataclasses.replace(base.trainer, steps=6000, out_dir="runs/diffusion_pointer_walk", eval_every=1500,
                                    eval_max_new_tokens=16),
    )
