"""CCC-GRPO rewards for numeric regression (method card B.2; arXiv 2605.01402, "Injecting
Distributional Awareness into MLLMs via Reinforcement Learning for Deep Imbalanced Regression").

Lin's concordance correlation (population moments),
``CCC(p, y) = 2 cov(p, y) / (var p + var y + (mean p - mean y)^2)``, is a batch-level score
of correlation, scale and mean agreement together. Each prompt ``i`` of the batch has G
parsed predictions ``ŷ_ik`` (validity ``v_ik``); its anchor is the mean of its valid ones,
``ȳ_i``. Rollout ``(i, k)``'s reward is the batch CCC with its own prediction swapped in for
its group's anchor::

    p^(i,k) = (ȳ_1, ..., ȳ_{i-1}, ŷ_ik, ȳ_{i+1}, ..., ȳ_B),   r_ccc(i, k) = CCC(p^(i,k), y)

so the rollouts of a group share the rest of the batch and differ only by their own
prediction. The card computes it from the batch sums ``S1 = Σ ȳ_j``, ``S2 = Σ ȳ_j²``,
``Sxy = Σ ȳ_j y_j`` (``S2' = S2 - ȳ_i² + z²``, ..., exact algebra [INFERRED]); here the other
groups' moments are taken centred on their own mean (``m = n - 1`` anchors, mean ``μ_o``,
``M2 = Σ (ȳ_j - μ_o)²``, ``C = Σ (ȳ_j - μ_o)(y_j - μ_y)``) and ``z`` is merged in
(``var p = (M2 + m (z - μ_o)² / n) / n``), the same value without the cancellation of
``S2 - ȳ_i²`` when one anchor is huge (one wild answer of 1e12 gave the other rollouts of its
group CCCs above 1).

Choices the card marks [INFERRED], and what this module does:

- an invalid rollout (no number parses) gets ``r_min`` (``GRPOConfig.ccc_invalid_reward``,
  default -1, the worst CCC) instead of a CCC;
- a group with no valid rollout has no anchor: it leaves the batch (the CCC is over the
  groups that have one) and all its rollouts get ``r_min``;
- an undefined CCC (zero denominator: every prediction equals every target) counts as 1;
- the format-validity reward is a separate reward (``"format"``) whose weight is
  ``GRPOConfig.reward_weights`` (the card's λ_fmt).

``"neg_abs_error"`` is the point-wise baseline ``-min(|ŷ - y| / scale, 1)`` (``scale`` the
task's ``error_scale``, 1 if it has none; invalid: -1).

``"crps_loo"`` is the card's related set-level reward (B.2, "Distribution-Aware Reward", arXiv
2605.20740): the G valid answers of a group are an ensemble forecast ``S`` scored by the
empirical CRPS, ``CRPS(S, y) = mean_k |s_k - y| - 1/2 mean_jk |s_j - s_k|``, and each rollout
gets its leave-one-out credit ``(CRPS(S_-k, y) - CRPS(S, y)) / scale`` (``S_-k``: ``S``
without it): positive when the ensemble is better with it. [INFERRED] choices: an invalid
answer gets -1 and is not in ``S``; a group with a single valid answer has no leave-one-out
set, so that answer gets 0.
"""

from __future__ import annotations

import numpy as np

import jaxlm
from jaxlm.data.regression import parse_number
from trainers.rl.rewards import REWARDS, example_completion


def ccc(p, y) -> float:
    """Lin's concordance correlation coefficient of two vectors (population moments)."""
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    if p.shape != y.shape or p.ndim != 1 or p.size == 0:
        raise ValueError(f"ccc needs two non-empty vectors of one length, got {p.shape}, {y.shape}")
    shift = y.mean()  # CCC is invariant to one shift of both: centre for accuracy
    p, y = p - shift, y - shift
    mp, my = p.mean(), y.mean()
    cov = np.mean((p - mp) * (y - my))
    den = np.mean((p - mp) ** 2) + np.mean((y - my) ** 2) + (mp - my) ** 2
    if den > 0:
        return float(2.0 * cov / den)
    return 1.0 if den == 0 else float("nan")  # every value equal: 1; a non-finite value: NaN


