"""Training data for correctness models (Generalized Correctness Models, Xiao et al. 2025;
method card §7.4): a model's correctness history and the prompt formats a correctness
model reads.

A `CorrectnessRecord` says that ``model`` answered ``question`` with ``answer`` and whether
that was right. `correctness_history` makes records by greedy decoding with a jaxlm model on
a `jaxlm.data.tasks.Task` and its verifier, with the model's own confidence (the geometric
mean probability of its answer tokens: the self-confidence baseline). `gcm_rows` turns
records into prompt/completion rows for SFT, the completion being the verdict token
("Y"/"N"), in one of `VARIANTS`:

* ``"standard"``: question and answer;
* ``"answerless"``: the question only (does the question alone predict correctness?);
* ``"history"``: ``k`` other records of the same answering model, anonymised as
  "Model Alpha", before the query (in-context history), retrieved at random or by word
  overlap with the question.

A correctness model's confidence is then P(Y) over {Y, N}
(`jaxlm.eval.judge.judge_points` with `GCM_TEMPLATE`, or `verdict_prompt`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxlm.eval.judge import JudgeTemplate
from jaxlm.inference.sampler import generate

VARIANTS = ("standard", "answerless", "history")
RETRIEVAL = ("random", "overlap")
GCM_TEMPLATE = JudgeTemplate(pointwise="Q: {question}\nA: {response}\nCorrect? ")


@dataclasses.dataclass(frozen=True)
class CorrectnessRecord:
    model: str
    question: str
    answer: str
    correct: bool
    confidence: float | None = None  # the answering model's own confidence, when known


def correctness_history(model, task, indices: Sequence[int], *, name: str, split: str = "eval",
                        max_new_tokens: int = 16, batch_size: int = 64) -> list[CorrectnessRecord]:
    """Greedy answers of ``model`` to ``task``'s examples at ``indices``, verified, with the
    model's own confidence ``exp(mean log p(answer tokens))``."""
    examples = [task.example(int(i), split) for i in indices]
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        res = generate(model, [e["prompt"] for e in chunk], max_new_tokens=max_new_tokens, temperature=0.0)
        logp, lengths = np.asarray(res.logprobs), np.asarray(res.lengths)
        for r, e in enumerate(chunk):
            n = int(lengths[r])
            conf = float(np.exp(logp[r, :n].mean())) if n else 0.0
            answer = res.texts[r]
            out.append(CorrectnessRecord(name, e["prompt"], answer, bool(task.verify(e, answer) >= 1.0), conf))
    return out


def _words(text: str) -> set[str]:
    return set(text.lower().split())


def retrieve(history: Sequence[CorrectnessRecord], record: CorrectnessRecord, k: int, *, how: str,
             rng: np.random.Generator) -> list[CorrectnessRecord]:
    """``k`` records of ``record.model`` about other questions: at random, or the ``k`` with
    the most words in common with the question (ties in history order)."""
    if how not in RETRIEVAL:
        raise ValueError(f"retrieval={how!r} must be one of {RETRIEVAL}")
    pool = [h for h in history if h.model == record.model and h.question != record.question]
    if how == "random":
        idx = rng.permutation(len(pool))[:k]
        return [pool[i] for i in idx]
    q = _words(record.question)
    ranked = sorted(range(len(pool)), key=lambda i: -len(q & _words(pool[i].question)))
    return [pool[i] for i in ranked[:k]]


def verdict_prompt(record: CorrectnessRecord, variant: str = "standard",
                   context: Sequence[CorrectnessRecord] = (), template: JudgeTemplate = GCM_TEMPLATE) -> str:
    """The correctness model's prompt for ``record`` (module docstring); ``template.pointwise``
    formats each (question, answer)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    if variant == "answerless":
        return f"Q: {record.question}\nCorrect? "
    query = template.pointwise.format(question=record.question, response=record.answer)
    if variant == "standard":
        return query
    lines = ["Model Alpha's record:"]
    for h in context:
        lines.append(template.pointwise.format(question=h.question, response=h.answer)
                     + (template.yes if h.correct else template.no))
    return "\n".join(lines) + "\nNow:\n" + query


def gcm_rows(records: Sequence[CorrectnessRecord], *, variant: str = "standard", k: int = 3,
             history: Sequence[CorrectnessRecord] | None = None, retrieval: str = "random", seed: int = 0,
             template: JudgeTemplate = GCM_TEMPLATE) -> list[dict[str, str]]:
    """Prompt/completion rows (completion ``template.yes`` or ``template.no``: "Y" / "N") for
    training or scoring a correctness model; ``history`` (default: ``records``) feeds the
    in-context variant; score the trained model with the same ``template``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS}")
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    rng = np.random.default_rng(seed)
    pool = list(records if history is None else history)
    rows = []
    for r in records:
        ctx = retrieve(pool, r, k, how=retrieval, rng=rng) if variant == "history" else ()
        rows.append({"prompt": verdict_prompt(r, variant, ctx, template),
                     "completion": template.yes if r.correct else template.no})
    return rows
