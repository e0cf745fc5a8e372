"""Peer side of bench/grpo_vs_tunix.py: one GRPO iteration in Tunix's GRPOLearner.

Standalone: runs under a separate venv that has ``google-tunix`` (it is never
imported by jaxlm). Setup, from the repository root::

    python3 -m venv /work/tunix-venv
    /work/tunix-venv/bin/pip install google-tunix==0.1.7 'jax[cpu]'
    /work/tunix-venv/bin/python bench/peers/tunix_grpo.py

One iteration = rollout of G=8 completions for each of 8 prompts (64 sequences,
64 new tokens each, Tunix's vanilla sampler, temperature 1.0 / top_p 1.0) + a
trivial reward + group-relative advantages + one AdamW update on all 64 sequences
(num_iterations mu = 1, beta = 0 so no reference model). The model is a tiny
random Qwen3 (``tunix.models.qwen3``: GQA, qk-norm, tied embeddings, SwiGLU) on a
1x1 (fsdp, tp) mesh; trainer and rollout share the same weights (colocated).

The first ``--warmup`` iterations (compilation) are timed separately; the
``--iters`` after them give ``seconds_per_iteration`` (median; mean also printed).
Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The shared config, mirrored exactly by the jaxlm side of the benchmark.
CONFIG = dict(
    vocab_size=512,
    n_layers=4,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=512,
    qk_norm=True,
    tie_embeddings=True,
    norm_eps=1e-6,
    rope_theta=1_000_000.0,
    dtype="float32",
    prompt_len=32,  # tokens per prompt, BOS included; no padding
    max_new_tokens=64,
    max_seq_len=96,  # prompt_len + max_new_tokens (= Tunix kv_cache_size)
    n_prompts=8,
    group_size=8,
    temperature=1.0,
    top_p=1.0,
    learning_rate=1e-5,
    optimizer="adamw",
    beta=0.0,
    num_iterations=1,
    epsilon=0.2,
)

PAD, BOS, EOS = 0, 1, 2
_BYTE0 = 3  # byte b -> id b + 3 (3..258); ids 259..511 decode to nothing


class ByteTokenizer:
    """The minimal tokenizer interface Tunix's TokenizerAdapter accepts."""

    def encode(self, text: str, **kwargs) -> list[int]:
        return [b + _BYTE0 for b in text.encode("utf-8")]

    def decode(self, ids, **kwargs) -> str:
        out = bytes(int(i) - _BYTE0 for i in ids if _BYTE0 <= int(i) < _BYTE0 + 256)
        return out.decode("utf-8", errors="replace")

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def reward_fn(prompts, completions, **kwargs):
    """Trivial reward: share of lowercase ASCII letters in the completion."""
    return [sum(c.islower() for c in s) / (len(s) + 1.0) for s in completions]


