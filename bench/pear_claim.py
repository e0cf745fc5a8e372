"""PEAR in miniature ("Good SFT Optimizes for SFT, Better SFT Prepares for RL", Zhang et al.
2026): SFT on off-policy teacher data, with and without PEAR's importance weights, each
followed by the same GRPO; the claim is about accuracy after RL.

1. teacher: the quickstart model trained ``--teacher-steps`` on clean ``--digits``-digit
   addition; base policy: the same shape trained on the quickstart's flawed demonstrations
   (drops the ones carry);
2. off-policy data: the teacher's samples (temperature 1) on training prompts, with its
   per-token log-probs as the behaviour policy (`trainers.annotate`, ``jaxlm logprobs``);
3. from the base policy: SFT on that data (plain, or PEAR with ``--target current``: the model
   being trained, or ``fixed``: the base policy), then the identical GRPO recipe
   (`configs/grpo_arithmetic.py`'s settings);
4. held-out greedy accuracy, pass@1 and pass@8 after SFT and after RL.

    python bench/pear_claim.py --out runs/pear_claim
    python bench/pear_claim.py --out runs/pear_claim --seed 1      # the teacher and base policy are reused
    python bench/pear_claim.py --out runs/pear_claim --teacher-steps 250 --rl-iterations 100 --target fixed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import jaxlm
from jaxlm.data.files import Files
from jaxlm.data.pipeline import DataConfig
from jaxlm.data.tasks import Arithmetic
from jaxlm.eval import heldout_accuracy, heldout_pass_at_k
from trainers.annotate import annotate_file
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train
from trainers.pear import PEARConfig

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64)


def answer_tokens(task: Arithmetic) -> int:
    """Decode budget: the longest sum (digits + 1) and the end token."""
    return task.digits + 2


def sft(out: Path, source, steps: int, *, lr=3e-3, warmup=50, init_from=None, algorithm=SFTConfig(), seed=0) -> Path:
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=MODEL, data=DataConfig(source=source, seq_len=32, batch_size=64, pack=True, eval_examples=64),
            optimizer=OptimizerConfig(lr=lr, warmup_steps=warmup, min_lr_ratio=0.05),
            trainer=TrainerConfig.quiet(steps, str(out), seed=seed),
            algorithm=algorithm, tokenizer="byte", init_from=None if init_from is None else str(init_from)))
    return out / "model"


def grpo(out: Path, task: Arithmetic, init_from: Path, iterations: int, seed: int) -> Path:
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=MODEL, data=DataConfig(source=task, seq_len=24 + 3 * max(0, task.digits - 2), batch_size=32,
                                         pack=False, eval_examples=200),
            optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0, schedule="constant", weight_decay=0.0),
            trainer=TrainerConfig.quiet(iterations, str(out), seed=seed),
            algorithm=GRPOConfig(num_generations=8, max_new_tokens=answer_tokens(task), temperature=1.0,
                                 mu=2, minibatches=2),
            tokenizer="byte", init_from=str(init_from)))
    return out / "model"


def scores(path: Path, task: Arithmetic) -> dict[str, float]:
    """Held-out greedy accuracy on 400 problems, and pass@1 / pass@8 from 8 samples at temperature 1
    (the paper reports pass@k after RL)."""
    model = jaxlm.load_model(path)
    sampled = heldout_pass_at_k(model, task, 400, ks=(1, 8), max_new_tokens=answer_tokens(task), seed=0)
    return {"greedy": heldout_accuracy(model, task, 400, max_new_tokens=answer_tokens(task), batch_size=200).accuracy,
            "pass@1": sampled.pass_at_k[1], "pass@8": sampled.pass_at_k[8]}


def teacher_data(teacher_dir: Path, task: Arithmetic, out: Path, n: int) -> Path:
    """The teacher's samples on training prompts 0..n-1, with their behaviour log-probs."""
    if out.exists():
        return out
    teacher = jaxlm.load_model(teacher_dir)
    prompts = [task.example(i, "train")["prompt"] for i in range(n)]
    texts = []
    for start in range(0, n, 256):
        texts += jaxlm.generate(teacher, prompts[start:start + 256], max_new_tokens=answer_tokens(task),
                                temperature=1.0, rng=start).texts
    raw = out.with_suffix(".raw.jsonl")
    raw.write_text("".join(json.dumps({"prompt": p, "completion": t}) + "\n" for p, t in zip(prompts, texts)))
    return annotate_file(teacher, raw, out, as_="behavior")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0, help="seed of the SFT and GRPO stages")
    ap.add_argument("--digits", type=int, default=2, help="digits of each addend")
    ap.add_argument("--teacher-steps", type=int, default=600)
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--rl-iterations", type=int, default=20)
    ap.add_argument("--gamma", type=float, default=0.9)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--variant", default="token", choices=["sequence", "token", "block"])
    ap.add_argument("--target", default="current", choices=["current", "fixed"],
                    help="PEAR's target policy: the model being trained, or the base policy (its log-probs "
                         "written once beside the behaviour log-probs)")
    args = ap.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="pear_claim_"))
    task = Arithmetic(digits=args.digits, ops=("+",))
    teacher = sft(root / f"teacher{args.teacher_steps}", task, args.teacher_steps)
    base = sft(root / f"base{args.base_steps}", dataclasses.replace(task, carry_slip=0.6), args.base_steps)
    data = teacher_data(teacher, task, root / f"teacher{args.teacher_steps}_samples.jsonl", 4096)
    if args.target == "fixed":
        data = annotate_file(jaxlm.load_model(base), data, data.with_name(f"{data.stem}.target_base{args.base_steps}.jsonl"),
                             as_="target", overwrite=True)
    files = Files(path=str(data), eval_fraction=0.02)
    pear = PEARConfig(variant=args.variant, gamma=args.gamma, clip=args.clip, target=args.target)
    arms = {"SFT": SFTConfig(), f"PEAR {args.variant} gamma={args.gamma} clip={args.clip} target={args.target}": SFTConfig(pear=pear)}
    results = {"teacher": scores(teacher, task), "base": scores(base, task)}
    for name, algo in arms.items():
        tag = "sft" if algo.pear is None else (f"pear_{args.variant}_g{args.gamma}_c{args.clip}"
                                               + ("_fixed" if args.target == "fixed" else ""))
        run_dir = root / f"teacher{args.teacher_steps}_base{args.base_steps}_seed{args.seed}"
        after_sft = sft(run_dir / f"{tag}_sft", files, args.sft_steps, lr=1e-3, warmup=10,
                        init_from=base, algorithm=algo, seed=args.seed)
        after_rl = grpo(run_dir / f"{tag}_grpo{args.rl_iterations}", task, after_sft, args.rl_iterations, args.seed)
        results[name] = {"after_sft": scores(after_sft, task), "after_rl": scores(after_rl, task)}

    def row(s: dict[str, float]) -> str:
        return " / ".join(f"{s[m]:6.1%}" for m in ("greedy", "pass@1", "pass@8"))

    print(f"{args.digits}-digit addition, 400 held-out problems, greedy / pass@1 / pass@8 (8 samples at T = 1); "
          f"SFT {args.sft_steps} steps on the teacher's samples, then GRPO {args.rl_iterations} iterations, seed {args.seed}")
    print(f"  teacher ({args.teacher_steps} steps) {row(results['teacher'])}   base policy {row(results['base'])}")
    for name in arms:
        r = results[name]
        print(f"  {name:<48} after SFT {row(r['after_sft'])}   after RL {row(r['after_rl'])}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
