"""PRISM-style mid-training study in miniature: does a mid-training stage (a math-heavier
mixture) before SFT and RL give RL a larger gain than the same SFT and RL from the base
model, and what does each stage do to the general domain?

Domains: ``math`` (2-digit addition; the SFT demonstrations drop the ones carry, as the
quickstart's, so RL has something to fix) and ``general`` (MarkovText). Stages
(`trainers.stages.run_stages`, retention of both domains after each):

* base:      pretrain on 85% general / 15% math;
* with mid:  base -> mid-train (50% / 50%) -> SFT (math) -> GRPO (math);
* without:   base -> SFT -> GRPO, the same SFT and GRPO settings.

    python bench/prism_claim.py --out runs/prism
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import jaxlm
from jaxlm.data.mixture import mixture_of
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic, MarkovText
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.stages import Stage, run_stages

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)
DOMAINS = {"math": Arithmetic(digits=2, ops=("+",)), "general": MarkovText(n_words=32, fanout=4)}


def sft_stage(name, source, steps, lr, seed):
    return Stage(name, ExperimentConfig(
        model=MODEL, data=DataConfig(source=source, seq_len=96, batch_size=32, pack=True, eval_examples=64),
        optimizer=OptimizerConfig(lr=lr, warmup_steps=20, min_lr_ratio=0.1),
        trainer=TrainerConfig.quiet(steps, seed=seed),
        algorithm=SFTConfig(), tokenizer="byte"))


def rl_stage(iterations, seed):
    return Stage("grpo", ExperimentConfig(
        model=MODEL, data=DataConfig(source=DOMAINS["math"], seq_len=24, batch_size=32, eval_examples=64),
        optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.0),
        trainer=TrainerConfig.quiet(iterations, seed=seed),
        algorithm=GRPOConfig(num_generations=8, max_new_tokens=6, temperature=1.0, mu=2, minibatches=2),
        tokenizer="byte"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-steps", type=int, default=400)
    ap.add_argument("--mid-steps", type=int, default=200)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--rl-iterations", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="prism_claim_"))
    kw = dict(domains=DOMAINS, eval_n=200, eval_seq_len=96, max_new_tokens=6)
    base = run_stages([sft_stage("base", mixture_of(DOMAINS, {"general": 0.85, "math": 0.15}), args.base_steps,
                                 3e-3, 0)], root / "base", **kw)
    base_model = root / "base" / "base" / "model"
    flawed = dataclasses.replace(DOMAINS["math"], carry_slip=0.6)
    sft = sft_stage("sft", flawed, args.sft_steps, 1e-3, args.seed)
    arms = {
        "with mid-training": [sft_stage("mid", mixture_of(DOMAINS, {"general": 0.5, "math": 0.5}), args.mid_steps,
                                        1e-3, args.seed), sft, rl_stage(args.rl_iterations, args.seed)],
        "without": [sft, rl_stage(args.rl_iterations, args.seed)],
    }
    results = {"base": base}
    for name, stages in arms.items():
        first = dataclasses.replace(stages[0], config=dataclasses.replace(stages[0].config, init_from=str(base_model)))
        results[name] = run_stages([first, *stages[1:]], root / f"seed{args.seed}" / name.replace(" ", "_"), **kw)
    print(f"base {args.base_steps} steps (85% general), mid-training {args.mid_steps} steps (50/50), SFT "
          f"{args.sft_steps} steps (flawed math demos), GRPO {args.rl_iterations} iterations; seed {args.seed}")
    print(f"{'arm':<20} {'stage':<6} {'math acc':>8} {'math loss':>9} {'general loss':>12}")
    for name, report in results.items():
        for r in report:
            d = r["domains"]
            print(f"{name:<20} {r['stage']:<6} {d['math']['accuracy']:>8.1%} {d['math']['loss']:>9.4f} "
                  f"{d['general']['loss']:>12.4f}")
    for name in arms:
        rep = {r["stage"]: r["domains"] for r in results[name]}
        gain = rep["grpo"]["math"]["accuracy"] - rep["sft"]["math"]["accuracy"]
        results[f"rl_gain {name}"] = gain
        print(f"RL gain {name}: {gain:+.1%}")
    print(json.dumps(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
