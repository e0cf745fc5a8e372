"""ME-DLM's claim in miniature: edit rounds after mask diffusion raise accuracy over mask
diffusion alone at a fixed total budget of forwards (denoising steps + edit rounds).

Two models of the same run length, both from one trained masked diffusion LM given the edit head
(`jaxlm.models.edit_head`): the **edit** model is trained with ME-DLM's stage 3 (half the batches
the model's own filled and self-edited outputs), the **control** with stage 2 (masked answers
only, both heads trained). On the same held-out prompts each model decodes with mask diffusion
alone at S steps, and the edit model also with S - R steps followed by up to R edit rounds
(every predicted edit; with ``--edits-per-round k`` also only each row's k most confident edits
per round, and with ``--edit-thresholds t`` only the edits of confidence >= t). Accuracy is
exact match; "forwards" counts the forwards actually run (edit rounds stop once no row
changes). For every budget and R (all edits) the edit model's S mask steps and its S - R steps +
R rounds are also compared prompt by prompt: prompts fixed and broken by the rounds, and the
exact sign test (`jaxlm.eval.paired`).

    (train the base and add the edit head as configs/medlm_sort.py describes, then)
    jaxlm train medlm_sort init_from=runs/medlm_base trainer.out_dir=runs/medlm_stage3
    jaxlm train medlm_sort init_from=runs/medlm_base algorithm.edit_intermediate_ratio=0 \\
        trainer.out_dir=runs/medlm_control
    python bench/medlm_claim.py --edit runs/medlm_stage3/model --control runs/medlm_control/model --n 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

import jaxlm
from jaxlm.eval.paired import paired_comparison
from jaxlm.inference.diffusion import diffusion_generate
from trainers.recipes import load_config


def accuracy(model, examples, task, *, gen_length: int, steps: int, edit_rounds: int, edits_per_round=None,
             edit_threshold=None, batch: int = 250):
    """Accuracy, forwards per prompt, rounds that changed a row, and per prompt whether it was right."""
    correct, forwards, edits = [], 0, []
    delete = model.config.delete_token_id
    for i in range(0, len(examples), batch):
        chunk = examples[i:i + batch]
        out = diffusion_generate(model, [e["prompt"] for e in chunk], gen_length=gen_length, steps=steps,
                                 banned_tokens=(delete,), edit_rounds=edit_rounds,
                                 edits_per_round=edits_per_round if edit_rounds else None,
                                 edit_threshold=edit_threshold if edit_rounds else None)
        correct += [task.verify(e, t) for e, t in zip(chunk, out.texts)]
        forwards += out.forwards * len(chunk)
        if edit_rounds:
            edits += out.edits.tolist()
    return (float(np.mean(correct)), forwards / len(examples), float(np.mean(edits)) if edits else 0.0,
            np.asarray(correct, bool))


def _which(row) -> str:
    """Which edits a row's rounds made: all, the k most confident ("top k") or those >= a threshold."""
    if not row["edit_rounds"]:
        return "-"
    if row.get("edits_per_round") is not None:
        return f"top {row['edits_per_round']}"
    if row.get("edit_threshold") is not None:
        return f">= {row['edit_threshold']:g}"
    return "all"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--edit", required=True, help="the stage-3 checkpoint")
    ap.add_argument("--control", required=True, help="the stage-2-only checkpoint of the same length")
    ap.add_argument("--n", type=int, default=500, help="held-out prompts")
    ap.add_argument("--recipe", default="medlm_sort", help="the config whose task the models were trained on")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of the recipe's task, as given to jaxlm train")
    ap.add_argument("--gen-length", type=int, default=16)
    ap.add_argument("--budgets", type=int, nargs="*", default=[2, 4, 8, 16], help="total forwards S")
    ap.add_argument("--rounds", type=int, nargs="*", default=[1, 2, 4], help="edit rounds R taken from S")
    ap.add_argument("--edits-per-round", type=int, nargs="*", default=[],
                    help="also decode with only these many most confident edits per row and round (ME-DLM's "
                         "pred_per_step); every predicted edit is always run too")
    ap.add_argument("--edit-thresholds", type=float, nargs="*", default=[],
                    help="also decode making only the edits whose confidence is at least this (not in the reference)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    task = load_config(args.recipe, args.set).data.source
    examples = [task.example(i, "eval") for i in range(args.n)]
    models = {"edit": jaxlm.load_model(args.edit), "control": jaxlm.load_model(args.control)}
    rows, right = [], {}
    G = args.gen_length
    for S in args.budgets:
        for name, model in models.items():
            acc, fwd, _, right[name, S, 0] = accuracy(model, examples, task, gen_length=G, steps=S, edit_rounds=0)
            rows.append({"model": name, "budget": S, "mask_steps": S, "edit_rounds": 0, "accuracy": acc,
                         "forwards": fwd})
        for R in args.rounds:
            if R >= S:
                continue
            selections = [(None, None), *((k, None) for k in args.edits_per_round),
                          *((None, t) for t in args.edit_thresholds)]
            for k, t in selections:
                acc, fwd, used, correct = accuracy(models["edit"], examples, task, gen_length=G, steps=S - R,
                                                   edit_rounds=R, edits_per_round=k, edit_threshold=t)
                if k is None and t is None:
                    right["edit", S, R] = correct
                rows.append({"model": "edit", "budget": S, "mask_steps": S - R, "edit_rounds": R,
                             "edits_per_round": k, "edit_threshold": t, "accuracy": acc, "forwards": fwd,
                             "rounds_changing_a_row": used})
    print(f"{'model':8s} {'S':>3s} {'mask':>5s} {'edit':>5s} {'edits':>8s} {'accuracy':>9s} {'forwards':>9s}")
    for r in rows:
        print(f"{r['model']:8s} {r['budget']:3d} {r['mask_steps']:5d} {r['edit_rounds']:5d} {_which(r):>8s} "
              f"{r['accuracy']:9.3f} {r['forwards']:9.2f}")
    for S in args.budgets:
        base = max(r["accuracy"] for r in rows if r["budget"] == S and r["edit_rounds"] == 0)
        best = max((r for r in rows if r["budget"] == S and r["edit_rounds"]), key=lambda r: r["accuracy"],
                   default=None)
        if best is not None:
            print(f"budget {S}: best with edits {best['accuracy']:.3f} (R={best['edit_rounds']}, edits: "
                  f"{_which(best)}) vs best mask-only "
                  f"{base:.3f}: {best['accuracy'] - base:+.3f}")
    for (name, S, R), correct in right.items():  # the edit model's own S mask steps vs S - R steps + R rounds
        if name == "edit" and R:
            c = paired_comparison(right["edit", S, 0], correct)
            rows.append({"model": "edit", "budget": S, "paired_edit_rounds": R, **dataclasses.asdict(c)})
            print(f"budget {S}, edit model: {S - R} steps + {R} edit round(s) vs {S} mask steps, paired: {c.fixed} "
                  f"prompts fixed, {c.broken} broken, sign test p = {c.p_value:.2g}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
