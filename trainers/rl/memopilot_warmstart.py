"""The MemoPilot writer's format warm start as a command (`trainers.rl.memopilot.format_warm_start`)::

    python -m trainers.rl.memopilot_warmstart runs/memopilot_rps_sft [--config configs/memopilot_rps.py]

writes the jaxlm checkpoint ``runs/memopilot_rps_sft/model`` that the recipe's ``init_from``
names: the config's model, SFT'd to write one random move letter then EOS per memory.
With ``--player`` it also writes ``runs/memopilot_rps_sft/player``, the frozen LM player
(`trainers.rl.memopilot.player_warm_start`) for ``algorithm.environment.player=lm
algorithm.environment.player_model=runs/memopilot_rps_sft/player``.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import jaxlm
from trainers.loop import make_tokenizer
from trainers.recipes import load_config
from trainers.rl.memopilot import (
    format_warm_start,
    lm_player,
    player_warm_start,
    random_memory,
    scripted_player,
)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="MemoPilot writer format warm start")
    p.add_argument("out", help="run directory; the checkpoint goes to OUT/model")
    p.add_argument("--config", default="configs/memopilot_rps.py")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--player", action="store_true", help="also train the frozen LM player (OUT/player)")
    p.add_argument("--player-steps", type=int, default=400)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    tokenizer = make_tokenizer(cfg.tokenizer)
    model = format_warm_start(jaxlm.build_model(cfg.model, seed=cfg.trainer.seed), cfg.algorithm.environment,
                              tokenizer, width=cfg.data.seq_len, steps=args.steps, seed=cfg.trainer.seed)
    model.tokenizer = tokenizer
    print(jaxlm.save_checkpoint(model, f"{args.out}/model", overwrite=True))
    if args.player:
        import numpy as np
        from flax import nnx

        player = player_warm_start(jaxlm.ModelConfig.tiny(max_seq_len=32), tokenizer, steps=args.player_steps,
                                   seed=cfg.trainer.seed)
        rng = np.random.default_rng(1)
        memories = [random_memory(rng) for _ in range(1000)]
        seeds = rng.integers(0, 2**31, len(memories)).tolist()
        moves = lm_player(*nnx.split(player), tokenizer)(memories, seeds, 3)
        agree = np.mean([a == b for a, b in zip(moves, scripted_player(memories, seeds, 3))])
        print(f"frozen LM player agrees with the scripted rule on {agree:.3f} of 1000 held-out memories")
        print(jaxlm.save_checkpoint(player, f"{args.out}/player", overwrite=True))


if __name__ == "__main__":
    main()
