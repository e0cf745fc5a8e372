"""CofactGVR in miniature (grounded RL, ICML 2026; method card B.4): GRPO with the
counterfactual evidence bonus and Q-PAS against plain GRPO, on a grounded task with a
shortcut (`jaxlm.data.grounded.GridQA`, completions ``[cell]colour``).

0. Pretraining on single-hop lookups over the same kind of grids (`GridLookup`: which cell
   holds shape S, ``?S=[1]``, and what colour is cell i, ``#[1]g``), written in GridQA's
   evidence form, so that a GridQA completion is a shape query followed by a colour read. It
   is never asked a shape's colour directly, so the answer runs through the evidence. The
   search by shape is learnt abruptly (at d64 x 3, lr 1e-3: by step 3000); the default 12,000
   steps take 40-60 minutes on 2 cores. The pretrained model's accuracy on both kinds of
   lookup is reported. (``--tags long --lookup-form plain``: the earlier setting, lookups
   ``?S=1`` / ``#1=g`` and evidence ``<evidence>1</evidence>``, whose skill did not carry
   into GridQA's format; docs/rl.md.)
1. SFT from that model on a flawed teacher's demonstrations: the answer is always right, the
   evidence cell is wrong in half of them, and the asked object is usually colour ``r`` in
   training (the shortcut).
2. From that policy, the same GRPO budget in four arms: plain (verifier reward), + the
   counterfactual bonus (``rewards=("verifier", "counterfactual_bonus")``: the policy
   re-scores its answer with the evidence cell perturbed; the bonus goes only to correct
   rollouts), + Q-PAS (``buffer_sampler="q_pas"``), + both.
3. Greedy, on held-out problems drawn without the colour bias: answer accuracy, evidence
   accuracy, and the rate of right answers with wrong evidence.

    python bench/cofact_claim.py --out runs/cofact            # --seed 1, --seed 2: other GRPO seeds
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.data.grounded import GridLookup, GridQA
from jaxlm.data.pipeline import DataConfig
from jaxlm.eval.accuracy import task_accuracy
from trainers.config import ExperimentConfig, GRPOConfig, OptimizerConfig, SFTConfig, TrainerConfig
from trainers.loop import train



def model_config(d_model: int, n_layers: int, max_seq_len: int = 96) -> jaxlm.ModelConfig:
    return jaxlm.ModelConfig.tiny(d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=3 * d_model,
                                  max_seq_len=max_seq_len)


TASK = GridQA()  # replaced in `main` by the command line's --shortcut / --evidence-noise / --short-tags
LOOKUP = GridLookup()  # replaced in `main` by --lookup-form / --short-tags
ARMS = {
    "grpo": dict(),
    "bonus": dict(rewards=("verifier", "counterfactual_bonus")),
    "qpas": dict(buffer_sampler="q_pas"),
    "bonus+qpas": dict(rewards=("verifier", "counterfactual_bonus"), buffer_sampler="q_pas"),
}


def lookup_length() -> int:
    """Tokens of a GridLookup row (BOS, prompt, completion, EOS), rounded up to a multiple of 8."""
    ex = LOOKUP.example(0, "train")
    return -(-(len(ex["prompt"]) + len(ex["completion"]) + 2) // 8) * 8


def pretrain(out: Path, steps: int, model: jaxlm.ModelConfig, lr: float) -> Path:
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=model, data=DataConfig(source=LOOKUP, seq_len=max(96, lookup_length()), batch_size=64,
                                         eval_examples=32),
            optimizer=OptimizerConfig(lr=lr, warmup_steps=30, min_lr_ratio=0.05),
            trainer=TrainerConfig.quiet(steps, str(out)), algorithm=SFTConfig(), tokenizer="byte"))
    return out / "model"


def sft(out: Path, steps: int, model: jaxlm.ModelConfig, lr: float, init_from: Path | None) -> Path:
    if not (out / "model").exists():
        train(ExperimentConfig(
            model=model, data=DataConfig(source=TASK, seq_len=56, batch_size=64, pack=True, eval_examples=32),
            optimizer=OptimizerConfig(lr=lr, warmup_steps=30, min_lr_ratio=0.05),
            trainer=TrainerConfig.quiet(steps, str(out)), algorithm=SFTConfig(), tokenizer="byte",
            init_from=str(init_from) if init_from else None))
    return out / "model"


def grpo(out: Path, init_from: Path, iterations: int, arm: dict, bonus_weight: float, lr: float, seed: int,
         model: jaxlm.ModelConfig) -> Path:
    if not (out / "model").exists():
        kw = dict(arm)
        if "rewards" in kw:
            kw["reward_weights"] = (1.0, bonus_weight)
        train(ExperimentConfig(
            model=model, data=DataConfig(source=TASK, seq_len=56, batch_size=32, pack=False, eval_examples=32),
            optimizer=OptimizerConfig(lr=lr, warmup_steps=0, schedule="constant", weight_decay=0.0),
            trainer=TrainerConfig.quiet(iterations, str(out), seed=seed),
            algorithm=GRPOConfig(num_generations=8, max_new_tokens=max_new_tokens(), temperature=1.0, mu=2,
                                 minibatches=2, **kw),
            tokenizer="byte", init_from=str(init_from)))
    return out / "model"


def max_new_tokens() -> int:
    """The completion (markers, cell, answer) and a few tokens to spare: 26 with the long markers."""
    return len(TASK.evidence_open) + len(TASK.evidence_close) + 5


def evaluate(path: Path, n: int) -> dict:
    model = jaxlm.load_model(path)
    held = [TASK.example(i, "eval") for i in range(n)]
    res = task_accuracy(model, held, TASK.verify, tokenizer=model.tokenizer, max_new_tokens=max_new_tokens(),
                        batch_size=n)
    texts = [s["completion"] for s in res.samples]
    right = np.asarray([TASK.verify(e, t) for e, t in zip(held, texts)], bool)
    grounded = np.asarray([TASK.evidence_correct(e, t) for e, t in zip(held, texts)], bool)
    return {"answer": float(right.mean()), "evidence": float(grounded.mean()),
            "right_wrong_evidence": float((right & ~grounded).mean()),
            "answers_r": float(np.mean([TASK.parse(t)[1] == TASK.colors[0] for t in texts]))}


def lookup_accuracy(path: Path, n: int) -> dict:
    """The pretrained model's greedy answer to the first query of held-out GridLookup grids,
    by kind: "which cell holds shape S" (``?S=``, a search by content) and "what colour is
    cell i" (``#i=``, a read at a fixed offset)."""
    model = jaxlm.load_model(path)
    rows = [LOOKUP.first_query(LOOKUP.example(i, "eval")) for i in range(n)]
    texts = jaxlm.generate(model, [p for p, _, _ in rows], max_new_tokens=1, temperature=0.0).texts
    return {kind: float(np.mean([t[:1] == a for t, (_, a, k) in zip(texts, rows) if k == kind]))
            for kind in ("shape_to_cell", "cell_to_colour")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--pretrain-steps", type=int, default=12000, help="GridLookup pretraining (0: none)")
    ap.add_argument("--pretrain-lr", type=float, default=1e-3)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--bonus-weight", type=float, default=1.0, help="lambda_cf")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval", type=int, default=512)
    ap.add_argument("--shortcut", type=float, default=GridQA.shortcut)
    ap.add_argument("--evidence-noise", type=float, default=GridQA.evidence_noise)
    ap.add_argument("--tags", choices=("short", "long"), default="short",
                    help="evidence markers: [1]g, or <evidence>1</evidence>g")
    ap.add_argument("--lookup-form", choices=("plain", "evidence"), default="evidence",
                    help="GridLookup's queries: with the cell in the evidence markers (?S=[1], #[1]g), or ?S=1 / #1=g")
    args = ap.parse_args(argv)
    global TASK, LOOKUP
    tags = dict(evidence_open="[", evidence_close="]") if args.tags == "short" else {}
    TASK = GridQA(shortcut=args.shortcut, evidence_noise=args.evidence_noise, **tags)
    LOOKUP = GridLookup(query_form=args.lookup_form, **tags)
    root = args.out or Path(tempfile.mkdtemp(prefix="cofact_claim_"))
    model = model_config(args.d_model, args.layers, max(96, lookup_length()))
    form = ("_short" if args.tags == "short" else "") + ("_evform" if args.lookup_form == "evidence" else "")
    pre_tag = f"d{args.d_model}x{args.layers}{form}_pre{args.pretrain_steps}_lr{args.pretrain_lr}"
    pre = pretrain(root / pre_tag, args.pretrain_steps, model, args.pretrain_lr) if args.pretrain_steps else None
    tag = f"{pre_tag}_sft{args.sft_steps}_lr{args.sft_lr}_sc{args.shortcut}_n{args.evidence_noise}"
    base = sft(root / tag, args.sft_steps, model, args.sft_lr, pre)
    results = {"lookup": lookup_accuracy(pre, args.eval)} if pre else {}
    results["sft"] = evaluate(base, args.eval)
    for name in [a for a in args.arms.split(",") if a]:
        run = root / f"{tag}_{name}_it{args.iterations}_lr{args.lr}_w{args.bonus_weight}_s{args.seed}"
        results[name] = evaluate(grpo(run, base, args.iterations, ARMS[name], args.bonus_weight, args.lr, args.seed,
                                      model), args.eval)
    print(f"held-out (no colour bias), {args.eval} problems, greedy; GRPO {args.iterations} iterations, lr {args.lr}, "
          f"lambda_cf {args.bonus_weight}, seed {args.seed}")
    if pre:
        print(f"  pretrained lookups: shape -> cell {results['lookup']['shape_to_cell']:6.1%}  "
              f"cell -> colour {results['lookup']['cell_to_colour']:6.1%}")
    for name, r in results.items():
        if name == "lookup":
            continue
        print(f"  {name:<11} answer {r['answer']:6.1%}  evidence {r['evidence']:6.1%}  right answer + wrong evidence "
              f"{r['right_wrong_evidence']:6.1%}  answers '{TASK.colors[0]}' {r['answers_r']:6.1%}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
