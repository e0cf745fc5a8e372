"""Counterfactual reward bonus (CofactGVR, seed abstract; method card B.4, [INFERRED] there).

A completion names its evidence, ``<evidence>SPAN</evidence>`` (or the task's own
``evidence_tags``), then answers. The factual
reward ``r_f`` is the verifier's. The *matched counterfactual* keeps the prompt and the
completion's structure and perturbs only the evidence span (each character replaced by a
different one of the same class, seeded per rollout: the text analogue of moving the box);
the policy is called again to score the answer under both evidences,
``s = exp(mean log pi(answer tokens | prompt, evidence))``, and

    bonus = max(0, s_factual - s_counterfactual)   only where r_f >= cf_quality

(the card's "high-quality factual rollouts"; ``cf_quality`` is a config field). Registered
as the reward ``counterfactual_bonus``; its weight in ``GRPOConfig.reward_weights`` is the
card's lambda_cf, so ``rewards=("verifier", "counterfactual_bonus")`` gives
``r = r_f + lambda_cf * 1[high quality] * bonus``.
"""

from __future__ import annotations

import re
import string

import jax.numpy as jnp
import numpy as np
from flax import nnx

from trainers.rl.rewards import REWARDS, example_completion
from trainers.rl.rollout import left_pad, positions_of, row_logprobs

#: The evidence markers of a task without its own ``evidence_tags``.
DEFAULT_TAGS = ("<evidence>", "</evidence>")


def _evidence_re(tags: tuple[str, str]) -> re.Pattern:
    return re.compile(re.escape(tags[0]) + "(.*?)" + re.escape(tags[1]), re.S)


def perturb_span(span: str, seed: int) -> str:
    """Each digit/letter replaced by a different one of its class (others kept)."""
    rng = np.random.default_rng(seed)
    out = []
    for ch in span:
        for pool in (string.digits, string.ascii_lowercase, string.ascii_uppercase):
            if ch in pool:
                choices = [c for c in pool if c != ch]
                ch = choices[int(rng.integers(len(choices)))]
                break
        out.append(ch)
    return "".join(out)


def split_evidence(completion: str, tags: tuple[str, str] = DEFAULT_TAGS) -> tuple[str, str] | None:
    """``(context up to and including the closing marker, answer after it)``, or None; ``tags``:
    the ``(open, close)`` markers around the evidence."""
    m = _evidence_re(tags).search(completion)
    if m is None or not completion[m.end():].strip():
        return None
    return completion[: m.end()], completion[m.end():]


def answer_scores(graphdef, params, tokenizer, contexts: list[str | list[int]], answers: list[str]) -> np.ndarray:
    """``exp(mean log pi(answer | context))`` per pair, in one batched forward. A context is
    text (encoded with BOS) or token ids (used as they are)."""
    model = nnx.merge(graphdef, params)
    ctx = [list(c) if not isinstance(c, str) else tokenizer.encode(c, add_bos=True) for c in contexts]
    ans = [tokenizer.encode(a) for a in answers]
    seqs = [c + a for c, a in zip(ctx, ans)]
    width = max(map(len, seqs))
    tokens, attend = left_pad(seqs, width, tokenizer.pad_id)
    logp = np.asarray(row_logprobs(model, {
        "tokens": jnp.asarray(tokens), "attend": jnp.asarray(attend), "positions": jnp.asarray(positions_of(attend)),
    }))
    scores = np.zeros(len(seqs))
    for i, a in enumerate(ans):
        scores[i] = np.exp(logp[i, width - len(a):].mean()) if a else 0.0
    return scores


@REWARDS.register("counterfactual_bonus")
def counterfactual_bonus(prompts, completions, *, examples, task, policy, tokenizer, config=None, prompt_ids=None,
                         **_) -> np.ndarray:
    quality = getattr(config, "cf_quality", 1.0)
    tags = getattr(task, "evidence_tags", DEFAULT_TAGS)
    bonus = np.zeros(len(completions), np.float32)
    todo = []
    for i, (p, c, e) in enumerate(zip(prompts, completions, examples)):
        parts = split_evidence(c, tags)
        if parts is None or task.verify(e, example_completion(e, c)) < quality:
            continue
        context, answer = parts
        m = _evidence_re(tags).search(context)
        cf_context = context[: m.start(1)] + perturb_span(m.group(1), seed=i) + context[m.end(1):]
        if prompt_ids is not None:  # the prompt's own ids (a chat template may write BOS itself)
            ids = list(prompt_ids[i])
            todo.append((i, ids + tokenizer.encode(context), ids + tokenizer.encode(cf_context), answer))
        else:
            todo.append((i, p + context, p + cf_context, answer))
    if todo:
        graphdef, params = policy
        idx, fac, cf, ans = zip(*todo)
        s = answer_scores(graphdef, params, tokenizer, list(fac) + list(cf), list(ans) * 2)
        n = len(todo)
        bonus[list(idx)] = np.maximum(0.0, s[:n] - s[n:])
    return bonus
