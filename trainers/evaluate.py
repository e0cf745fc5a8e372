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


def heldout_loss(eval_loss_fn, params, batches, place=lambda b: b) -> float:
    """Token-mean NLL over the eval batches (sums and counts, divided once)."""
    total = count = 0.0
    for b in batches:
        s, n = eval_loss_fn(params, place(b))
        total, count = total + float(jax.device_get(s)), count + float(jax.device_get(n))
    return total / max(count, 1.0)
