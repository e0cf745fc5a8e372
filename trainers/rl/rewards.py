"""Rewards (``REWARDS``): ``reward(prompts, completions, **columns) -> float array [n]``.

Columns always include ``examples`` (each rollout's task example dict), ``group`` (its
prompt's index, ``[n]`` int), ``num_generations``, ``task`` and ``config`` (the
`GRPOConfig`, for a reward's own settings); a reward may return NaN
for "no opinion" (skipped when rewards are combined with `combine_rewards`, as TRL does).
Method-specific rewards (CCC-GRPO's swap-in CCC, counterfactual bonuses) register here
from their own modules.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jaxlm.registry import Registry

REWARDS: Registry = Registry("reward")


def example_completion(example: dict, completion: str) -> str:
    """What the verifier scores: a PrefixRL example's prefix (part of the prompt) counts as
    the start of the solution."""
    return example.get("prefix", "") + completion


def question_and_answer(prompts, completions, examples) -> tuple[list[str], list[str]]:
    """Each rollout as (question, answer) for a reward that reads both: an example's prefix
    (PrefixRL's given start of the solution, CAMEL's forced verdict and reflection marker)
    belongs to the answer whether or not the collector's prompt text holds it."""
    prompts, completions = list(prompts), list(completions)
    if examples is None:
        return prompts, completions
    questions = [p[: len(p) - len(e["prefix"])] if e.get("prefix") and p.endswith(e["prefix"]) else p
                 for e, p in zip(examples, prompts, strict=True)]
    return questions, [example_completion(e, c) for e, c in zip(examples, completions, strict=True)]


@REWARDS.register("verifier")
def verifier_reward(prompts, completions, *, examples, task, **_) -> np.ndarray:
    """1 if the task's verifier accepts the completion, else 0."""
    return np.asarray(
        [task.verify(e, example_completion(e, c)) for e, c in zip(examples, completions)], np.float32
    )


@REWARDS.register("length_penalty")
def length_penalty(prompts, completions, **_) -> np.ndarray:
    """``-len(completion) / 100`` (characters): a small shaping term, for tests and examples."""
    return -np.asarray([len(c) for c in completions], np.float32) / 100.0


def combine_rewards(fns: Sequence[Callable], weights: Sequence[float], prompts, completions, **columns):
    """``sum_k w_k r_k`` with NaN entries skipped (all-NaN -> NaN: "no opinion") and the
    per-function values. An infinite reward is an error naming the reward function (it would
    turn its whole group's advantages into NaN); a function of weight 0 does not count."""
    values = []
    for f in fns:
        v = np.asarray(f(prompts, completions, **columns), np.float32)
        if v.shape != (len(completions),):  # a [B, G] array broadcast against the weights mis-weighted
            name = getattr(f, "__name__", repr(f))
            raise ValueError(f"reward function {name!r} returned shape {v.shape}: a reward is one number per "
                             f"rollout, shape ({len(completions)},)")
        values.append(v)
    parts = np.stack(values)
    bad = np.argwhere(np.isinf(parts))
    if bad.size:
        k, i = (int(v) for v in bad[0])
        name = getattr(fns[k], "__name__", repr(fns[k]))
        raise ValueError(f"reward function {name!r} returned {float(parts[k, i])} for rollout {i}: rewards must be "
                         "finite numbers (NaN for no opinion)")
    w = np.asarray(weights, np.float32)[:, None]
    silent = np.isnan(parts) | (w == 0)  # no opinion, or a function kept for its metric only
    total = np.where(silent, 0.0, w * parts).sum(0)
    total = np.where(silent.all(0), np.nan, total)
    return total, parts
