"""Evaluation: held-out loss, and task accuracy by greedy decoding + the task's verifier."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

import jaxlm


@dataclasses.dataclass
class AccuracyResult:
    accuracy: float
    n: int
    samples: list[dict[str, Any]]  # prompt, completion, reference, correct


def task_accuracy(
    model,
    examples: list[dict[str, Any]],
    verify: Callable[[dict, str], float],
    *,
    tokenizer,
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> AccuracyResult:
    """Greedy completions of each example's prompt, scored by ``verify``."""
    samples, scores = [], []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        out = jaxlm.generate(
            model, [e["prompt"] for e in chunk], max_new_tokens=max_new_tokens, temperature=0,
            tokenizer=tokenizer,
        )
        for e, text in zip(chunk, out.texts):
            score = float(verify(e, text))
            scores.append(score)
            samples.append({"prompt": e["prompt"], "completion": text,
                            "reference": e.get("completion"), "correct": score})
    return AccuracyResult(accuracy=float(np.mean(scores)) if scores else float("nan"), n=len(scores), samples=samples)


def heldout_metrics(eval_fn, params, batches, place=lambda b: b) -> dict[str, float]:
    """Held-out metrics from the sums `trainers.step.make_eval_loss` returns, divided once:
    ``loss`` (nats/token), ``exact_match`` (greedy exact match under teacher forcing), and
    with attention statistics ``attn_entropy`` (nats) and ``first_token_mass``."""
    sums: dict[str, float] = {}
    for b in batches:
        for k, v in jax.device_get(eval_fn(params, place(b))).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    out = {"loss": sums["loss"] / max(sums["tokens"], 1.0), "exact_match": sums["exact"] / max(sums["rows"], 1.0)}
    if "entropy" in sums:
        out["attn_entropy"] = sums["entropy"] / max(sums["queries"], 1.0)
        out["first_token_mass"] = sums["first_mass"] / max(sums["queries"], 1.0)
    return out
