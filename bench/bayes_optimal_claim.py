"""Bayes-optimal responses in miniature ("Task-Awareness Improves LLM Generations and
Uncertainty", method card §7.5): on a numeric task whose answers are uncertain, the centroid
of sampled answers under the task's loss beats greedy and beam decoding, and its Bayes risk
predicts errors.

Task: ``items`` questions ``"Q:xyz="`` (three letters), each with its own distribution over
the integers 10..99: a point mass, a symmetric spread, a right- or left-skewed one (the mode
is at one end) or a bimodal one (mode, far mode and a middle bump). Training rows are
independent draws from these distributions, so a model that fits its data learns each
question's answer distribution; the *answers* evaluated are new draws (the questions are the
training ones: what is tested is the decision rule given the model's distribution).

Decoders: greedy, beam search (``num_beams`` beams, its best hypothesis), and from ``samples``
samples at temperature 1 the Bayes-optimal answer under each loss (`jaxlm.eval.bayes_optimal`:
median for absolute error, mean for squared error, mode for 0-1) plus MBR under absolute
error; ``oracle_*`` are the true distributions' own median and mode (the floor). Each
answer is scored exactly against the question's true distribution:
``E|y_hat - Y|``, ``E(y_hat - Y)^2`` and ``P(y_hat = Y)``. An unparseable answer costs the
largest possible error (89, 89^2, wrong).

Uncertainty: for ``draws`` new answers per question, AUROC for "the answer is off by more
than ``tolerance``" and for "the answer is wrong" (exact), scored by the Bayes risk under
absolute error and under 0-1 loss, by the greedy answer's negative log-probability and by
the negative beam score.

    python bench/bayes_optimal_claim.py --steps 2500
"""

from __future__ import annotations

import argparse
import json
import string
import tempfile
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.eval.bayes_optimal import bayes_optimal, mbr, number_latent
from jaxlm.eval.selective import auroc
from sft_rows import sft_on_rows

MODEL = jaxlm.ModelConfig.tiny(d_model=96, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=64)
LOW, HIGH = 10, 99
SHAPES = ("point", "symmetric", "right_skewed", "left_skewed", "bimodal")


def distribution(shape: str, rng: np.random.Generator) -> dict[int, float]:
    """``{value: probability}`` on LOW..HIGH for one question."""
    if shape == "point":
        c = int(rng.integers(LOW, HIGH + 1))
        return {c: 1.0}
    if shape == "symmetric":
        c = int(rng.integers(LOW + 5, HIGH - 4))
        return {c + k: 1 / 9 for k in range(-4, 5)}
    if shape in ("right_skewed", "left_skewed"):  # the mode at one end, a long flat tail
        sign = 1 if shape == "right_skewed" else -1
        c = int(rng.integers(LOW, HIGH - 15)) if sign > 0 else int(rng.integers(LOW + 15, HIGH + 1))
        p = {c: 0.4}
        p.update({c + sign * k: 0.6 / 12 for k in range(3, 15)})
        return p
    c = int(rng.integers(LOW, HIGH - 30))  # bimodal: the mode, a middle bump, a far mode
    return {c: 0.45, c + 15: 0.2, c + 30: 0.35}


