"""pass@k: the probability that at least one of k sampled completions of a problem is correct.

From ``n >= k`` samples of which ``c`` are correct, the unbiased estimate is
``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1), averaged over problems. It is the metric RL-after-SFT comparisons report (e.g.
PEAR's pass@8), because it sees the diversity that greedy accuracy hides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlm.inference.diffusion import diffusion_generate
from jaxlm.inference.sampler import generate


def pass_at_k(num_samples, num_correct, k: int) -> np.ndarray:
    """Per-problem unbiased pass@k, ``1 - C(n - c, k) / C(n, k)`` (float64, the shape of the
    broadcast inputs). The ratio is taken as ``prod_{i < k} (n - c - i) / (n - i)``, which
    stays exact in floating point for any n (no factorials) and is 0 once ``n - c < k``."""
    n = np.asarray(num_samples)
    c = np.asarray(num_correct)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r} is invalid: must be an int >= 1")
    for name, v in (("num_samples", n), ("num_correct", c)):
        if v.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers (got dtype {v.dtype})")
    n, c = np.broadcast_arrays(n, c)
    if np.any(n < k):
        raise ValueError(f"num_samples={int(n.min())} < k={k}: pass@k needs at least k samples per problem")
    if np.any(c < 0) or np.any(c > n):
        raise ValueError("num_correct must be in [0, num_samples] for every problem")
    i = np.arange(k, dtype=np.float64)
    n64, c64 = n[..., None].astype(np.float64), c[..., None].astype(np.float64)
    all_wrong = np.prod(np.clip(n64 - c64 - i, 0.0, None) / (n64 - i), axis=-1)
    return 1.0 - all_wrong


@dataclasses.dataclass
class PassAtKResult:
    pass_at_k: dict[int, float]
    """k -> mean pass@k over the problems."""
    n: int
    """Problems."""
    samples_per_problem: int
    correct: np.ndarray
    """``[n]`` correct samples of each problem."""
    samples: list[dict[str, Any]]
    """prompt, completions, correct (one entry per problem)."""


def heldout_pass_at_k(model, task, n: int, ks: Sequence[int] = (1, 8), *, samples_per_problem: int | None = None,
                      temperature: float = 1.0, top_p: float | None = None, max_new_tokens: int = 8,
                      batch_size: int = 256, seed: int = 0) -> PassAtKResult:
    """pass@k of ``model`` on the first ``n`` held-out examples of ``task``: each prompt is
    sampled ``samples_per_problem`` times (default ``max(ks)``) at ``temperature`` / ``top_p``,
    every completion scored by ``task.verify`` (correct when it returns 1.0), and `pass_at_k`
    averaged for each k. The draws are fixed by ``seed`` and ``batch_size``. A masked diffusion
    model (``mode="diffusion"``) samples with `diffusion_generate`, one token per step
    (``gen_length = steps = max_new_tokens``, Gumbel-max at ``temperature``; no ``top_p``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"n={n!r} is invalid: pass@k needs at least one held-out example")
    ks = tuple(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks={ks!r} is invalid: must be ints >= 1")
    m = max(ks) if samples_per_problem is None else samples_per_problem
    if isinstance(m, bool) or not isinstance(m, int) or m < max(ks):
        raise ValueError(f"samples_per_problem={m!r} is invalid: must be an int >= max(ks)={max(ks)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be a positive int")
    if getattr(model, "tokenizer", None) is None:
        raise ValueError("the model has no tokenizer; cannot encode the task's prompts")
    diffusion = getattr(model.config, "mode", "causal") == "diffusion"
    if diffusion and top_p is not None:
        raise ValueError(f"top_p={top_p!r} is invalid for a masked diffusion model: it samples by Gumbel-max at "
                         "temperature only (leave top_p=None)")
    held = [task.example(i, "eval") for i in range(n)]
    rows = [(j, e) for j, e in enumerate(held) for _ in range(m)]  # problem j's samples are rows j*m .. j*m+m-1
    texts: list[str] = []
    for start in range(0, len(rows), batch_size):
        prompts = [e["prompt"] for _, e in rows[start:start + batch_size]]
        key = seed * 1_000_003 + start
        if diffusion:
            texts += diffusion_generate(model, prompts, gen_length=max_new_tokens, steps=max_new_tokens,
                                        temperature=temperature, rng=key, tokenizer=model.tokenizer).texts
        else:
            texts += generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              rng=key).texts
    scores = np.array([float(task.verify(e, t)) for (_, e), t in zip(rows, texts)]).reshape(n, m)
    correct = (scores >= 1.0).sum(axis=1)
    return PassAtKResult(
        pass_at_k={k: float(pass_at_k(np.full(n, m), correct, k).mean()) for k in ks}, n=n,
        samples_per_problem=m, correct=correct,
        samples=[{"prompt": e["prompt"], "completions": texts[j * m:(j + 1) * m], "correct": int(correct[j])}
                 for j, e in enumerate(held)])