def _check_groups(name: str, pred, valid, target) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pred [B, G]`` (float64), ``valid [B, G]`` (bool), ``target [B]`` (float64), or a
    ValueError naming ``name`` and the shapes."""
    pred, valid, target = np.asarray(pred, np.float64), np.asarray(valid, bool), np.asarray(target, np.float64)
    if pred.ndim != 2 or valid.shape != pred.shape or target.shape != pred.shape[:1]:
        raise ValueError(
            f"{name} needs pred [B, G], valid [B, G], target [B]; got {pred.shape}, {valid.shape}, {target.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(target))
    if bad.size:
        raise ValueError(f"{name}: target of group {int(bad[0])} is {float(target[bad[0]])}; targets must be finite numbers")
    bad = np.argwhere(valid & ~np.isfinite(pred))
    if bad.size:
        raise ValueError(f"{name}: valid prediction {tuple(int(i) for i in bad[0])} is {float(pred[tuple(bad[0])])}; "
                         "a non-finite prediction must be marked invalid")
    return pred, valid, target


def swap_in_ccc_rewards(pred, valid, target, *, invalid_reward: float = -1.0) -> np.ndarray:
    """``r[i, k] = CCC(p^(i,k), y)`` for predictions ``[B, G]`` (``valid [B, G]``; invalid
    entries may hold anything) and targets ``[B]``, vectorised from the batch sums (module
    docstring). Invalid rollouts and groups without a valid one get ``invalid_reward``."""
    pred, valid, target = _check_groups("swap_in_ccc_rewards", pred, valid, target)
    out = np.full(pred.shape, float(invalid_reward))
    active = valid.any(axis=1)  # groups with an anchor
    n = int(active.sum())
    if n == 0:
        return out
    count = np.maximum(valid.sum(axis=1), 1)
    anchor = np.where(valid, pred, 0.0).sum(axis=1) / count  # ȳ_i (unused for groups without one)
    mu_y = target[active].mean()
    dy = np.where(active, target - mu_y, 0.0)
    var_y = float((dy * dy).sum() / n)
    # row i: the other groups with an anchor (m of them), their centred moments
    others = active[None, :] & ~np.eye(len(target), dtype=bool)
    m = others.sum(axis=1).astype(np.float64)
    mu_o = np.where(others, anchor[None, :], 0.0).sum(axis=1) / np.maximum(m, 1.0)
    centred = np.where(others, anchor[None, :] - mu_o[:, None], 0.0)
    M2 = (centred * centred).sum(axis=1)
    C = (centred * dy[None, :]).sum(axis=1)
    dy_others = np.where(others, dy[None, :], 0.0).sum(axis=1)
    # merge each rollout's prediction z in for its group's anchor: [B, G]
    d = np.where(valid, pred, mu_o[:, None]) - mu_o[:, None]
    mu_p = mu_o[:, None] + d / n
    var_p = (M2[:, None] + d * d * m[:, None] / n) / n
    cov = (C[:, None] - (mu_p - mu_o[:, None]) * dy_others[:, None] + (mu_o[:, None] + d - mu_p) * dy[:, None]) / n
    den = var_p + var_y + (mu_p - mu_y) ** 2
    safe = np.where(den > 0, den, 1.0)
    value = np.where(den > 0, 2.0 * cov / safe, np.where(den == 0, 1.0, np.nan))
    return np.where(valid & active[:, None], value, out)


# -- registered rewards (flat lists of B*G rollouts) -------------------------------------
def _parse(task, completions, examples=None) -> np.ndarray:
    """The number each answer states; with ``examples``, the answer is a PrefixRL example's
    prefix + the completion (`example_completion`), as the verifier reads it."""
    parse = getattr(task, "parse", None) or parse_number
    if examples is not None:
        completions = [example_completion(e, c) for e, c in zip(examples, completions, strict=True)]
    values = [parse(c) for c in completions]
    return np.asarray([np.nan if v is None else v for v in values], np.float64)


def _grouped(group, num_generations: int, n: int) -> np.ndarray:
    """Indices ``[B, G]`` of the flat rollouts, group by group (stable within a group)."""
    group = np.asarray(group)
    if n % num_generations or group.shape != (n,):
        raise ValueError(f"{n} rollouts do not form groups of num_generations={num_generations}")
    order = np.argsort(group, kind="stable").reshape(-1, num_generations)
    if not (group[order] == group[order[:, :1]]).all() or len(np.unique(group)) != len(order):
        raise ValueError(f"each prompt must have num_generations={num_generations} rollouts")
    return order


def _targets(examples) -> np.ndarray:
    return np.asarray([float(e["target"]) for e in examples], np.float64)


@REWARDS.register("ccc")
def ccc_reward(prompts, completions, *, examples, group, num_generations, task, config=None,
               **_) -> np.ndarray:
    """Swap-in batch CCC per rollout (module docstring); ``config.ccc_invalid_reward`` for
    invalid parses (-1 without a config)."""
    r_min = -1.0 if config is None else float(getattr(config, "ccc_invalid_reward", -1.0))
    return _per_group(completions, examples, group, num_generations, task,
                      lambda p, v, y: swap_in_ccc_rewards(p, v, y, invalid_reward=r_min))


#: parsed answers are clipped to +-this before the rewards are computed
PRED_LIMIT = 1e15


def _per_group(completions, examples, group, num_generations, task, rewards_fn) -> np.ndarray:
    """Flat rollouts -> ``rewards_fn(pred [B, G], valid [B, G], target [B])`` -> flat float32
    rewards in the rollouts' order."""
    pred = _parse(task, completions, examples)
    idx = _grouped(group, num_generations, len(completions))
    target = _targets(examples)[idx[:, 0]]
    # |answers| <= PRED_LIMIT keeps the rewards, and their squares in GRPO's float32 group
    # statistics, finite (a parsed 60-digit answer overflowed float32); nan (invalid) stays nan
    grouped = np.clip(pred[idx], -PRED_LIMIT, PRED_LIMIT)
    out = np.empty(len(completions), np.float64)
    out[idx] = rewards_fn(np.nan_to_num(grouped), ~np.isnan(grouped), target)
    return out.astype(np.float32)


