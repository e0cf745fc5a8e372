"""CAMEL's claims in miniature (method card B.7): the confidence-gated judge matches
always-reflect accuracy with fewer generated tokens, and GRPO with counterfactual verdict
prefixes teaches the reflection to revise a wrong initial verdict rather than rubber-stamp it.

Judges of `jaxlm.data.judging.SumJudging` (which of two answers to ``a+b=`` is right), on the
same held-out pairs:

* the gate curve (`jaxlm.eval.camel.gate_curve` over one always-reflect run): accuracy and
  generated tokens per judgment at tau = 0 (never reflect), at quantiles of the verdict margin
  and at tau = inf (always reflect);
* revision: greedy reflections after a forced initial verdict, the right one and the wrong one;
  the final verdict's accuracy after the wrong one is the revision rate (0: rubber-stamping);
* with several judges, each against the first on the same pairs (always reflecting, and after a
  forced wrong verdict): pairs fixed and broken and the exact sign test
  (`jaxlm.eval.paired`).

For judges that write the checking or the column reflection (`SumJudging(reflection="check")`,
``"columns"``) it also reports how often the reflection's sum, its copy of answer A and its
yes/no are right (and for columns, the column arithmetic and the per-digit checks).

    jaxlm train camel_sft && jaxlm train camel_grpo
    python bench/camel_claim.py --judge sft=runs/camel_sft/model --judge camel=runs/camel_grpo/model
    jaxlm train camel_check_sft data.source.width=4 trainer.out_dir=runs/camel_pad_sft
    python bench/camel_claim.py --recipe camel_check_sft --set data.source.width=4 \
        --max-reflection-tokens 40 --judge padded=runs/camel_pad_sft/model
    jaxlm train camel_columns_sft
    python bench/camel_claim.py --recipe camel_columns_sft --max-reflection-tokens 100 \
        --judge columns=runs/camel_columns_sft/model
    jaxlm train camel_columns_grpo
    jaxlm train camel_columns_grpo algorithm.camel.flip_prob=0 trainer.out_dir=runs/camel_columns_grpo_own
    python bench/camel_claim.py --recipe camel_columns_sft --max-reflection-tokens 100 --n 1000 \
        --judge sft=runs/camel_columns_sft/model --judge counterfactual=runs/camel_columns_grpo/model \
        --judge own=runs/camel_columns_grpo_own/model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import numpy as np

import jaxlm
from jaxlm.data.judging import SumJudging
from jaxlm.eval.camel import CamelTemplate, final_verdict, gate_curve, gated_judge
from jaxlm.eval.paired import paired_comparison
from jaxlm.inference.sampler import generate
from trainers.recipes import load_config


def forced(model, examples, verdicts, template: CamelTemplate, max_tokens: int) -> tuple[np.ndarray, list[str]]:
    """Per pair, whether the greedy reflection after the given initial ``verdicts`` ends in the
    right final verdict, and the reflections."""
    letters = (template.judge.first, template.judge.second)
    prompts = [e["prompt"] + letters[v] + template.reflect for e, v in zip(examples, verdicts)]
    out = generate(model, prompts, max_new_tokens=max_tokens, temperature=0.0)
    return np.asarray([final_verdict(t, template) == e["answer"] for e, t in zip(examples, out.texts)]), out.texts


def reflection_checks(task: SumJudging, examples, reflections) -> dict[str, float]:
    """What the reflections got right, against the truth from the shown numbers.

    ``sum``: the reflection's sum (``a+b=c`` with the task's padding; for the column reflection
    the column totals' last digits read right to left, plus the last carry). For the checking
    and column reflections: ``copy`` (answer A copied, whole or digit by digit) and ``check``
    (the yes/no on A), also over the pairs whose answers have the same length
    (``check_same_length``). For the column reflection also ``columns`` (every column's
    operand digits, carry and total right) and ``digit_checks`` (share of the per-digit ok/no
    that match the digits written on their own line)."""
    sums, copies, checks, same, columns, digit_checks = [], [], [], [], [], []
    letter = re.escape(task.template.judge.first)
    for e, text in zip(examples, reflections):
        a, b = e["operands"]
        same.append(len(e["first"]) == len(e["second"]))
        if task.reflection == "columns":
            lines = re.findall(r"^(\d)\+(\d)\+(\d)=(\d\d) " + letter + r"(\d) (ok|no)$", text, re.MULTILINE)
            n = task.width or max(len(str(a + b)), len(e["first"]))
            carry, good, written = 0, len(lines) == n, ""
            for k, (x, y, c, total, shown, ok) in enumerate(lines):
                true_x, true_y = a // 10 ** k % 10, b // 10 ** k % 10
                good &= (int(x), int(y), int(c), int(total)) == (true_x, true_y, carry, true_x + true_y + carry)
                carry = (true_x + true_y + carry) // 10
                written = total[1] + written
                digit_checks.append((ok == "ok") == (shown == total[1]))
            columns.append(good)
            sums.append(bool(lines) and int(lines[-1][3][0] + written) == a + b)
            copies.append(len(lines) == n and "".join(line[4] for line in lines)[::-1] == e["first"].zfill(n))
            found = re.search(r"^" + letter + r"\? (yes|no)$", text, re.MULTILINE)
        else:
            sums.append(text.startswith(f"{e['question']}{a + b:0{task.width}d}\n"))
            found = re.search(r"\n" + letter + r"=(\d+)\? (yes|no)", text)
            copies.append(bool(found) and found.group(1) == e["first"])
        checks.append(bool(found) and (found.group(found.lastindex) == "yes") == (int(e["first"]) == a + b))
    out = {"sum": float(np.mean(sums))}
    if task.reflection in ("check", "columns"):
        checks, same = np.asarray(checks), np.asarray(same)
        out.update(copy=float(np.mean(copies)), check=float(np.mean(checks)),
                   check_same_length=float(np.mean(checks[same])) if same.any() else float("nan"))
    if task.reflection == "columns":
        out.update(columns=float(np.mean(columns)),
                   digit_checks=float(np.mean(digit_checks)) if digit_checks else float("nan"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--judge", action="append", required=True, metavar="NAME=PATH", help="a judge checkpoint")
    ap.add_argument("--n", type=int, default=400, help="held-out pairs")
    ap.add_argument("--recipe", default="camel_sft", help="the config whose judging task the judges learned")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of the recipe (e.g. data.source.width=0), as on `jaxlm train`'s command line")
    ap.add_argument("--max-reflection-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    task = dataclasses.replace(load_config(args.recipe, args.set).data.source, revise_fraction=0.0)
    if not isinstance(task, SumJudging):
        raise SystemExit(f"{args.recipe}'s data.source is {type(task).__name__}, not SumJudging")
    examples = [task.example(i, "eval") for i in range(args.n)]
    labels = np.asarray([e["answer"] for e in examples])
    cols = {k: [e[k] for e in examples] for k in ("question", "first", "second")}
    results, per_pair = {}, {}
    for spec in args.judge:
        name, path = spec.split("=", 1)
        model = jaxlm.load_model(path)
        always = gated_judge(model, cols["question"], cols["first"], cols["second"], tau=float("inf"),
                             max_reflection_tokens=args.max_reflection_tokens)
        qs = (0.25, 0.5, 0.75, 0.9)
        taus = [0.0] + [float(np.quantile(always.margin, q)) for q in qs] + [float("inf")]
        curve = gate_curve(always, labels, taus)
        full = curve[-1]
        enough = [c for c in curve if c["accuracy"] >= full["accuracy"] - 0.01]
        best = min(enough, key=lambda c: c["tokens"])
        after_right, right_texts = forced(model, examples, labels, task.template, args.max_reflection_tokens)
        after_wrong, wrong_texts = forced(model, examples, 1 - labels, task.template, args.max_reflection_tokens)
        checks = reflection_checks(task, examples * 2, right_texts + wrong_texts)
        per_pair[name] = {"always reflect": always.final == labels, "after a wrong verdict": after_wrong}
        after_right, after_wrong = float(after_right.mean()), float(after_wrong.mean())
        results[name] = {"curve": curve, "gated": best, "after_right": after_right, "after_wrong": after_wrong,
                         "reflections": checks}
        print(f"{name}: margin quantiles {', '.join(f'{q}: {t:.3f}' for q, t in zip(qs, taus[1:-1]))}")
        for label, c in zip(["never"] + [f"q{q}" for q in qs] + ["always"], curve):
            print(f"  tau {label:7s} {c['tau']:8.3f}  accuracy {c['accuracy']:.3f}  tokens {c['tokens']:6.2f}  "
                  f"reflect {c['reflect_rate']:.2f}")
        print(f"  fewest tokens within 1 point of always-reflect: tau {best['tau']:.3f}, accuracy "
              f"{best['accuracy']:.3f}, {best['tokens']:.2f} tokens vs {full['tokens']:.2f} "
              f"({best['tokens'] / full['tokens']:.2f}x)")
        print(f"  final verdict after a forced right / wrong initial verdict: {after_right:.3f} / {after_wrong:.3f}")
        print("  reflections after a forced verdict, share right: "
              + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in checks.items()))
    first, *others = per_pair
    for name in others:  # paired on the same held-out pairs: the exact sign test on the discordant ones
        for setting, right in per_pair[name].items():
            c = paired_comparison(per_pair[first][setting], right)
            results[name].setdefault("paired", {})[setting] = dataclasses.asdict(c)
            print(f"{name} vs {first}, {setting}: {c.fixed} pairs fixed, {c.broken} broken, sign test p = "
                  f"{c.p_value:.2g}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
