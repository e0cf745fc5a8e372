"""PrefixRL (Setlur et al. 2026; method card B.1, `trainers.rl.prefix`): GRPO on sorting 6
digits, one more than the base policy (`configs/prefix_rl_base.py`) ever saw. The base never
solves these problems (plain GRPO gets no reward), so the correct traces come from another
source, the task's reference solutions (trace_source=both: the base's own correct samples
first, when it has any). Training sees only problems prefixed with the start of a trace;
the held-out accuracy is on unprefixed problems.

    python -m configs.prefix_rl_base && jaxlm train configs/prefix_rl_base.py
    jaxlm train configs/prefix_rl.py           # init_from=runs/prefix_rl_base/model

Measured on 2 CPU cores (~30 s + ~45 s): unprefixed held-out greedy accuracy 0 -> 0.23 after
60 iterations; plain GRPO (`algorithm.prefix=None`) gets reward 0 throughout.
"""

from configs.prefix_rl_base import MODEL
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from trainers.config import (
    ExperimentConfig,
    GRPOConfig,
    OptimizerConfig,
    PrefixConfig,
    TrainerConfig,
)


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=MODEL,
        data=DataConfig(source=Sorting(length=6, max_value=9), seq_len=48, batch_size=16),
        optimizer=OptimizerConfig(lr=3e-4, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=60, out_dir="runs/prefix_rl", log_every=4, eval_every=20, eval_generate=64,
                              save_every=20),
        algorithm=GRPOConfig(
            num_generations=4, max_new_tokens=16, mu=2,
            prefix=PrefixConfig(
                problems=64, trace_source="both", pool_samples=16, pass_rate_samples=8,
                fractions=(0.2, 0.4, 0.6, 0.8), band_lo=0.05, band_hi=0.5, recalibrate_every=4, rows_per_call=64,
            ),
        ),
        init_from="runs/prefix_rl_base/model",
    )
