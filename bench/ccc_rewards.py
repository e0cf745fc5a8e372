"""CCC-GRPO's rewards in miniature (docs/rl.md): one SFT start (`configs/ccc_sft.py`), then GRPO
(`configs/ccc_grpo.py`: 30 iterations, 32 prompts x 8 samples) with each reward + the format
reward, over RL seeds; greedy few-shot MAE and CCC on 400 balanced held-out examples.

    python bench/ccc_rewards.py --seeds 0 1 2
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402

from trainers.config import load_config  # noqa: E402
from trainers.loop import initial_model, make_tokenizer, train  # noqa: E402
from trainers.rl.ccc import evaluate_regression  # noqa: E402
from trainers.rl.loop import GRPOTrainer  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/ccc_rewards")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rewards", nargs="+", default=["ccc", "neg_abs_error", "crps_loo"])
    a = ap.parse_args()
    sft = Path(a.out) / "sft"
    if not (sft / "model").exists():
        train(load_config("ccc_sft", [f"trainer.out_dir={sft}", "trainer.progress=false", "trainer.eval_generate=0"]))
    tok = make_tokenizer("byte")
    compiled = None
    print("| reward (+ format) | RL seed | few-shot MAE | CCC | exact match | time (s) |\n|---|---|---|---|---|---|")
    for seed in a.seeds:
        for reward in a.rewards:
            t0 = time.perf_counter()
            cfg = load_config("ccc_grpo", [f"init_from={sft / 'model'}", f"trainer.seed={seed}"])
            cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, rewards=(reward, "format")))
            task = cfg.data.source
            examples = [task.example(i, "eval") for i in range(400)]
            trainer = GRPOTrainer(cfg, initial_model(cfg), tok)
            if compiled is None:  # the arms differ only in their rewards: one compiled update
                r = evaluate_regression(nnx.merge(trainer.graphdef, trainer.params), task, examples, tok)
                print(f"| none (SFT) | - | {r['mae_few']:.2f} | {r['ccc']:.3f} | {r['accuracy']:.3f} | - |")
                compiled = (trainer.step_fn, trainer.logprob_fn)
            trainer.step_fn, trainer.logprob_fn = compiled
            state = trainer.init_state()
            for k in range(cfg.trainer.steps):
                state, _, _ = trainer.iteration(state, k)
            r = evaluate_regression(nnx.merge(trainer.graphdef, state.params), task, examples, tok)
            print(f"| {reward} | {seed} | {r['mae_few']:.2f} | {r['ccc']:.3f} | {r['accuracy']:.3f} | "
                  f"{time.perf_counter() - t0:.1f} |", flush=True)
