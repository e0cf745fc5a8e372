"""MemoPilot on multi-round Rock-Paper-Scissors (card B.3): multi-turn GRPO trains a memory
writer; a frozen player (scripted, or a frozen LM) plays the counter of the move the memory names.

The writer first needs the memory format (a move letter, then EOS), which a random byte
model almost never produces: a ~10 s SFT warm start on random one-letter memories writes
it, then GRPO learns what to write::

    python -m trainers.rl.memopilot_warmstart runs/memopilot_rps_sft
    jaxlm train configs/memopilot_rps.py

``data.source`` is unused (the collector plays the environment); ``data.batch_size`` is the
number of ``(opponent, seed)`` groups per iteration and ``data.seq_len`` the episode row
width (`trainers.rl.memopilot.episode_width`). Watch ``win_rate`` (and ``win_rate/<opponent>``)
in metrics.jsonl; the no-memory baseline is 1/3.

The paper's player is a frozen LLM: ``--player`` on the warm start also trains a frozen
tiny LM player, and the run uses it with::

    python -m trainers.rl.memopilot_warmstart runs/memopilot_rps_sft --player
    jaxlm train configs/memopilot_rps.py algorithm.environment.player=lm \
        algorithm.environment.player_model=runs/memopilot_rps_sft/player
"""

from jaxlm.data.pipeline import DataConfig
from jaxlm.models.config import ModelConfig
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
from trainers.rl.environments import RPSConfig
from trainers.rl.memopilot import episode_width

MEMORY_TOKENS = 2  # a move letter and EOS


def get_config() -> ExperimentConfig:
    env = RPSConfig(opponents=("constant", "cycle", "biased", "copy_last"), rounds=8)
    return ExperimentConfig(
        model=ModelConfig.tiny(max_seq_len=128),
        data=DataConfig(batch_size=8, seq_len=episode_width(env, MEMORY_TOKENS), pack=False),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig(steps=200, out_dir="runs/memopilot_rps", log_every=10, save_every=50, eval_generate=0),
        algorithm=GRPOConfig(
            collector="rps_memory", environment=env, advantage="turn_level", num_generations=8,
            max_new_tokens=MEMORY_TOKENS, temperature=1.0, mu=2, minibatches=2, beta=0.05,
        ),
        init_from="runs/memopilot_rps_sft/model",
    )
