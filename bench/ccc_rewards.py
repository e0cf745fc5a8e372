"""CCC-GRPO's rewards in miniature (docs/rl.md): one SFT start (`configs/ccc_sft.py`), then GRPO
(`configs/ccc_grpo.py`: 30 iterations, 256 prompts x 8 samples) with each reward + the format
reward, over RL seeds; greedy few-shot MAE, few-shot signed error and CCC on 400 balanced
held-out examples. ``--batch-size`` changes the prompts per iteration (the CCC is over them).

    python bench/ccc_rewards.py --seeds 0 1 2 3 4
    python bench/ccc_rewards.py --seeds 0 1 2 3 4 --batch-size 32 --rewards ccc neg_abs_error
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from trainers.recipes import load_config  # noqa: E402
from trainers.loop import initial_model, make_tokenizer, train  # noqa: E402
from trainers.rl.ccc import evaluate_regression  # noqa: E402
from trainers.rl.loop import GRPOTrainer  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/ccc_rewards")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rewards", nargs="+", default=["ccc", "neg_abs_error", "crps_loo", "verifier"])
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per iteration (default: the recipe's)")
    a = ap.parse_args()
    sft = Path(a.out) / "sft"
    if not (sft / "model").exists():
        train(load_config("ccc_sft", [f"trainer.out_dir={sft}", "trainer.progress=false", "trainer.eval_generate=0"]))
    tok = make_tokenizer("byte")
    compiled, results = None, {}
    batch = [] if a.batch_size is None else [f"data.batch_size={a.batch_size}"]
    print("| reward (+ format) | RL seed | few-shot MAE | few-shot signed error | CCC | exact match | time (s) |\n"
          "|---|---|---|---|---|---|---|")
    for seed in a.seeds:
        for reward in a.rewards:
            t0 = time.perf_counter()
            cfg = load_config("ccc_grpo", [f"init_from={sft / 'model'}", f"trainer.seed={seed}", *batch])
            cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rewards=(reward, "format")))
            task = cfg.data.source
            examples = [task.example(i, "eval") for i in range(400)]
            trainer = GRPOTrainer(cfg, initial_model(cfg), tok)
            if compiled is None:  # the arms differ only in their rewards: one compiled update
                r = evaluate_regression(nnx.merge(trainer.graphdef, trainer.params), task, examples, tok)
                print(f"| none (SFT) | - | {r['mae_few']:.2f} | {r['bias_few']:+.2f} | {r['ccc']:.3f} | "
                      f"{r['accuracy']:.3f} | - |")
                compiled = (trainer.step_fn, trainer.logprob_fn)
            trainer.step_fn, trainer.logprob_fn = compiled
            state = trainer.init_state()
            for k in range(cfg.trainer.steps):
                state, _, _ = trainer.iteration(state, k)
            r = results[reward, seed] = evaluate_regression(nnx.merge(trainer.graphdef, state.params), task,
                                                            examples, tok)
            print(f"| {reward} | {seed} | {r['mae_few']:.2f} | {r['bias_few']:+.2f} | {r['ccc']:.3f} | {r['accuracy']:.3f} | "
                  f"{time.perf_counter() - t0:.1f} |", flush=True)
    print("\n| reward (+ format) | mean few-shot MAE | mean few-shot signed error | mean CCC |\n|---|---|---|---|")
    for reward in a.rewards:
        rs = [results[reward, seed] for seed in a.seeds]
        print(f"| {reward} | {np.mean([r['mae_few'] for r in rs]):.2f} | {np.mean([r['bias_few'] for r in rs]):+.2f} | "
              f"{np.mean([r['ccc'] for r in rs]):.3f} |")
    if {"ccc", "neg_abs_error"} <= set(a.rewards):  # the paper's claim, seed by seed
        pairs = [(results["ccc", s], results["neg_abs_error", s]) for s in a.seeds]
        print(f"\nccc beats neg_abs_error on few-shot MAE in {sum(c['mae_few'] < b['mae_few'] for c, b in pairs)}"
              f"/{len(pairs)} seeds, on CCC in {sum(c['ccc'] > b['ccc'] for c, b in pairs)}/{len(pairs)}, "
              f"on either in {sum(c['mae_few'] < b['mae_few'] or c['ccc'] > b['ccc'] for c, b in pairs)}/{len(pairs)}")