@REWARDS.register("format")
def format_reward(prompts, completions, *, task=None, examples=None, **_) -> np.ndarray:
    """1 if the completion (after a PrefixRL example's prefix) parses as a number (the
    task's ``parse``), else 0."""
    return (~np.isnan(_parse(task, completions, examples))).astype(np.float32)


@REWARDS.register("neg_abs_error")
def neg_abs_error_reward(prompts, completions, *, examples, task=None, **_) -> np.ndarray:
    """The point-wise baseline ``-min(|ŷ - y| / scale, 1)``; -1 for an invalid parse."""
    scale = float(getattr(task, "error_scale", 1.0))
    err = np.abs(_parse(task, completions, examples) - _targets(examples)) / scale
    return -np.minimum(np.nan_to_num(err, nan=1.0), 1.0).astype(np.float32)


def crps(samples, y) -> float:
    """Empirical CRPS of an ensemble ``samples [n]`` (n >= 1) against the scalar ``y``:
    ``mean_k |s_k - y| - 1/2 mean_jk |s_j - s_k|`` (Gneiting & Raftery 2007, eq. 21)."""
    s = np.asarray(samples, np.float64)
    if s.ndim != 1 or s.size == 0:
        raise ValueError(f"crps needs a non-empty vector of samples, got shape {s.shape}")
    return float(np.abs(s - y).mean() - 0.5 * np.abs(s[:, None] - s[None, :]).mean())


