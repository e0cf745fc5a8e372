"""Evidence Drop: a training-free hallucination detector on reasoning traces ("Mind the Gap:
Catching Hallucinations via Evidence Drop on the Reasoning Manifold", ICML 2026; method card
§7.2, whose evidence definition is [INFERRED] and therefore a flag here).

A trace is split into steps ``s_1..s_T`` (`segment_steps`: lines, or "Step k" markers). Each
step gets a local evidence ``e_t`` from the model's own statistics on its tokens
(`EVIDENCE`):

* ``"logprob"``: the mean token log-probability of the step;
* ``"entropy"``: ``1 - mean_token_entropy / log V``;
* ``"hidden_similarity"``: the cosine similarity of the step's mean final hidden state to the
  mean hidden state of the steps before it (the first step scores 1).

The drop at step ``t`` is ``max(0, ebar_{<t} - e_t)`` with ``ebar_{<t}`` the running mean of
the earlier steps' evidence (or their exponential moving average, ``ema``); the first step
has no drop. The trace's score is the worst drop (higher = more likely hallucinated) and the
step it occurs at is the localisation.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.eval.scoring import encode_prompts

EVIDENCE = ("logprob", "entropy", "hidden_similarity")
_STEP_MARKER = re.compile(r"(?=\bStep\s+\d+)", re.I)


def segment_steps(text: str, *, by: str = "line") -> list[str]:
    """The trace's steps, concatenating back to ``text`` exactly: ``by="line"`` cuts after
    each newline (a blank line joins the step before it), ``by="marker"`` before each "Step k"
    (text before the first marker is its own step). Empty text has no steps."""
    if by == "line":
        parts = text.splitlines(keepends=True)
        steps: list[str] = []
        for p in parts:
            if steps and not p.strip():
                steps[-1] += p
            else:
                steps.append(p)
    elif by == "marker":
        steps = [p for p in _STEP_MARKER.split(text) if p]
    else:
        raise ValueError(f"by={by!r} must be 'line' or 'marker'")
    return steps


def evidence_drops(evidence: Sequence[float], *, ema: float | None = None) -> np.ndarray:
    """``[T]`` drops ``max(0, ebar_{<t} - e_t)``; ``ema`` in (0, 1] uses
    ``ebar <- (1 - ema) ebar + ema e`` instead of the running mean."""
    e = np.asarray(evidence, np.float64).ravel()
    if ema is not None and not 0.0 < ema <= 1.0:
        raise ValueError(f"ema={ema} must be in (0, 1]")
    drops = np.zeros(e.size)
    if e.size == 0:
        return drops
    ref = e[0]
    for t in range(1, e.size):
        drops[t] = max(0.0, ref - e[t])
        ref = ref + (e[t] - ref) / (t + 1) if ema is None else (1.0 - ema) * ref + ema * e[t]
    return drops


@dataclasses.dataclass(frozen=True)
class EvidenceDropResult:
    """Per trace: ``score`` (worst drop), ``step`` (its index, -1 for a trace of fewer than two
    steps), the per-step ``evidence`` and ``drops``, and ``mean_logprob`` (the trace tokens'
    mean log-prob, the sequence-level baseline)."""

    score: np.ndarray
    step: np.ndarray
    evidence: list[np.ndarray]
    drops: list[np.ndarray]
    mean_logprob: np.ndarray


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_statistics(graphdef, state, tokens, mask):
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = model(tokens, positions, mask=mask)
    logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32), axis=-1)  # t predicts t + 1
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return picked, entropy, out.hidden[:, 1:].astype(jnp.float32)


def step_evidence(logprobs, entropies, hidden, step_of_token, n_steps: int, *, kind: str, vocab_size: int
                  ) -> np.ndarray:
    """Per-step evidence from per-token statistics of one trace (tokens of step ``t`` have
    ``step_of_token == t``; a step without tokens inherits the previous step's evidence)."""
    if kind not in EVIDENCE:
        raise ValueError(f"evidence={kind!r} must be one of {EVIDENCE}")
    e = np.zeros(n_steps)
    means = []
    for t in range(n_steps):
        sel = step_of_token == t
        if not sel.any():
            e[t] = e[t - 1] if t else 0.0
            means.append(None)  # no hidden state: not part of later steps' reference
            continue
        if kind == "logprob":
            e[t] = logprobs[sel].mean()
        elif kind == "entropy":
            e[t] = 1.0 - entropies[sel].mean() / np.log(vocab_size)
        else:
            h = hidden[sel].mean(0)
            prev = [m for m in means if m is not None]
            if prev:
                ref = np.mean(prev, axis=0)
                e[t] = float(h @ ref / (np.linalg.norm(h) * np.linalg.norm(ref) + 1e-12))
            else:
                e[t] = 1.0
        means.append(hidden[sel].mean(0) if kind == "hidden_similarity" else None)
    return e


def evidence_drop(model, prompts: Sequence[str], traces: Sequence[str], *, evidence: str = "logprob",
                  by: str = "line", ema: float | None = None, batch_size: int = 16) -> EvidenceDropResult:
    """Score each (prompt, trace) with the model's own statistics on the trace's tokens. The
    trace is tokenised whole after the encoded prompt, as the model reads it, and each token
    belongs to the step holding its first character (a tokenizer without character offsets
    encodes step by step); one forward per batch of traces."""
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence={evidence!r} must be one of {EVIDENCE}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: must be an int >= 1")
    if len(prompts) != len(traces):
        raise ValueError(f"{len(prompts)} prompts for {len(traces)} traces")
    tok = model.tokenizer
    heads = encode_prompts(tok, prompts, vocab_size=model.config.vocab_size)
    rows, owners, n_steps = [], [], []
    for head, trace in zip(heads, traces):
        steps = segment_steps(trace, by=by)
        ids, owner = list(head), [-1] * len(head)
        if hasattr(tok, "encode_with_offsets"):
            # splitting the text at the steps would change its tokens (a space or "\n" merged
            # with the next word, SentencePiece's prefix space on every piece)
            piece, offsets = tok.encode_with_offsets(trace)
            ends = np.cumsum([len(s) for s in steps])
            ids += list(piece)
            owner += [min(int(np.searchsorted(ends, start, side="right")), len(steps) - 1) for start, _ in offsets]
        else:
            for t, s in enumerate(steps):
                piece = tok.encode(s)
                ids += piece
                owner += [t] * len(piece)
        rows.append(ids)
        owners.append(np.asarray(owner[1:]))  # aligned with the statistics of tokens 1..n-1
        n_steps.append(len(steps))
    limit = model.config.max_seq_len
    over = [i for i, r in enumerate(rows) if len(r) > limit]
    if over:
        raise ValueError(f"prompt + trace {over[0]} has {len(rows[over[0]])} tokens, more than "
                         f"ModelConfig.max_seq_len={limit}")
    V = model.config.vocab_size
    graphdef, state = nnx.split(model)
    pad = getattr(tok, "pad_id", None) or 0
    scores, where, evid, drops = np.zeros(len(rows)), np.full(len(rows), -1), [None] * len(rows), [None] * len(rows)
    mean_lp = np.zeros(len(rows))
    for start in range(0, len(rows), batch_size):
        chunk = list(range(start, min(start + batch_size, len(rows))))
        T = min(-(-max(len(rows[i]) for i in chunk) // 16) * 16, limit)
        tokens = np.full((batch_size, T), pad, np.int32)
        mask = np.zeros((batch_size, T), bool)
        for r, i in enumerate(chunk):
            tokens[r, T - len(rows[i]):] = rows[i]
            mask[r, T - len(rows[i]):] = True
        mask[len(chunk):, -1] = True
        lp, ent, hid = (np.asarray(x) for x in _token_statistics(graphdef, state, jnp.asarray(tokens),
                                                                 jnp.asarray(mask)))
        for r, i in enumerate(chunk):
            n = len(rows[i]) - 1
            sl = slice(T - 1 - n, T - 1)
            e = step_evidence(lp[r, sl], ent[r, sl], hid[r, sl], owners[i], n_steps[i], kind=evidence, vocab_size=V)
            in_trace = owners[i] >= 0
            mean_lp[i] = lp[r, sl][in_trace].mean() if in_trace.any() else 0.0
            d = evidence_drops(e, ema=ema)
            evid[i], drops[i] = e, d
            if d.size >= 2:
                scores[i], where[i] = d.max(), int(np.argmax(d))
    return EvidenceDropResult(scores, where, evid, drops, mean_lp)
