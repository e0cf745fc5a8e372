"""Task accuracy: greedy completions of held-out prompts, scored by the task's verifier."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from jaxlm.inference.diffusion import diffusion_generate
from jaxlm.inference.sampler import generate


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
    progress: Callable[[int], Any] | None = None,
    generate_kwargs: dict[str, Any] | None = None,
) -> AccuracyResult:
    """Greedy completions of each example's ``prompt``, scored by ``verify(example, text)``
    (1.0 correct). ``progress(n)`` is called after each batch of ``n`` examples;
    ``generate_kwargs`` go to `generate` (e.g. ``early_exit=``, ``draft=``), or for a
    ``mode="diffusion"`` model to `diffusion_generate` (``gen_length = max_new_tokens``;
    e.g. ``steps=``, ``block_length=``, ``cache=``; default one token per step)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be a positive int")
    if not examples:
        raise ValueError("examples is empty: accuracy needs at least one held-out example")
    samples, scores = [], []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        prompts = [e["prompt"] for e in chunk]
        if getattr(model.config, "mode", "causal") == "diffusion":
            kw = dict(generate_kwargs or {})
            if "steps" not in kw and kw.get("threshold") is None and kw.get("slow_fast") is None:
                kw["steps"] = max_new_tokens  # the default only: a user's steps reach the sampler
            out = diffusion_generate(model, prompts, gen_length=max_new_tokens, tokenizer=tokenizer, **kw)
        else:
            out = generate(
                model, prompts, max_new_tokens=max_new_tokens, temperature=0,
                tokenizer=tokenizer, **(generate_kwargs or {}),
            )
        for e, text in zip(chunk, out.texts):
            score = float(verify(e, text))
            scores.append(score)
            samples.append({"prompt": e["prompt"], "completion": text,
                            "reference": e.get("completion"), "correct": score})
        if progress is not None:
            progress(len(chunk))
    return AccuracyResult(accuracy=float(np.mean(scores)), n=len(scores), samples=samples)


def task_texts(task, n: int, split: str = "train") -> list[str]:
    """``n`` prompt + completion texts of a task's ``split``: calibration data for a
    weight-space method (quantization, compression, editing)."""
    return [e["prompt"] + e["completion"] for e in (task.example(i, split) for i in range(n))]


def heldout_accuracy(model, task, n: int, *, max_new_tokens: int = 8, batch_size: int = 64,
                     desc: str | None = None, progress: bool = False) -> AccuracyResult:
    """Greedy exact-match accuracy of ``model`` on the first ``n`` held-out examples of a
    task (a tqdm bar titled ``desc`` with ``progress``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n={n!r} is invalid: accuracy needs at least one held-out example")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the model has no tokenizer; cannot encode the task's prompts")
    held = [task.example(i, "eval") for i in range(n)]
    with tqdm(total=n, desc=desc or "accuracy", unit="ex", disable=not progress, leave=False) as bar:
        return task_accuracy(model, held, task.verify, tokenizer=model.tokenizer, max_new_tokens=max_new_tokens,
                             batch_size=batch_size, progress=bar.update)
