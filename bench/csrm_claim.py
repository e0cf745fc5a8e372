"""CSRM in miniature: a configurable safety reward model trained with Bradley-Terry plus the
calibration loss, against the same model trained with Bradley-Terry only.

Data: `jaxlm.data.safety` (four harm categories x three topics x four severities; a
configuration allows a subset of categories), expanded by configuration-targeted
augmentation on the training configurations; three configurations are held out. Measured
on every item under the held-out configurations: compliance accuracy of
``sigmoid(s - b) > 1/2``, the ECE of ``sigmoid(s - b)`` (10 bins), and the flip rate: the
share of harmful items (severity > 0) whose predicted compliance is "yes" under the
all-allowing configuration and "no" under the all-forbidding one.

Both models train with a linear warmup and a cosine decay of the learning rate (with a
constant rate, ``--min-lr-ratio 1 --warmup-steps 0``, the calibration loss stalls near the
value of a model that reads the severity and ignores the configuration).

    python bench/csrm_claim.py
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from flax import nnx

import jaxlm
from jaxlm.data import safety
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.calibration import expected_calibration_error
from trainers.reward_model import RewardModel, RewardModelConfig, score_texts, train_reward_model

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=96)
HELD_OUT = (3, 7, 12)  # indices into safety.all_configs()


def evaluate(rm, base, held) -> dict:
    texts, labels = [], []
    for c in held:
        for it in base:
            texts.append(safety.rm_input(c, it))
            labels.append(safety.compliant(it, c))
    p = np.asarray(rm.p_compliant(score_texts(rm, texts)))
    labels = np.asarray(labels)
    harmful = [it for it in base if it.severity > 0]
    everything, nothing = frozenset(safety.CATEGORIES), frozenset()
    p_open = np.asarray(rm.p_compliant(score_texts(rm, [safety.rm_input(everything, it) for it in harmful])))
    p_shut = np.asarray(rm.p_compliant(score_texts(rm, [safety.rm_input(nothing, it) for it in harmful])))
    return {"accuracy": float(np.mean((p > 0.5) == labels)), "ece": expected_calibration_error(p, labels, n_bins=10),
            "flip_rate": float(np.mean((p_open > 0.5) & (p_shut < 0.5)))}


def run(steps: int = 3000, lr: float = 3e-3, seed: int = 0, per_item: int = 32, *, warmup_steps: int = 100,
        min_lr_ratio: float = 0.05, model: jaxlm.ModelConfig = MODEL) -> dict:
    base = safety.items()
    configs = safety.all_configs()
    held = [configs[i] for i in HELD_OUT]
    points, pairs = safety.augment(base, [c for c in configs if c not in held], per_item=per_item, seed=seed)
    out = {"points": len(points), "pairs": len(pairs), "steps": steps,
           "model": {"n_layers": model.n_layers, "d_model": model.d_model}}
    for name, lam in (("bt_only", 0.0), ("csrm", 1.0)):
        lm = jaxlm.build_model(model, seed=seed, tokenizer=ByteTokenizer())
        rm, log = train_reward_model(RewardModel(lm, rngs=nnx.Rngs(seed + 1)), points, pairs,
                                     RewardModelConfig(calibration_weight=lam, steps=steps, learning_rate=lr,
                                                       batch_points=32, batch_pairs=16, seed=seed,
                                                       warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio))
        out[name] = {**evaluate(rm, base, held), "final": log[-1]}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--per-item", type=int, default=32, help="augmentation: configurations drawn per item")
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine decay to this share of --lr; 1 = constant")
    ap.add_argument("--layers", type=int, default=MODEL.n_layers)
    ap.add_argument("--d-model", type=int, default=MODEL.d_model)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = MODEL.replace(n_layers=args.layers, d_model=args.d_model, ffn_dim=2 * args.d_model)
    print(json.dumps(run(args.steps, args.lr, args.seed, args.per_item, warmup_steps=args.warmup_steps,
                         min_lr_ratio=args.min_lr_ratio, model=model), indent=1))
