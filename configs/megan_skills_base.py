"""A base model that already has the skills, for the compositional MeGan experiment: the
primitive conditions (copy, reverse, sort, add 1-6) written in the prompt, one at a time
(``[reverse] 5 2 9 1=1 9 2 5``). Compositions ("reverse, add 3") are never shown.

    jaxlm train megan_skills_base trainer.out_dir=runs/megan_comp/base
"""

import dataclasses

from configs.megan_base import get_config as copy_base_config
from jaxlm.data.conditioned import ConditionedDigits

PRIMITIVES = ("copy", "reverse", "sort") + tuple(f"add {k}" for k in range(1, 7))


def get_config():
    cfg = copy_base_config()
    source = ConditionedDigits(conditions=PRIMITIVES, held_out=(), condition_in="prompt", cond_len=16)
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, source=source, seq_len=40),
        trainer=dataclasses.replace(cfg.trainer, steps=600, out_dir="runs/megan_comp/base", save_every=600),
    )
