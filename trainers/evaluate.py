"""Held-out metrics of a training run from the sums of `trainers.step.make_eval_loss` (task
accuracy by greedy decoding is `jaxlm.eval.task_accuracy`)."""

from __future__ import annotations

import jax


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
