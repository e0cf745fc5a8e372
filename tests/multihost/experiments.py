"""The runs of the multi-host check (`tests/test_multihost.py`): SFT, and GRPO from a saved
model, each 4 steps on a (data, fsdp, tensor) = (2, 2, 2) mesh, checkpointed at step 2.
Importing this module does not start JAX's backends."""

from __future__ import annotations

from pathlib import Path

import jaxlm
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from trainers.config import ExperimentConfig, GRPOConfig, MeshConfig, OptimizerConfig, TrainerConfig

STEPS, FIRST = 4, 2  # the multi-host runs stop after FIRST steps, then resume to STEPS
INIT_SEED = 1  # the model GRPO starts from: build_model(MODEL, seed=INIT_SEED), saved by the test

MODEL = jaxlm.ModelConfig.tiny(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=48,
                               vocab_size=260, init_std=0.1)

#: Adam with eps = 1 and lr = 1: each step is proportional to its (clipped) gradient, so a
#: float32 rounding difference in a near-zero gradient entry stays that small instead of
#: becoming a +-lr step (Adam's m / sqrt(v) is about sign(g) when eps << |g|)
OPTIMIZER = OptimizerConfig(lr=1.0, warmup_steps=0, schedule="constant", eps=1.0, weight_decay=0.0)


def trainer(out_dir: Path, multihost: bool, **kw) -> TrainerConfig:
    return TrainerConfig(out_dir=str(out_dir), steps=STEPS, save_every=FIRST, log_every=1, eval_every=0, seed=0,
                         progress=False, multihost=multihost, mesh=MeshConfig(data=2, fsdp=2, tensor=2),
                         eval_generate=8, eval_max_new_tokens=4, **kw)


def sft_config(run: Path, multihost: bool) -> ExperimentConfig:
    """SFT with 2 micro-batches per step. Unpacked: process p's rows are examples p, p + 2,
    ..., so each global batch holds the examples a one-process run's does (with packing each
    process would pack its own share)."""
    return ExperimentConfig(
        model=MODEL,
        data=DataConfig(source=Arithmetic(digits=1), seq_len=16, batch_size=16, eval_examples=16),
        optimizer=OPTIMIZER,
        trainer=trainer(run, multihost, grad_accum=2),
    )


def grpo_config(run: Path, multihost: bool, init_from: Path) -> ExperimentConfig:
    """GRPO from ``init_from`` with a reference model (beta > 0) and 2 minibatches per
    iteration; the rewards (the exact answer, and a length penalty that makes the advantages
    nonzero for a model that has not learned the task) are computed on every process from
    the same gathered completions."""
    return ExperimentConfig(
        model=MODEL,
        data=DataConfig(source=Arithmetic(digits=1), seq_len=16, batch_size=4),
        optimizer=OPTIMIZER,
        trainer=trainer(run, multihost),
        algorithm=GRPOConfig(num_generations=4, max_new_tokens=4, mu=1, minibatches=2, beta=0.04,
                             rewards=("verifier", "length_penalty"), reward_weights=(1.0, 1.0)),
        init_from=str(init_from),
    )