def make_prompts(step: int, n: int, length: int) -> list[str]:
    # length - 1 characters: the sampler prepends BOS, so each prompt is `length` tokens.
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    return [
        "".join(alphabet[(step * 7 + i * 3 + j) % 26] for j in range(length - 1))
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=2, help="untimed (compile) iterations")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations")
    ap.add_argument("--log-compiles", action="store_true", help="log each XLA compile (stderr)")
    args = ap.parse_args()

    from absl import logging as absl_logging

    if args.log_compiles:
        os.environ["JAX_LOG_COMPILES"] = "1"
    else:
        logging.getLogger().setLevel(logging.ERROR)
        absl_logging.set_verbosity(absl_logging.ERROR)

    t_import = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from importlib.metadata import version

    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    c = CONFIG
    # Auto axes: jax >= 0.7 makes Explicit-axis meshes by default, which Tunix's
    # models do not support (the embedding gather raises ShardingTypeError).
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    model_cfg = qwen3.ModelConfig(
        num_layers=c["n_layers"],
        vocab_size=c["vocab_size"],
        embed_dim=c["d_model"],
        hidden_dim=c["ffn_dim"],
        num_heads=c["n_heads"],
        head_dim=c["head_dim"],
        num_kv_heads=c["n_kv_heads"],
        rope_theta=int(c["rope_theta"]),
        norm_eps=c["norm_eps"],
        use_tied_embedding=c["tie_embeddings"],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    with jax.set_mesh(mesh):
        model = qwen3.Qwen3(model_cfg, rngs=nnx.Rngs(params=0))

    total_iters = args.warmup + args.iters
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adamw(c["learning_rate"]),
        eval_every_n_steps=10**9,
        max_steps=total_iters,
        mini_batch_size=c["n_prompts"],
        train_micro_batch_size=c["n_prompts"],
        rollout_micro_batch_size=c["n_prompts"],
        compute_logps_micro_batch_size=c["n_prompts"],
        pbar_description=None,
    )
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=c["max_new_tokens"],
        max_prompt_length=c["prompt_len"],
        kv_cache_size=c["max_seq_len"],
        temperature=c["temperature"],
        top_p=c["top_p"],
        top_k=None,
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=training_config,
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=ByteTokenizer(), cluster_config=cluster_config
    )
    algo_config = grpo_learner.GRPOConfig(
        num_generations=c["group_size"],
        num_iterations=c["num_iterations"],
        beta=c["beta"],
        epsilon=c["epsilon"],
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=algo_config, reward_fns=reward_fn
    )
    setup_s = time.perf_counter() - t_import

    # Time each global step (= rollout + rewards/advantages + update), blocking on the
    # updated weights so asynchronously dispatched work is charged to its own step.
    times: list[float] = []
    cpu_times: list[float] = []  # process CPU seconds (all threads): less load-sensitive
    compiles: list[int] = []  # XLA compilations per iteration (timed ones should be 0)
    n_compiles = [0]

    def on_event(event: str, duration: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            n_compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    inner = learner._run_global_step

    def timed_global_step(*a, **kw):
        c0 = n_compiles[0]
        t0, p0 = time.perf_counter(), time.process_time()
        out = inner(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - p0)
        compiles.append(n_compiles[0] - c0)
        return out

    learner._run_global_step = timed_global_step

    # Phase split (diagnostic): rollout = cluster.generate (sampler only),
    # update = cluster.update_actor (policy logps + loss + grad + AdamW).
    phases: dict[str, list[float]] = {"rollout": [], "update": []}
    gen_lens: list[float] = []
    inner_generate, inner_update = cluster.generate, cluster.update_actor

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = inner_generate(*a, **kw)
        phases["rollout"].append(time.perf_counter() - t0)
        gen_lens.append(float(np.mean([len(t) for t in out.tokens])))
        return out

    def timed_update(*a, **kw):
        t0 = time.perf_counter()
        out = inner_update(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model, nnx.Param))
        phases["update"].append(time.perf_counter() - t0)
        return out

    cluster.generate, cluster.update_actor = timed_generate, timed_update

    # "prompts" must be one array leaf: Tunix repeats each batch G times with
    # jax.tree.map(np.repeat), which would split a Python list into per-string leaves.
    train_ds = [
        {"prompts": np.array(make_prompts(s, c["n_prompts"], c["prompt_len"]))}
        for s in range(total_iters)
    ]
    t0 = time.perf_counter()
    learner.train(train_ds)
    wall = time.perf_counter() - t0
    if len(times) != total_iters:
        sys.exit(f"expected {total_iters} iterations, ran {len(times)}")

    warm, timed = times[: args.warmup], times[args.warmup :]
    result = {
        "peer": "tunix",
        "version": {
            "google-tunix": version("google-tunix"),
            "jax": jax.__version__,
            "flax": version("flax"),
        },
        "seconds_per_iteration": round(statistics.median(timed), 4),
        "mean_seconds_per_iteration": round(statistics.mean(timed), 4),
        "iteration_seconds": [round(t, 4) for t in timed],
        "cpu_seconds_per_iteration": round(statistics.median(cpu_times[args.warmup :]), 4),
        "warmup_seconds": [round(t, 4) for t in warm],
        "phase_seconds_median": {
            k: round(statistics.median(v[args.warmup :]), 4) for k, v in phases.items()
        },
        "compiles_per_iteration": compiles,
        "mean_completion_tokens": gen_lens,
        "optimizer_steps": int(cluster.actor_trainer.train_steps),
        "setup_seconds": round(setup_s, 3),
        "train_wall_seconds": round(wall, 3),
        "device": str(jax.devices()[0]),
        "config": c,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