def loo_crps_rewards(pred, valid, target, *, scale: float = 1.0, invalid_reward: float = -1.0) -> np.ndarray:
    """``r[i, k] = (CRPS(S_i,-k, y_i) - CRPS(S_i, y_i)) / scale`` for predictions ``[B, G]``
    (``valid [B, G]``; ``S_i`` the group's valid answers, ``S_i,-k`` without ``k``), vectorised
    over groups with the pairwise sums: for ``n`` valid answers, ``A = sum_j |s_j - y|`` and
    ``D = sum_jl |s_j - s_l|``, ``CRPS(S) = A / n - D / (2 n^2)``, and removing ``k`` leaves
    ``A - a_k`` and ``D - 2 d_k`` (``d_k = sum_l |s_k - s_l|``) over ``n - 1``."""
    pred, valid, target = _check_groups("loo_crps_rewards", pred, valid, target)
    z = np.where(valid, pred, 0.0)
    n = valid.sum(axis=1).astype(np.float64)[:, None]  # [B, 1]
    a = np.where(valid, np.abs(z - target[:, None]), 0.0)  # |s_k - y|
    pair = valid[:, :, None] & valid[:, None, :]
    d = np.where(pair, np.abs(z[:, :, None] - z[:, None, :]), 0.0).sum(axis=2)  # d_k
    A, D = a.sum(axis=1, keepdims=True), d.sum(axis=1, keepdims=True)
    full = A / np.maximum(n, 1) - D / (2 * np.maximum(n, 1) ** 2)
    m = np.maximum(n - 1, 1)
    loo = (A - a) / m - (D - 2 * d) / (2 * m**2)
    value = np.where(n >= 2, (loo - full) / scale, 0.0)
    return np.where(valid, value, float(invalid_reward))


@REWARDS.register("crps_loo")
def crps_loo_reward(prompts, completions, *, examples, group, num_generations, task=None, **_) -> np.ndarray:
    """Leave-one-out CRPS credit per rollout within its group (module docstring); -1 invalid."""
    scale = float(getattr(task, "error_scale", 1.0))
    return _per_group(completions, examples, group, num_generations, task,
                      lambda p, v, y: loo_crps_rewards(p, v, y, scale=scale))


def evaluate_regression(model, task, examples, tokenizer=None, *, max_new_tokens: int = 4) -> dict[str, float]:
    """Greedy answers of ``model`` on held-out regression ``examples``: MAE per bucket
    (``mae_many`` / ``mae_medium`` / ``mae_few``; an unparsable answer counts as the task's
    whole range), the mean signed error of the few-shot bucket's parsed answers
    (``bias_few``: negative when the tail is pulled toward the head), the CCC of the parsed
    answers, the invalid rate, exact-match accuracy (the task's verifier) overall and on the
    few-shot bucket."""
    out = jaxlm.generate(model, [e["prompt"] for e in examples], max_new_tokens=max_new_tokens, temperature=0,
                         tokenizer=tokenizer)
    err: dict[str, list[float]] = {"many": [], "medium": [], "few": []}
    pred, target, signed_few = [], [], []
    correct = [task.verify(e, text) for e, text in zip(examples, out.texts)]
    for e, text in zip(examples, out.texts):
        p = task.parse(text)
        err[task.bucket(e)].append(task.error_scale if p is None else abs(p - e["target"]))
        if p is not None:
            if task.bucket(e) == "few":
                signed_few.append(p - e["target"])
            pred.append(p)
            target.append(e["target"])
    result = {f"mae_{b}": float(np.mean(v)) if v else float("nan") for b, v in err.items()}  # nan: empty bucket
    result["bias_few"] = float(np.mean(signed_few)) if signed_few else float("nan")
    result["ccc"] = ccc(pred, target) if pred else float("nan")  # nan: no answer parsed
    result["invalid"] = 1.0 - len(pred) / len(examples)
    result["accuracy"] = float(np.mean(correct))
    few = [c for c, e in zip(correct, examples) if task.bucket(e) == "few"]
    result["accuracy_few"] = float(np.mean(few)) if few else float("nan")
    return result