def make_items(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    codes = set()
    while len(codes) < n:
        codes.add("".join(rng.choice(list(string.ascii_lowercase), 3)))
    items = []
    for i, code in enumerate(sorted(codes)):
        shape = SHAPES[i % len(SHAPES)]
        p = distribution(shape, rng)
        values = np.array(sorted(p))
        items.append({"prompt": f"Q:{code}=", "shape": shape, "values": values,
                      "probs": np.array([p[v] for v in values])})
    return items


def draw(item: dict, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(item["values"], size=n, p=item["probs"])


def train_model(out: Path, items: list[dict], steps: int, rows_per_item: int, seed: int):
    rng = np.random.default_rng([seed, 1])
    rows = [{"prompt": it["prompt"], "completion": str(int(y))}
            for it in items for y in draw(it, rng, rows_per_item)]
    rng.shuffle(rows)
    return sft_on_rows(out, rows, MODEL, steps=steps, seq_len=64, lr=3e-3)


def expected_losses(answer: float | None, item: dict) -> dict:
    """Exact expected losses of ``answer`` under the question's true distribution."""
    if answer is None:
        return {"abs": float(HIGH - LOW), "sq": float(HIGH - LOW) ** 2, "exact": 0.0}
    v, p = item["values"], item["probs"]
    return {"abs": float(p @ np.abs(answer - v)), "sq": float(p @ (answer - v) ** 2),
            "exact": float(p[v == answer].sum())}


def evaluate(model, items: list[dict], *, samples: int, num_beams: int, draws: int, tolerance: int,
             seed: int) -> dict:
    prompts = [it["prompt"] for it in items]
    greedy = jaxlm.generate(model, prompts, max_new_tokens=4, temperature=0)
    beam = jaxlm.generate(model, prompts, max_new_tokens=4, num_beams=num_beams)
    sampled = jaxlm.generate(model, [p for p in prompts for _ in range(samples)], max_new_tokens=4,
                             temperature=1.0, rng=seed)
    greedy_lp = np.asarray(greedy.logprobs).sum(axis=1)
    answers = {name: [] for name in ("greedy", "beam", "bayes_abs", "bayes_sq", "bayes_01", "mbr_abs")}
    risk, risk01, parse_fail = [], [], 0
    for i, it in enumerate(items):
        answers["greedy"].append(number_latent(greedy.texts[i]))
        answers["beam"].append(number_latent(beam.texts[i]))
        latents = [number_latent(t) for t in sampled.texts[i * samples:(i + 1) * samples]]
        ok = [x for x in latents if x is not None]
        parse_fail += len(latents) - len(ok)
        if not ok:
            for name in ("bayes_abs", "bayes_sq", "bayes_01", "mbr_abs"):
                answers[name].append(None)
            risk.append(float(HIGH - LOW))
            risk01.append(1.0)
            continue
        by_abs = bayes_optimal(ok, "absolute")
        answers["bayes_abs"].append(by_abs.latent)
        answers["bayes_sq"].append(bayes_optimal(ok, "squared").latent)
        by_01 = bayes_optimal(ok, "zero_one")
        answers["bayes_01"].append(by_01.latent)
        risk01.append(by_01.risk)
        answers["mbr_abs"].append(mbr(ok, "absolute").latent)
        risk.append(by_abs.risk)
    for it in items:  # the true distribution's own centroids: the best any decoder can do
        answers.setdefault("oracle_abs", []).append(bayes_optimal(list(it["values"]), "absolute", weights=it["probs"]).latent)
        answers.setdefault("oracle_01", []).append(bayes_optimal(list(it["values"]), "zero_one", weights=it["probs"]).latent)
    table = {}
    for name, got in answers.items():
        losses = [expected_losses(a, it) for a, it in zip(got, items)]
        table[name] = {"abs_error": float(np.mean([x["abs"] for x in losses])),
                       "squared_error": float(np.mean([x["sq"] for x in losses])),
                       "exact_match": float(np.mean([x["exact"] for x in losses])),
                       "unparsed": int(sum(a is None for a in got))}
    # uncertainty: does a score rank the questions whose answer will be off?
    rng = np.random.default_rng([seed, 2])
    truth = np.stack([draw(it, rng, draws) for it in items])  # [items, draws]
    scores = {"bayes_risk_abs": np.asarray(risk), "bayes_risk_01": np.asarray(risk01), "neg_greedy_logprob": -greedy_lp,
              "neg_beam_score": -np.asarray(beam.beam_scores)}
    uncertainty = {}
    for name in ("bayes_abs", "greedy"):
        a = np.array([np.nan if x is None else x for x in answers[name]])[:, None]
        off = ~(np.abs(a - truth) <= tolerance)  # unparsed counts as off
        wrong = ~(a == truth)
        uncertainty[name] = {
            f"auroc_off_by_more_than_{tolerance}": {k: auroc(np.repeat(s, draws), off.ravel()) for k, s in scores.items()},
            "auroc_wrong": {k: auroc(np.repeat(s, draws), wrong.ravel()) for k, s in scores.items()},
        }
    per_shape = {}
    for shape in SHAPES:
        idx = [i for i, it in enumerate(items) if it["shape"] == shape]
        per_shape[shape] = {name: float(np.mean([expected_losses(answers[name][i], items[i])["abs"] for i in idx]))
                            for name in ("greedy", "beam", "bayes_abs")}
    return {"items": len(items), "samples": samples, "num_beams": num_beams, "sample_parse_failures": parse_fail,
            "decoders": table, "abs_error_by_shape": per_shape, "uncertainty": uncertainty}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--rows-per-item", type=int, default=300)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--draws", type=int, default=50)
    ap.add_argument("--tolerance", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    items = make_items(args.items, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = train_model(out, items, args.steps, args.rows_per_item, args.seed)
        result = evaluate(model, items, samples=args.samples, num_beams=args.num_beams, draws=args.draws,
                          tolerance=args.tolerance, seed=args.seed)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
