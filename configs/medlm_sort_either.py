"""ME-DLM's stage 3 on sorting eight digits in either order (`configs/diffusion_sort_either.py`):
an answer decoded in too few steps mixes the ascending and descending orders, and every wrong
position is a one-token substitution, which an edit round can make.

    jaxlm train diffusion_sort_either
    python -m jaxlm.models.edit_head runs/diffusion_sort_either/model runs/medlm_either_base
    jaxlm train medlm_sort_either init_from=runs/medlm_either_base trainer.out_dir=runs/medlm_either_stage3
    jaxlm train medlm_sort_either init_from=runs/medlm_either_base algorithm.edit_intermediate_ratio=0 \\
        trainer.out_dir=runs/medlm_either_control
    python bench/medlm_claim.py --recipe medlm_sort_either --gen-length 12 \\
        --edit runs/medlm_either_stage3/model --control runs/medlm_either_control/model --n 500

Measured (docs/benchmarks.md): stage 3 straight from the base leaves edit heads that delete
correct digits; with stage 2 first (``init_from`` the control) and
``algorithm.edit_target=nearest`` they keep 97% of a correct answer. In one run edit rounds
lowered accuracy against mask diffusion alone at every budget; in a rerun one round in place of
the last mask step raised it at 3 and 6 total steps and lowered it at 2, 4 and 12, and the
control trained on stage 2 for as long stayed ahead at every budget.
"""

import dataclasses

from configs.diffusion_sort_either import get_config as either_config
from configs.medlm_sort import get_config as medlm_config
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    """`configs/medlm_sort.py` (edit head, stage 3) on `configs/diffusion_sort_either.py`'s data."""
    base = medlm_config()
    return dataclasses.replace(
        base,
        data=either_config().data,
        optimizer=dataclasses.replace(base.optimizer, lr=5e-4),
        trainer=dataclasses.replace(base.trainer, out_dir="runs/medlm_sort_either", eval_max_new_tokens=12),
    )
