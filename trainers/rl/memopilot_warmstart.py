"""The MemoPilot writer's format warm start as a command (`trainers.rl.memopilot.format_warm_start`)::

    python -m trainers.rl.memopilot_warmstart runs/memopilot_rps_sft [--config configs/memopilot_rps.py]

writes the jaxlm checkpoint ``runs/memopilot_rps_sft/model`` that the recipe's ``init_from``
names: the config's model, SFT'd to write one random move letter then EOS per memory.
"""

from __future__ import annotations

import argparse
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    import jaxlm
    from trainers.config import load_config
    from trainers.loop import make_tokenizer
    from trainers.rl.memopilot import format_warm_start

    p = argparse.ArgumentParser(description="MemoPilot writer format warm start")
    p.add_argument("out", help="run directory; the checkpoint goes to OUT/model")
    p.add_argument("--config", default="configs/memopilot_rps.py")
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    tokenizer = make_tokenizer(cfg.tokenizer)
    model = format_warm_start(jaxlm.build_model(cfg.model, seed=cfg.trainer.seed), cfg.algorithm.environment,
                              tokenizer, width=cfg.data.seq_len, steps=args.steps, seed=cfg.trainer.seed)
    model.tokenizer = tokenizer
    print(jaxlm.save_checkpoint(model, f"{args.out}/model", overwrite=True))


if __name__ == "__main__":
    main()
