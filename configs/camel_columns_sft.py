"""CAMEL's first stage on `jaxlm.data.judging.SumJudging` with the column reflection
(``reflection="columns"``): column addition right to left, answer A checked one digit per
column, then ``A? yes|no`` and the final verdict. Every number is zero-padded to 4 digits so
each step of the reflection reads tokens a fixed distance back. Half the wrong answers are
random numbers with the right answer's digit count (``random_wrong=0.5``), the rest off by 1,
10 or 1000: with offsets alone answer A shows most of the sum's digits, and the judge copies
them into its column totals instead of adding. Otherwise as `configs/camel_sft.py` (same
judge, schedule and half revision demonstrations); rows are longer (one example is ~145 byte
tokens), so a batch holds 24 of them.
`bench/camel_claim.py --recipe camel_columns_sft` measures the gate curve.

    jaxlm train camel_columns_sft
"""

import dataclasses

from configs.camel_sft import get_config as sft_config
from trainers.config import ExperimentConfig


def get_config() -> ExperimentConfig:
    sft = sft_config()
    source = dataclasses.replace(sft.data.source, reflection="columns", width=4, random_wrong=0.5)
    return dataclasses.replace(
        sft,
        model=dataclasses.replace(sft.model, max_seq_len=192),
        data=dataclasses.replace(sft.data, source=source, seq_len=152, batch_size=24),
        trainer=dataclasses.replace(sft.trainer, out_dir="runs/camel_columns_sft", eval_max_new_tokens=100),
    )
