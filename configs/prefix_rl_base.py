"""The base policy of the PrefixRL recipe (`configs/prefix_rl.py`): a tiny byte-level model
SFT'd on the easier version of its task, sorting lists of 2 to 5 digits.

    python -m configs.prefix_rl_base           # writes runs/prefix_rl_base/sorting_2to5.jsonl
    jaxlm train configs/prefix_rl_base.py      # SFT -> runs/prefix_rl_base/model (~1 min on CPU)
"""

import json
from pathlib import Path

from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Sorting
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig

DATA = "runs/prefix_rl_base/sorting_2to5.jsonl"
MODEL = ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def write_data(path: str = DATA, n: int = 4000, lengths=(2, 3, 4, 5), max_value: int = 9) -> Path:
    """``n`` sorting problems, lengths in turn, from the task's train split (so the RL task's
    held-out problems stay unseen)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            e = Sorting(length=lengths[i % len(lengths)], max_value=max_value).example(i // len(lengths), "train")
            f.write(json.dumps({"prompt": e["prompt"], "completion": e["completion"]}) + "\n")
    return path


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        model=MODEL,
        data=DataConfig(source=Files(path=DATA), seq_len=32, batch_size=32),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1),
        trainer=TrainerConfig(steps=300, out_dir="runs/prefix_rl_base", log_every=50, eval_generate=0,
                              save_every=300),
        algorithm=SFTConfig(),
    )


if __name__ == "__main__":
    print(write_data())
