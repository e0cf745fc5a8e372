"""SCOPE in miniature: a small trained pairwise judge with a position bias, accepted by
SCOPE's conformal threshold on the bidirectional preference entropy (BPE) vs a naive
confidence threshold and vs the same conformal threshold on the one-order entropy.

The judge is trained (SFT) to say which of two sums is larger, ``Which is larger? A: 37+15
B: 24+31 -> B``, on labels where one in four is replaced by "A" whatever the truth (a judge
that favours the first position, as LLM judges do). On fresh pairs the judge is
asked in both orders; over ``--splits`` random 50/50 calibration/test splits, each rule
picks its threshold on the calibration half and is scored on the test half: realised error
among the accepted judgments (FDR) and coverage.

* naive: accept when the one-order confidence ``max(p, 1 - p) >= 1 - alpha``;
* one-order conformal: SCOPE's threshold on the one-order entropy;
* SCOPE: SCOPE's threshold on BPE, decision from the order-averaged preference.

    python bench/scope_claim.py --out runs/scope
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.eval.conformal import preference_entropy, scope_threshold, selective_report
from jaxlm.eval.judge import JudgeTemplate, judge_pairs
from sft_rows import sft_on_rows

TEMPLATE = JudgeTemplate(pairwise="Which is larger?{question} A: {first} B: {second} -> ")
MODEL = jaxlm.ModelConfig.tiny(max_seq_len=64)


def pairs(n: int, rng: np.random.Generator) -> tuple[list[str], list[str], np.ndarray]:
    """``n`` pairs of sums ``x+y`` with different values, and which is larger (0 = A)."""
    firsts, seconds, truth = [], [], []
    while len(truth) < n:
        a, b = rng.integers(10, 60, size=2), rng.integers(10, 60, size=2)
        if a.sum() == b.sum():
            continue
        firsts.append(f"{a[0]}+{a[1]}")
        seconds.append(f"{b[0]}+{b[1]}")
        truth.append(0 if a.sum() > b.sum() else 1)
    return firsts, seconds, np.asarray(truth)


def training_rows(n: int, bias: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for x, y, t in zip(*pairs(n, rng)):
        label = "AB"[t]
        if rng.uniform() < bias:
            label = "A"  # position-biased supervision
        rows.append({"prompt": TEMPLATE.pairwise.format(question="", first=x, second=y), "completion": label})
    return rows


def train_judge(out: Path, *, steps: int, bias: float, seed: int = 0):
    return sft_on_rows(out, training_rows(20_000, bias, seed), MODEL, steps=steps, seq_len=64, warmup_steps=30)


def evaluate(judge, *, n_test: int, alphas=(0.02, 0.05, 0.1), splits: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    firsts, seconds, truth = pairs(n_test, rng)
    j = judge_pairs(judge, [""] * truth.size, firsts, seconds, template=TEMPLATE, batch_size=64)
    one_decision = (j.p_ab < 0.5).astype(int)
    one_conf = np.maximum(j.p_ab, 1 - j.p_ab)
    one_entropy = preference_entropy(j.p_ab)
    err_one = (one_decision != truth).astype(int)
    err_bpe = (j.decision != truth).astype(int)
    out = {"pairs": int(truth.size), "splits": splits, "accuracy_one_order": float(1 - err_one.mean()),
           "accuracy_both_orders": float(1 - err_bpe.mean()), "mean_p_first": float(np.mean(j.p_ab))}
    for alpha in alphas:
        rules = {"naive": [], "one_order_conformal": [], "scope_bpe": []}
        for _ in range(splits):
            perm = rng.permutation(truth.size)
            cal, test = perm[: truth.size // 2], perm[truth.size // 2:]
            rules["naive"].append(selective_report(-one_conf[test], err_one[test], -(1 - alpha)))
            lam = scope_threshold(one_entropy[cal], err_one[cal], alpha)
            rules["one_order_conformal"].append(selective_report(one_entropy[test], err_one[test], lam))
            lam = scope_threshold(j.entropy[cal], err_bpe[cal], alpha)
            rules["scope_bpe"].append(selective_report(j.entropy[test], err_bpe[test], lam))
        summary = {k: {"fdr": float(np.mean([r.error_rate for r in v])),
                       "coverage": float(np.mean([r.coverage for r in v]))} for k, v in rules.items()}
        summary["scope_over_naive"] = summary["scope_bpe"]["coverage"] / max(summary["naive"]["coverage"], 1e-9)
        out[f"alpha={alpha}"] = summary
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--bias", type=float, default=0.25)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--splits", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        judge = train_judge(out, steps=args.steps, bias=args.bias)
        result = evaluate(judge, n_test=args.pairs, alphas=tuple(args.alphas), splits=args.splits)
    print(json.dumps(result, indent=None if args.json else 1))
    return result


if __name__ == "__main__":
    main()
