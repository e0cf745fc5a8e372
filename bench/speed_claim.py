"""SPEED's claim in miniature: a student distilled from a sharpened teacher decodes with >= 2x
fewer steps than the teacher's one-token-per-step schedule at the teacher's accuracy (within 2
points), with the Slow-Fast partition direction ablated (low- vs high-sensitivity group decoded
jointly; the sources disagree).

Three models on the same held-out prompts: the teacher, the **student** (initialised from the
teacher, trained with SPEED's loss: MLM + lambda tau^2 KL to the sharpened teacher on its correct
masked positions) and a **control** trained the same steps without the KL term, so the effect of
distillation is separated from that of more training. Each decodes with LLaDA's fixed schedule
at G, G/2, G/4, G/8 and 1 steps (G the response length), with confidence thresholds 0.9 and
0.99 (Fast-dLLM's rule, where a sharper model commits more tokens per step) and with Slow-Fast
in both directions.

    jaxlm train diffusion_sort model.n_layers=6 data.source.length=8 data.seq_len=48 \\
        trainer.steps=2000 trainer.out_dir=runs/diffusion_sort8 trainer.eval_max_new_tokens=16
    jaxlm train diffusion_sort model.n_layers=6 data.source.length=8 data.seq_len=48 \\
        init_from=runs/diffusion_sort8/model algorithm.teacher=runs/diffusion_sort8/model optimizer.lr=5e-4 \\
        trainer.steps=500 trainer.eval_every=0 trainer.out_dir=runs/speed_student
    jaxlm train diffusion_sort model.n_layers=6 data.source.length=8 data.seq_len=48 \\
        init_from=runs/diffusion_sort8/model optimizer.lr=5e-4 \\
        trainer.steps=500 trainer.eval_every=0 trainer.out_dir=runs/speed_control
    python bench/speed_claim.py --teacher runs/diffusion_sort8/model --student runs/speed_student/model \\
        --control runs/speed_control/model --n 1000
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import jaxlm
from jaxlm.inference.diffusion import SlowFast, diffusion_generate
from trainers.recipes import load_config


def evaluate(model, examples, task, kw, gen_length: int, block_length: int, batch: int = 250):
    """Accuracy, steps per batch of ``batch`` (its slowest row's, averaged), forwards per batch,
    and steps per answer (each row's own, averaged: what decoding one prompt at a time takes)."""
    correct, steps, forwards, row_steps = [], [], [], []
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        out = diffusion_generate(model, [e["prompt"] for e in chunk], gen_length=gen_length,
                                 block_length=block_length, **kw)
        correct += [task.verify(e, t) for e, t in zip(chunk, out.texts)]
        steps.append(out.steps)
        forwards.append(out.forwards)
        row_steps += out.row_steps.tolist()
    return float(np.mean(correct)), float(np.mean(steps)), float(np.mean(forwards)), float(np.mean(row_steps))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--n", type=int, default=1000, help="held-out prompts")
    ap.add_argument("--recipe", default="diffusion_sort", help="the config whose task the models were trained on")
    ap.add_argument("--set", nargs="*", default=["data.source.length=8"], metavar="KEY=VALUE",
                    help="overrides of the recipe's task, as given to jaxlm train")
    ap.add_argument("--gen-length", type=int, default=16)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--jsd-threshold", type=float, default=0.05)
    ap.add_argument("--confidence", type=float, default=0.5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    task = load_config(args.recipe, args.set).data.source
    examples = [task.example(i, "eval") for i in range(args.n)]
    G, L = args.gen_length, args.block_length
    methods = {f"fixed {s} steps": dict(steps=s) for s in sorted({G, G // 2, G // 4, G // 8, 1} - {0}, reverse=True)}
    # sharpening lifts more positions above a confidence threshold (Fast-dLLM's rule): fewer steps
    methods.update({f"threshold {t}": dict(threshold=t) for t in (0.9, 0.99)})
    for fast in ("low", "high"):
        methods[f"slow-fast ({fast} jointly)"] = dict(
            slow_fast=SlowFast(jsd_threshold=args.jsd_threshold, confidence=args.confidence, fast=fast))
    rows = []
    for name, path in (("teacher", args.teacher), ("student", args.student), ("control", args.control)):
        model = jaxlm.load_model(path)
        for method, kw in methods.items():
            acc, steps, fwd, per_answer = evaluate(model, examples, task, kw, G, L)
            rows.append({"model": name, "method": method, "accuracy": acc, "steps": steps, "forwards": fwd,
                         "steps_per_answer": per_answer})
            print(f"{name:8s} {method:28s} acc {acc:.3f} steps {steps:5.2f} forwards {fwd:5.2f} "
                  f"steps per answer {per_answer:5.2f}", flush=True)
    base = next(r for r in rows if r["model"] == "teacher" and r["method"] == f"fixed {G} steps")
    print(f"teacher, one token per step: {base['accuracy']:.3f} in {base['steps']:.0f} steps")
    for key in ("steps", "steps_per_answer"):
        for name in ("teacher", "student", "control"):
            ok = [r for r in rows if r["model"] == name and r[key] <= base["steps"] / 2
                  and r["accuracy"] >= base["accuracy"] - 0.02]
            best = min(ok, key=lambda r: r[key], default=None)
            print(f"{name}: fewest {key.replace('_', ' ')} (<= half the teacher's) within 2 points of the teacher: "
                  + (f"{best['method']} ({best[key]:.2f}, {best['accuracy']:.3f})" if best else "none"))
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
