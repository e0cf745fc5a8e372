"""Tool-use agent in miniature: SFT on expert LakeQA trajectories, then multi-turn GRPO on the
same task; exact match on held-out episodes before and after GRPO.

A byte-level model of the quickstart shape is trained from scratch with SFT on trajectories
of `jaxlm.agents.lakeqa.LakeQATask` (each a fresh generated data lake; the expert searches
once per hop and answers; the loss is on the agent's actions only). Then GRPO with the
``agent`` collector (`trainers.rl.agent`) starts from the SFT model: G rollouts per episode
through the shared agent loop, reward = exact match of the final answer. Both models act
greedily on the same held-out episodes (indices never trained on) through
`jaxlm.agents.ModelPolicy`; the report is exact match, answered rate, tool calls and tool
errors per episode.

``--abstain-rate p`` mixes the demonstrations: a share p of them (chosen at random) answer
``unknown`` at once instead of searching, as a demonstrator that often gives up would. SFT
imitates the mixture; GRPO optimises exact match instead.

    python bench/agent_lakeqa_claim.py --out runs/agent_lakeqa
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.agents import AgentConfig, AgentTaskConfig, ModelPolicy, run_episodes
from jaxlm.agents.lakeqa import LakeQATask, expert_trajectory
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train

SYSTEM = "Tools: search(query)."
SEQ_LEN = 512
MAX_NEW = 96
HELD_OUT = 1_000_000  # episodes from this index on are never trained on


def model_config() -> jaxlm.ModelConfig:
    return jaxlm.ModelConfig.tiny(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=SEQ_LEN)


def abstained(trajectory: dict) -> dict:
    """The demonstration that answers ``unknown`` at once (system and question kept)."""
    return {"messages": trajectory["messages"][:2] + [{"role": "assistant", "content": "unknown"}]}


def evaluate(model, task: LakeQATask, n: int) -> dict[str, float]:
    loop = AgentConfig(max_turns=task.hops + 2, max_new_tokens=MAX_NEW, max_episode_tokens=SEQ_LEN)
    got = run_episodes(ModelPolicy(model), [task.episode(HELD_OUT + i) for i in range(n)], loop)
    return {"exact_match": float(np.mean([t.reward for t in got])),
            "answered": float(np.mean([t.answer is not None for t in got])),
            "tool_calls": float(np.mean([t.tool_calls for t in got])),
            "tool_errors": float(np.mean([len(t.errors) for t in got]))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--hops", type=int, default=1)
    ap.add_argument("--trajectories", type=int, default=4000)
    ap.add_argument("--abstain-rate", type=float, default=0.0,
                    help="share of the SFT demonstrations that answer 'unknown' without searching")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--grpo-iterations", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="GRPO episodes per iteration")
    ap.add_argument("--group", type=int, default=8, help="GRPO rollouts per episode")
    ap.add_argument("--temperature", type=float, default=0.7, help="GRPO rollout temperature")
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate")
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="agent_lakeqa_"))
    root.mkdir(parents=True, exist_ok=True)
    task = LakeQATask(seed=args.seed, hops=args.hops, system=SYSTEM)
    timings = {}

    if not 0 <= args.abstain_rate < 1:
        ap.error(f"--abstain-rate={args.abstain_rate} must be in [0, 1)")
    mix = f"_abstain{args.abstain_rate}" if args.abstain_rate else ""
    sft_dir = root / f"sft_h{args.hops}_s{args.seed}_{args.sft_steps}{mix}"
    if not (sft_dir / "model").exists():
        t0 = time.perf_counter()
        data = root / f"trajectories_h{args.hops}_s{args.seed}{mix}.jsonl"
        abstain = np.random.default_rng([args.seed, 5]).random(args.trajectories) < args.abstain_rate
        data.write_text("".join(json.dumps(abstained(expert_trajectory(task, i)) if a else expert_trajectory(task, i))
                                + "\n" for i, a in enumerate(abstain)))
        train(ExperimentConfig(
            model=model_config(),
            data=DataConfig(source=Files(path=str(data), eval_fraction=0.01), seq_len=SEQ_LEN, batch_size=16,
                            pack=True, eval_examples=16),
            optimizer=OptimizerConfig(lr=2e-3, warmup_steps=30, min_lr_ratio=0.1),
            trainer=TrainerConfig.quiet(args.sft_steps, str(sft_dir), seed=args.seed),
            algorithm=SFTConfig(), tokenizer="byte"))
        timings["sft_s"] = time.perf_counter() - t0
    results = {"sft": evaluate(jaxlm.load_model(sft_dir / "model"), task, args.eval)}
    print("SFT:", results["sft"], flush=True)

    grpo_dir = root / (f"grpo_h{args.hops}_s{args.seed}_{args.sft_steps}{mix}_{args.grpo_iterations}"
                       f"_t{args.temperature}_lr{args.lr}_b{args.batch}x{args.group}")
    if not (grpo_dir / "model").exists():
        t0 = time.perf_counter()
        agent = AgentTaskConfig(task="lakeqa", seed=args.seed, hops=args.hops, system=SYSTEM,
                                loop=AgentConfig(max_turns=args.hops + 2, max_episode_tokens=SEQ_LEN))
        train(ExperimentConfig(
            model=model_config(),
            data=DataConfig(batch_size=args.batch, seq_len=SEQ_LEN, pack=False),
            optimizer=OptimizerConfig(lr=args.lr, warmup_steps=0, schedule="constant", weight_decay=0.0),
            trainer=TrainerConfig.quiet(args.grpo_iterations, str(grpo_dir), seed=args.seed, log_every=1),
            algorithm=GRPOConfig(collector="agent", agent=agent, num_generations=args.group,
                                 max_new_tokens=MAX_NEW, temperature=args.temperature, mu=1, minibatches=2),
            tokenizer="byte", init_from=str(sft_dir / "model")))
        timings["grpo_s"] = time.perf_counter() - t0
    results["grpo"] = evaluate(jaxlm.load_model(grpo_dir / "model"), task, args.eval)
    print("GRPO:", results["grpo"], flush=True)
    train_rows = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in train_rows if r.get("kind") == "train" and "reward" in r]
    if rewards:
        k = max(len(rewards) // 5, 1)
        results["grpo_rollout_reward"] = {"first": float(np.mean(rewards[:k])), "last": float(np.mean(rewards[-k:]))}
    print(f"LakeQA {args.hops}-hop, {args.eval} held-out episodes; SFT {args.sft_steps} steps of 16 x {SEQ_LEN} "
          f"packed tokens on {args.trajectories} demonstrations ({args.abstain_rate:.0%} abstaining), "
          f"then GRPO {args.grpo_iterations} iterations "
          f"of {args.batch} x {args.group} rollouts (temperature {args.temperature}, lr {args.lr})")
    if "grpo_rollout_reward" in results:
        r = results.pop("grpo_rollout_reward")
        print(f"  GRPO rollout reward, first / last fifth of the iterations: {r['first']:.3f} / {r['last']:.3f}")
        results["grpo_rollout_reward"] = r
    for name in ("sft", "grpo"):
        r = results[name]
        print(f"  {name:<5} exact match {r['exact_match']:6.1%}  answered {r['answered']:6.1%}  "
              f"tool calls {r['tool_calls']:.2f}  tool errors {r['tool_errors']:.2f}")
    print(json.dumps({**results, "timings": timings}))
    return results


if __name__ == "__main__":
    main()
