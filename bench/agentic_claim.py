"""Agentic mid-training in miniature: environmentally-native vs contextually-native
trajectories at equal tokens, scored by tool-use success in the live environment.

A base model of the quickstart shape is first trained on a generic, tool-free skill:
`Extraction` (copy the facts of a sentence into JSON), so that it can copy values out of
its context; from scratch, the 3-layer model learned the tool protocol but not the copying
within 800 steps (`--base-steps 0`). Two copies of the base are then mid-trained with SFT
on trajectories of `trainers.rl.tools.ToolProblems` (look a price up, search an inventory
file, multiply): one on trajectories whose observations are the tools' real outputs, one on
the same plans with observations written from the problem's context (`context_trajectory`).
The loss is on the agent's actions only; both train the same steps of the same packed batch
shape (equal tokens). Then each model acts in `ToolEnvironment` on held-out problems: greedy
turns, each ended at a newline (one action per line in the built-in format), tool calls
executed, the final answer verified.

    python bench/agentic_claim.py --out runs/agentic                 # and --seed 1
    python bench/agentic_claim.py --out runs/agentic --base-steps 0  # both arms from scratch
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import jaxlm
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Extraction
from trainers.config import ExperimentConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train
from trainers.rl.tools import SYSTEM, ToolEnvironment, ToolProblems, context_trajectory, environment_trajectory, \
    parse_tool_call

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=768)
PROBLEMS = ToolProblems(seed=0)
HELD_OUT = 100_000  # problems from this index on are never trained on


def write_trajectories(path: Path, kind: str, n: int) -> Path:
    env = ToolEnvironment(PROBLEMS)
    rows = [{"messages": environment_trajectory(env, i) if kind == "environment" else context_trajectory(PROBLEMS, i)}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tool_use_success(model, n: int, max_turns: int = 5) -> dict:
    """Held-out problems solved acting in the environment, the mean number of tool calls, and
    the first episode's ``[action, observation]`` turns (``example``)."""
    tok = model.tokenizer
    newline = tok.encode("\n")
    envs = [ToolEnvironment(PROBLEMS) for _ in range(n)]
    episodes = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": env.reset(HELD_OUT + i)}]
                for i, env in enumerate(envs)]
    reward, calls, active, example = [0.0] * n, [0] * n, list(range(n)), []
    for _ in range(max_turns):
        if not active:
            break
        prompts = [tok.apply_chat_template(episodes[i], add_generation_prompt=True) for i in active]
        out = jaxlm.generate(model, prompts, max_new_tokens=96, temperature=0, add_bos=False,
                             stop_tokens=[*newline, tok.eos_id])
        still = []
        for i, text in zip(active, out.texts):
            text = text.strip()
            call = parse_tool_call(text)
            obs, r, done = envs[i].step(text)
            if i == 0:
                example.append([text, obs])
            if call is not None and "error" not in call:
                calls[i] += 1
                episodes[i] += [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": call}]}, {"role": "tool", "content": obs}]
            elif call is not None:
                episodes[i] += [{"role": "assistant", "content": text}, {"role": "tool", "content": obs}]
            reward[i] = r
            if not done:
                still.append(i)
        active = still
    return {"success": sum(reward) / n, "tool_calls": sum(calls) / n, "example": example}


def train_base(out: Path, steps: int, seed: int) -> Path:
    """The shared starting point: ``steps`` SFT steps on `Extraction` (no tools, no chat)."""
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=MODEL, data=DataConfig(source=Extraction(), seq_len=96, batch_size=32, pack=True, eval_examples=32),
            optimizer=OptimizerConfig(lr=3e-3, warmup_steps=30, min_lr_ratio=0.05),
            trainer=TrainerConfig.quiet(steps, str(out), seed=seed), algorithm=SFTConfig(), tokenizer="byte"))
    return out / "model"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trajectories", type=int, default=4000)
    ap.add_argument("--base-steps", type=int, default=1000,
                    help="Extraction steps of the shared base (0: both arms start from scratch)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="agentic_claim_"))
    root.mkdir(parents=True, exist_ok=True)
    base = train_base(root / f"base_seed{args.seed}", args.base_steps, args.seed) if args.base_steps else None
    results = {}
    for kind in ("environment", "context"):
        data = write_trajectories(root / f"{kind}.jsonl", kind, args.trajectories)
        out = root / f"{kind}_base{args.base_steps}_seed{args.seed}"
        if not (out / "model").exists():
            train(ExperimentConfig(
                model=MODEL, data=DataConfig(source=Files(path=str(data), eval_fraction=0.01), seq_len=768,
                                             batch_size=16, pack=True, eval_examples=16),
                optimizer=OptimizerConfig(lr=2e-3, warmup_steps=30, min_lr_ratio=0.05),
                trainer=TrainerConfig.quiet(args.steps, str(out), seed=args.seed),
                algorithm=SFTConfig(), tokenizer="byte", init_from=None if base is None else str(base)))
        results[kind] = tool_use_success(jaxlm.load_model(out / "model"), args.eval)
    print(f"base: {args.base_steps} Extraction steps; then {args.steps} SFT steps of 16 x 768 packed tokens each "
          f"(equal tokens); {args.eval} held-out problems")
    for kind, r in results.items():
        print(f"  {kind + '-native':<20} success {r['success']:6.1%}   tool calls per episode {r['tool_calls']:.2f}")
    for kind, r in results.items():
        print(f"{kind}-native, held-out problem 0:")
        for action, observation in r["example"]:
            print(f"  agent: {action[:120]!r}\n  tool:  {observation[:120]!r}")
    print(json.dumps({k: {m: v for m, v in r.items() if m != "example"} for k, r in results.items()}))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
