"""LLM-as-a-judge from verdict-token probabilities.

Pairwise: the judge reads (question, first, second) through `JudgeTemplate.pairwise` and its
next-token distribution over the two verdict tokens, renormalised, gives
``p_ab = P(first is better)``. Asked again with the responses swapped it gives ``p_ba``;
both orders run in one batched call. The order-debiased preference is
``p = (p_ab + (1 - p_ba)) / 2`` (SCOPE's bidirectional averaging, Badshah et al. 2026;
method card §7.1 [INFERRED]), the decision is A when ``p >= 1/2``, and its binary entropy is
the bidirectional preference entropy (BPE, `jaxlm.eval.conformal.preference_entropy`).
The verdict margin ``|log p(A) - log p(B)|`` in the presented order is CAMEL's confidence.
The two orders share their beginning (instructions, question, "Answer A: "), which is run
once (`jaxlm.eval.scoring.branched_candidate_logprobs`).

Pointwise: ``P(yes)`` over {yes, no} after `JudgeTemplate.pointwise` (a correctness model's
confidence, as GCM reads it).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Sequence

import numpy as np

from jaxlm.eval.conformal import preference_entropy
from jaxlm.eval.scoring import branched_candidate_logprobs, candidate_logprobs, single_token_id


@dataclasses.dataclass(frozen=True)
class JudgeTemplate:
    """Prompt formats (``str.format`` fields named below) and the one-token verdict strings."""

    pairwise: str = "Question: {question}\nAnswer A: {first}\nAnswer B: {second}\nBetter: "
    pointwise: str = "Question: {question}\nAnswer: {response}\nCorrect: "
    first: str = "A"
    second: str = "B"
    yes: str = "Y"
    no: str = "N"

    def __post_init__(self):
        for name, fields in (("pairwise", ("question", "first", "second")),
                             ("pointwise", ("question", "response"))):
            text = getattr(self, name)
            try:
                used = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
            except ValueError as e:  # a lone brace
                raise ValueError(f"JudgeTemplate.{name}: {e} (write a literal brace as {{{{ or }}}})") from None
            missing = [f"{{{f}}}" for f in fields if f not in used]
            if missing:
                raise ValueError(f"JudgeTemplate.{name} lacks the field(s) {missing}")
            unknown = sorted({f for f in used if f not in fields})
            if unknown:
                raise ValueError(f"JudgeTemplate.{name} has field(s) {['{' + f + '}' for f in unknown]} other than "
                                 f"{['{' + f + '}' for f in fields]} (write a literal brace as {{{{ or }}}})")
        if self.first == self.second or self.yes == self.no:
            raise ValueError("JudgeTemplate's two verdicts must differ (first/second, yes/no)")


@dataclasses.dataclass(frozen=True)
class PairwiseJudgment:
    """Per pair: ``p_ab`` P(A better | A shown first), ``p_ba`` P(B better | B shown first),
    ``p`` the debiased P(A better), ``decision`` 0 = A / 1 = B, ``entropy`` the preference
    entropy of ``p`` (nats), ``margin`` the verdict log-prob margin in the A-first order."""

    p_ab: np.ndarray
    p_ba: np.ndarray
    p: np.ndarray
    decision: np.ndarray
    entropy: np.ndarray
    margin: np.ndarray


@dataclasses.dataclass(frozen=True)
class PointwiseJudgment:
    """Per item: ``p_yes`` = P(yes) over {yes, no}, ``margin`` = ``|log p(yes) - log p(no)|``."""

    p_yes: np.ndarray
    margin: np.ndarray


def _two_way(logp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P(first of two candidates) renormalised over the pair, and the log-prob margin."""
    diff = logp[:, 0].astype(np.float64) - logp[:, 1]
    return 1.0 / (1.0 + np.exp(-diff)), np.abs(diff)


def _same_length(**columns) -> int:
    sizes = {k: len(v) for k, v in columns.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"judge inputs differ in length: {sizes}")
    return next(iter(sizes.values()))


def pairwise_prompts(questions, firsts, seconds, template: JudgeTemplate = JudgeTemplate()) -> list[str]:
    return [template.pairwise.format(question=q, first=a, second=b) for q, a, b in zip(questions, firsts, seconds)]


def judge_pairs(model, questions: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str], *,
                template: JudgeTemplate = JudgeTemplate(), both_orders: bool = True, batch_size: int = 32
                ) -> PairwiseJudgment:
    """Judge each (question, A, B). With ``both_orders`` the A-first and B-first prompts of
    every pair go through one batched scoring call, their shared prefix computed once;
    without it only A-first is asked and
    ``p = p_ab`` (``p_ba`` is ``1 - p_ab``, the order-consistent reading)."""
    n = _same_length(questions=questions, responses_a=responses_a, responses_b=responses_b)
    tok = model.tokenizer
    verdicts = [single_token_id(tok, template.first), single_token_id(tok, template.second)]
    if n == 0:
        empty = np.zeros(0)
        return PairwiseJudgment(empty, empty, empty, np.zeros(0, np.int32), empty, empty)
    prompts = pairwise_prompts(questions, responses_a, responses_b, template)
    if both_orders:
        swapped = pairwise_prompts(questions, responses_b, responses_a, template)
        logp = branched_candidate_logprobs(model, list(zip(prompts, swapped)), verdicts, batch_size=batch_size)
        p_ab, margin = _two_way(logp[:, 0])
        p_ba = _two_way(logp[:, 1])[0]
    else:
        p_ab, margin = _two_way(candidate_logprobs(model, prompts, verdicts, batch_size=batch_size))
        p_ba = 1.0 - p_ab
    p = 0.5 * (p_ab + (1.0 - p_ba))
    decision = (p < 0.5).astype(np.int32)
    return PairwiseJudgment(p_ab, p_ba, p, decision, preference_entropy(p), margin)


def judge_points(model, questions: Sequence[str], responses: Sequence[str], *,
                 template: JudgeTemplate = JudgeTemplate(), batch_size: int = 32) -> PointwiseJudgment:
    """``P(yes)`` for each (question, response) from one batched scoring call."""
    n = _same_length(questions=questions, responses=responses)
    if n == 0:
        return PointwiseJudgment(np.zeros(0), np.zeros(0))
    tok = model.tokenizer
    ids = [single_token_id(tok, template.yes), single_token_id(tok, template.no)]
    prompts = [template.pointwise.format(question=q, response=r) for q, r in zip(questions, responses)]
    p_yes, margin = _two_way(candidate_logprobs(model, prompts, ids, batch_size=batch_size))
    return PointwiseJudgment(p_yes, margin)
