"""CAMEL's confidence-gated judge (Zhu et al. 2026, arXiv 2602.20670; method card B.7).

The judge first emits one verdict token ``v in {A, B}``; its confidence is the verdict
log-prob margin ``c = |log p(A | ctx) - log p(B | ctx)|``. If ``c >= tau`` the verdict is
final at the cost of one token. Otherwise the judge continues after ``v``: it writes a
reflection and a final verdict (``template.final`` followed by a verdict letter); the
final verdict replaces the initial one (a reflection without a readable final verdict keeps
the initial one). ``tau = 0`` never reflects, ``tau = inf`` always does; the
accuracy-vs-tokens curve comes from sweeping ``tau`` over one always-reflect run
(`gate_curve`), since the reflection of a row does not depend on ``tau``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from jaxlm.eval.judge import JudgeTemplate, pairwise_prompts
from jaxlm.eval.scoring import candidate_logprobs, single_token_id
from jaxlm.inference.sampler import generate


@dataclasses.dataclass(frozen=True)
class CamelTemplate:
    """The pairwise judging prompt and verdict letters, the text between the initial verdict
    and the reflection, and the marker before the final verdict."""

    judge: JudgeTemplate = JudgeTemplate()
    reflect: str = "\nWhy: "
    final: str = "Final: "


@dataclasses.dataclass(frozen=True)
class GatedJudgment:
    """Per pair: ``initial`` and ``final`` verdicts (0 = A, 1 = B), the ``margin``, whether it
    ``reflected``, the tokens it generated (1 + the reflection's), and the reflection text."""

    initial: np.ndarray
    final: np.ndarray
    margin: np.ndarray
    reflected: np.ndarray
    tokens: np.ndarray
    reflections: list[str]


def final_verdict(text: str, template: CamelTemplate) -> int | None:
    """The verdict after the last ``template.final`` in ``text`` (None when there is none); the
    letter must end there (``Final: A0`` names no verdict)."""
    letters = re.escape(template.judge.first) + "|" + re.escape(template.judge.second)
    found = re.findall(re.escape(template.final) + "(" + letters + r")(?!\w)", text)
    if not found:
        return None
    return 0 if found[-1] == template.judge.first else 1


def gated_judge(model, questions: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str], *,
                tau: float, template: CamelTemplate = CamelTemplate(), max_reflection_tokens: int = 64,
                batch_size: int = 32) -> GatedJudgment:
    """Judge each pair with the gate at ``tau``: one batched scoring call for the verdicts,
    then one greedy `jaxlm.generate` call for the rows whose margin is below ``tau``."""
    if not tau >= 0:
        raise ValueError(f"tau={tau} must be >= 0 (inf: always reflect)")
    if not (len(questions) == len(responses_a) == len(responses_b)):
        raise ValueError(f"judge inputs differ in length: {len(questions)}, {len(responses_a)}, {len(responses_b)}")
    tok = model.tokenizer
    jt = template.judge
    ids = [single_token_id(tok, jt.first), single_token_id(tok, jt.second)]
    prompts = pairwise_prompts(questions, responses_a, responses_b, jt)
    n = len(prompts)
    if n == 0:
        z = np.zeros(0, np.int32)
        return GatedJudgment(z, z, np.zeros(0), np.zeros(0, bool), z, [])
    logp = candidate_logprobs(model, prompts, ids, batch_size=batch_size).astype(np.float64)
    initial = (logp[:, 1] > logp[:, 0]).astype(np.int32)  # ties: A
    margin = np.abs(logp[:, 0] - logp[:, 1])
    reflected = margin < tau
    final = initial.copy()
    tokens = np.ones(n, np.int32)
    reflections = [""] * n
    rows = np.flatnonzero(reflected)
    if rows.size:
        letters = [jt.first, jt.second]
        continued = [prompts[i] + letters[initial[i]] + template.reflect for i in rows]
        out = generate(model, continued, max_new_tokens=max_reflection_tokens, temperature=0.0)
        lengths = np.asarray(out.lengths)
        for r, i in enumerate(rows):
            text = out.texts[r]
            reflections[i] = text
            tokens[i] = 1 + int(lengths[r])
            v = final_verdict(text, template)
            if v is not None:
                final[i] = v
    return GatedJudgment(initial, final, margin, reflected, tokens, reflections)


def gate_curve(always: GatedJudgment, labels: Sequence[int], taus: Sequence[float]) -> list[dict[str, float]]:
    """Accuracy and mean generated tokens at each ``tau``, from one always-reflect run
    (``tau = inf``): a row reflects at ``tau`` iff its margin is below ``tau``."""
    if not np.all(always.reflected):
        raise ValueError("gate_curve needs an always-reflect run (gated_judge(..., tau=float('inf')))")
    labels = np.asarray(labels)
    if labels.shape != always.initial.shape:
        raise ValueError(f"labels {labels.shape} do not match the {always.initial.shape[0]} judgments")
    curve = []
    for tau in taus:
        use = always.margin < tau
        verdict = np.where(use, always.final, always.initial)
        tokens = np.where(use, always.tokens, 1)
        curve.append({"tau": float(tau), "accuracy": float(np.mean(verdict == labels)),
                      "tokens": float(np.mean(tokens)), "reflect_rate": float(np.mean(use))})
    return curve
