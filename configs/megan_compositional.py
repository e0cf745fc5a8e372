"""MeGan with compositional conditions, starting from `configs/megan_base.py`'s model:
conditions ``"<op>, add <k>"`` (op in copy / reverse / sort, k in 1-6); the held-out pairs
``copy, add 3``, ``reverse, add 5`` and ``sort, add 1`` are never trained, but each of their
parts is, with other partners. Same three arms as `configs/megan.py`:

    jaxlm train megan_compositional trainer.out_dir=runs/megan_comp/hyper
    jaxlm train megan_compositional optimizer.trainable= trainer.out_dir=runs/megan_comp/hyper_full
    jaxlm train megan_compositional model.mlp=swiglu data.source.condition_in=prompt optimizer.trainable= \\
        trainer.out_dir=runs/megan_comp/prompt_ft

Evaluate the held-out pairs with data.source.eval_on=held_out (bench/architectures.py --only D).
"""

import dataclasses

from configs.megan import get_config as megan_config
from jaxlm.data.conditioned import ConditionedDigits


def get_config():
    cfg = megan_config()
    return dataclasses.replace(
        cfg,  # seq_len fits the longest prompt-arm row: "[reverse, add 5] 8 4 4 2=0 6 6 4" + BOS/EOS
        data=dataclasses.replace(cfg.data, source=ConditionedDigits.compositional(condition_in="hyper"), seq_len=40),
        trainer=dataclasses.replace(cfg.trainer, steps=1000, out_dir="runs/megan_comp/hyper", eval_every=500,
                                    save_every=500),
    )
