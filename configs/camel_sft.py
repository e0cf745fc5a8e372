"""CAMEL's first stage (method card B.7): SFT of a small judge on `jaxlm.data.judging.SumJudging`
(which of two answers to ``a+b=`` is right; demonstrations give the verdict, a worked
reflection and the final verdict). The wrong answer is off by 1, 10 or 1000, so a third of the
pairs are plain at a glance (a four-digit answer to a sum of two-digit numbers) and the rest
need the sum. Half the demonstrations are revisions (a wrong initial verdict in the prompt,
corrected after the reflection); without them the judge learns to copy its initial verdict.
`configs/camel_grpo.py` continues with GRPO over counterfactual verdict prefixes;
`bench/camel_claim.py` measures the judges' accuracy-vs-tokens curves.

    jaxlm train camel_sft
"""

from jaxlm.data.judging import SumJudging
from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128),
        data=DataConfig(source=SumJudging(digits=2, wrong_offsets=(1, 10, 1000), revise_fraction=0.5), seq_len=96,
                        batch_size=32, pack=True),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50, min_lr_ratio=0.05, weight_decay=0.01),
        trainer=TrainerConfig(
            steps=3000, out_dir="runs/camel_sft", log_every=50, eval_every=1000, eval_generate=100,
            eval_max_new_tokens=32, save_every=400,
        ),
        algorithm=SFTConfig(),
        tokenizer="byte",
    )
