"""Weaver (graph-over-tokens RoPE + graph masks) vs a plain linearised graph, on neighbourhood
label prediction:

    jaxlm train weaver_graph trainer.out_dir=runs/graph/weaver
    jaxlm train weaver_graph data.source.structure=plain model.rope=default trainer.out_dir=runs/graph/plain
"""

from jaxlm.data.graphs import GraphLabels
from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, TrainerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=ModelConfig.tiny(d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=128,
                               rope="graph"),
        data=DataConfig(source=GraphLabels(structure="weaver"), seq_len=96, batch_size=32, pack=False,
                        eval_examples=256),
        optimizer=OptimizerConfig(lr=2e-3, warmup_steps=30, min_lr_ratio=0.1),
        trainer=TrainerConfig(steps=500, out_dir="runs/graph/weaver", log_every=10, eval_every=250,
                              eval_generate=0, save_every=250),
    )
