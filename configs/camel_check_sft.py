"""CAMEL's first stage on `jaxlm.data.judging.SumJudging` with the checking reflection
(``reflection="check"``): after the sum, the reflection copies answer A and says whether it
equals the sum, so the final verdict reads one comparison the reflection has just written.
Otherwise as `configs/camel_sft.py` (same judge, pairs, revision share and schedule).
`bench/camel_claim.py --recipe camel_check_sft` measures the gate curve.

    jaxlm train camel_check_sft
"""

import dataclasses

from configs.camel_sft import get_config as sft_config
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    sft = sft_config()
    return dataclasses.replace(
        sft,
        data=dataclasses.replace(sft.data, source=dataclasses.replace(sft.data.source, reflection="check")),
        trainer=dataclasses.replace(sft.trainer, out_dir="runs/camel_check_sft", eval_max_new_tokens=40),
    )
