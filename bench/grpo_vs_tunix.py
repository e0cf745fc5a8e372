"""One GRPO iteration: jaxlm vs Tunix's `GRPOLearner` (CPU), same config, same run.

An iteration = rollout of G=8 completions for each of 8 prompts (64 new tokens, temperature
1), a reward, group-relative advantages, and one AdamW update over all 64 sequences
(mu = 1, beta = 0, sequence-mean-token-mean aggregation, the sampler's log-probs as the
old policy's, as Tunix's default ``use_rollout_logps``). The model is a tiny random
Qwen3-style config (`bench/peers/tunix_grpo.py` holds it; both sides read it there).
Tunix runs in its own virtual environment (it is never a jaxlm dependency)::

    python3 -m venv /work/tunix-venv
    /work/tunix-venv/bin/pip install google-tunix==0.1.7 'jax[cpu]'
    python bench/grpo_vs_tunix.py --tunix-python /work/tunix-venv/bin/python

Compilation is excluded on both sides (``--warmup`` iterations); the median of
``--iters`` timed iterations is reported, with process CPU seconds (less sensitive to
other load on the machine), and the ratio jaxlm / Tunix (goal: <= 0.7).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))


def run_jaxlm(warmup: int, iters: int, shared_prompt_forward: bool = True) -> dict:
    import jax
    import numpy as np

    import jaxlm
    from jaxlm.data.pipeline import DataConfig
    from jaxlm.data.tokenizers import ByteTokenizer
    from jaxlm.models.config import ModelConfig
    from tunix_grpo import CONFIG as c, make_prompts, reward_fn
    from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, TrainerConfig
    from trainers.rl.collectors import COLLECTORS, SingleTurnCollector
    from trainers.rl.loop import GRPOTrainer
    from trainers.rl.rewards import REWARDS

    if "bench_lowercase" not in REWARDS:
        REWARDS.register("bench_lowercase")(lambda prompts, completions, **_: np.asarray(reward_fn(prompts, completions)))

        @COLLECTORS.register("bench_letters")
        def letters(cfg, graphdef, tokenizer):
            def example(i):
                step, j = divmod(i, c["n_prompts"])
                return {"prompt": make_prompts(step, c["n_prompts"], c["prompt_len"])[j], "completion": ""}

            return SingleTurnCollector(cfg, graphdef, tokenizer, examples=example)

    model_cfg = ModelConfig(
        vocab_size=c["vocab_size"], d_model=c["d_model"], n_layers=c["n_layers"], n_heads=c["n_heads"],
        n_kv_heads=c["n_kv_heads"], head_dim=c["head_dim"], ffn_dim=c["ffn_dim"], qk_norm=c["qk_norm"],
        tie_embeddings=c["tie_embeddings"], norm_eps=c["norm_eps"], rope_theta=c["rope_theta"],
        max_seq_len=c["max_seq_len"], dtype=c["dtype"], param_dtype=c["dtype"],
    )
    cfg = ExperimentConfig(
        model=model_cfg,
        data=DataConfig(seq_len=c["max_seq_len"], batch_size=c["n_prompts"]),
        optimizer=OptimizerConfig(lr=c["learning_rate"], warmup_steps=0, schedule="constant", clip_norm=None),
        trainer=TrainerConfig(steps=warmup + iters, progress=False),
        algorithm=GRPOConfig(
            collector="bench_letters", rewards=("bench_lowercase",), num_generations=c["group_size"],
            max_new_tokens=c["max_new_tokens"], temperature=c["temperature"], mu=c["num_iterations"],
            eps_low=c["epsilon"], eps_high=c["epsilon"], beta=c["beta"], aggregation="seq_mean_token_mean",
            use_sampler_logprobs=True, shared_prompt_forward=shared_prompt_forward,
        ),
    )
    tokenizer = ByteTokenizer()
    model = jaxlm.build_model(model_cfg, seed=0)
    trainer = GRPOTrainer(cfg, model, tokenizer)
    state = trainer.init_state()
    walls, cpus, lengths = [], [], []
    for k in range(warmup + iters):
        t0, c0 = time.perf_counter(), time.process_time()
        state, metrics, _ = trainer.iteration(state, k)
        jax.block_until_ready(state.params)
        if k >= warmup:
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            lengths.append(metrics["completion_len"])
    return {"peer": "jaxlm", "version": jaxlm.__version__ if hasattr(jaxlm, "__version__") else "dev",
            "seconds_per_iteration": statistics.median(walls), "cpu_seconds_per_iteration": statistics.median(cpus),
            "iteration_seconds": walls, "mean_completion_len": float(np.mean(lengths))}


def run_peer(python: str, warmup: int, iters: int) -> dict:
    cmd = [python, str(HERE / "peers" / "tunix_grpo.py"), "--warmup", str(warmup), "--iters", str(iters)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tunix-python", default="/work/tunix-venv/bin/python")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--no-shared-prompt", action="store_true",
                    help="jaxlm: one forward per rollout row (algorithm.shared_prompt_forward=False)")
    ap.add_argument("--jaxlm-only", action="store_true", help="skip the peer")
    args = ap.parse_args()
    ours = run_jaxlm(args.warmup, args.iters, shared_prompt_forward=not args.no_shared_prompt)
    print(json.dumps(ours), flush=True)
    if args.jaxlm_only:
        print(f"jaxlm  {ours['seconds_per_iteration']:.2f} s/iteration ({ours['cpu_seconds_per_iteration']:.2f} CPU-s)")
        return
    peer = run_peer(args.tunix_python, args.warmup, args.iters)
    print(json.dumps(peer), flush=True)
    print(f"jaxlm  {ours['seconds_per_iteration']:.2f} s/iteration ({ours['cpu_seconds_per_iteration']:.2f} CPU-s)")
    print(f"tunix  {peer['seconds_per_iteration']:.2f} s/iteration ({peer.get('cpu_seconds_per_iteration', float('nan')):.2f} CPU-s)")
    print(f"ratio jaxlm/tunix: wall {ours['seconds_per_iteration'] / peer['seconds_per_iteration']:.2f}x, "
          f"CPU {ours['cpu_seconds_per_iteration'] / peer.get('cpu_seconds_per_iteration', float('nan')):.2f}x (goal <= 0.7)")


if __name__ == "__main__":
    main()
