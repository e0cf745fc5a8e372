"""Evidence Drop in miniature: a small model trained on correct arithmetic chains scores
held-out traces, half of them with one planted wrong step (later steps continue correctly
from the wrong value, so the final answer is wrong). Detectors: the worst evidence drop
(`jaxlm.eval.evidence_drop`, step evidence = mean token log-prob) vs the mean sequence
log-prob (its negative as the hallucination score). Reported: AUROC of each for "the trace
holds a wrong step", AURC of selective answering, and how often the drop's step is the
planted one (chance = 1 / the number of steps).

    python bench/evidence_drop_claim.py --steps 1500
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import jaxlm
from jaxlm.eval.evidence_drop import evidence_drop
from jaxlm.eval.selective import aurc, auroc
from sft_rows import sft_on_rows

MODEL = jaxlm.ModelConfig.tiny(d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=160)
OPS = ("+", "-", "*")


def problem(rng: np.random.Generator, n_steps: int):
    start = int(rng.integers(2, 20))
    ops = []
    for _ in range(n_steps):
        op = OPS[int(rng.integers(3))]
        ops.append((op, int(rng.integers(2, 10)) if op == "*" else int(rng.integers(1, 30))))
    return start, ops


def trace(start: int, ops, plant: int | None = None, offset: int = 0) -> str:
    """Lines ``a op b = c``; at step ``plant`` the result is off by ``offset`` and later steps
    continue from it."""
    lines, value = [], start
    for k, (op, b) in enumerate(ops):
        new = value + b if op == "+" else value - b if op == "-" else value * b
        if k == plant:
            new += offset
        lines.append(f"{value}{op}{b}={new}")
        value = new
    return "\n".join(lines) + f"\nanswer {value}"


def prompt(start: int, ops) -> str:
    return "Q: " + str(start) + " " + " ".join(f"{op}{b}" for op, b in ops) + "\n"


def train_model(out: Path, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(30_000):
        s, ops = problem(rng, int(rng.integers(3, 6)))
        rows.append({"prompt": prompt(s, ops), "completion": trace(s, ops)})
    return sft_on_rows(out, rows, MODEL, steps=steps, seq_len=128)


def evaluate(model, n: int = 400, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    prompts, traces, wrong, planted, n_steps = [], [], [], [], []
    for i in range(n):
        k = int(rng.integers(4, 6))
        s, ops = problem(rng, k)
        bad = i % 2 == 1
        at = int(rng.integers(1, k)) if bad else None  # never the first step (it has no reference)
        offset = int(rng.choice([-3, -2, -1, 1, 2, 3, 10])) if bad else 0
        prompts.append(prompt(s, ops))
        traces.append(trace(s, ops, at, offset))
        wrong.append(bad)
        planted.append(-1 if at is None else at)
        n_steps.append(k + 1)  # + the answer line
    wrong, planted = np.asarray(wrong), np.asarray(planted)
    drop = evidence_drop(model, prompts, traces, evidence="logprob", batch_size=32)
    mean_lp = drop.mean_logprob
    hit = np.mean(drop.step[wrong] == planted[wrong])
    chance = np.mean(1.0 / (np.asarray(n_steps)[wrong] - 1))  # drops can fall on steps 1..T-1
    return {"traces": n, "auroc_evidence_drop": auroc(drop.score, wrong), "auroc_mean_logprob": auroc(-mean_lp, wrong),
            "aurc_evidence_drop": aurc(-drop.score, ~wrong), "aurc_mean_logprob": aurc(mean_lp, ~wrong),
            "localisation": float(hit), "localisation_chance": float(chance)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--traces", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        model = train_model(out, args.steps)
        result = evaluate(model, args.traces)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
