"""Editing metrics as EasyEdit and CounterFact define them (teacher-forced).

* efficacy / generalisation (EasyEdit ``rewrite_acc`` / ``rephrase_acc``): the fraction of
  target tokens that are the argmax prediction given the prompt and the earlier target
  tokens, averaged over requests; ``*_exact`` counts a request only when every target
  token is the argmax (then greedy decoding produces the target: the autoregressive exact
  match CrispEdit reports);
* CounterFact efficacy success ``ES = E[1{NLL(new) < NLL(true)}]`` on rewrite prompts,
  paraphrase success ``PS`` on paraphrases, neighbourhood success ``NS = E[1{NLL(true) <
  NLL(new)}]`` on neighbourhood prompts, where NLL is the target's negative log-likelihood
  divided by its token count, as CounterFact's ``test_batch_prediction`` computes it
  (``length_normalized=False`` compares summed log-probabilities, i.e. sequence
  probabilities, instead);
* locality (EasyEdit ``compute_locality_quality``): for each neighbourhood prompt, the mean
  over its target tokens of ``1{argmax after edit == argmax before edit}`` (prompt and
  padding positions do not count), averaged per request;
* capability: exact match (answer + EOS under teacher forcing == greedy decoding) on the
  capability task's held-out examples, and its retention = edited / unedited.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.editing.requests import EncodedPairs, encode_pairs


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(graphdef, state, tokens, valid, target_mask):
    logits = nnx.merge(graphdef, state)(tokens, mask=valid).logits[:, :-1]
    lp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens[:, 1:]
    m = target_mask[:, 1:]
    pred = jnp.argmax(logits, axis=-1)
    correct = (pred == tgt) & m
    logprob = jnp.sum(jnp.where(m, jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0], 0.0), axis=1)
    return correct.sum(1), m.sum(1), logprob, jnp.where(m, pred, -1)


def score(model, pairs: EncodedPairs, batch_size: int = 128) -> dict[str, np.ndarray]:
    """Per row: ``token_acc``, ``exact``, ``logprob`` (summed over the target tokens),
    ``n_tokens`` (target token count), ``pred`` (argmax ids at predicted target positions,
    -1 elsewhere)."""
    graphdef, state = nnx.split(model)
    outs = []
    for i in range(0, pairs.tokens.shape[0], batch_size):
        s = slice(i, i + batch_size)
        outs.append(jax.device_get(_score(graphdef, state, jnp.asarray(pairs.tokens[s]),
                                          jnp.asarray(pairs.valid[s]), jnp.asarray(pairs.target_mask[s]))))
    n_correct, n, logprob, pred = (np.concatenate(x) for x in zip(*outs))
    return {"token_acc": n_correct / np.maximum(n, 1), "exact": n_correct == n, "logprob": logprob,
            "n_tokens": n, "pred": pred}


def target_agreement(pred: np.ndarray, base_pred: np.ndarray) -> np.ndarray:
    """Per row, the fraction of target positions (``base_pred >= 0``) where ``pred`` equals
    ``base_pred``: EasyEdit's locality of one neighbourhood prompt. A row with no target
    token is NaN (there is nothing to agree on)."""
    is_target = base_pred >= 0
    n = is_target.sum(axis=1)
    agree = ((pred == base_pred) & is_target).sum(axis=1)
    return np.where(n > 0, agree / np.maximum(n, 1), np.nan)


def _flatten(requests, field):
    prompts, targets_new, targets_true, owner = [], [], [], []
    for k, r in enumerate(requests):
        items = (
            [(p, r["target_new"], r.get("target_true")) for p in r.get("paraphrase_prompts", ())]
            if field == "paraphrase" else [(n["prompt"], r["target_new"], n["target"]) for n in r.get("neighborhood", ())]
        )
        for p, new, true in items:
            prompts.append(p)
            targets_new.append(new)
            targets_true.append(true)
            owner.append(k)
    return prompts, targets_new, targets_true, np.asarray(owner)


def _case_mean(values, owner, n):
    values = np.asarray(values, dtype=float)
    keep = ~np.isnan(values)
    values, owner = values[keep], np.asarray(owner)[keep]
    sums = np.bincount(owner, weights=values, minlength=n)
    counts = np.bincount(owner, minlength=n)
    ok = counts > 0
    return float(np.mean(sums[ok] / counts[ok])) if ok.any() else float("nan")


class EditEvaluator:
    """Scores a model on edit requests and a capability set; built once from the
    unedited model so locality compares against its predictions.

    ``length_normalized`` (default True, CounterFact's definition): ES/PS/NS compare each
    target's per-token NLL; False compares summed log-probabilities (sequence
    probabilities), which favours the shorter target when the two differ in length."""

    def __init__(self, base_model, requests: Sequence[dict[str, Any]], tokenizer,
                 capability_examples: Sequence[dict[str, Any]] = (), *, length_normalized: bool = True):
        if not isinstance(length_normalized, bool):
            raise ValueError(f"length_normalized={length_normalized!r} is invalid: must be a bool")
        self.length_normalized = length_normalized
        self.requests = list(requests)
        n = len(self.requests)
        enc = functools.partial(encode_pairs, tokenizer)
        self.rewrite_new = enc([r["prompt"] for r in requests], [r["target_new"] for r in requests])
        # ES / PS over the requests that name their true target (each one its own case)
        self.true_rows = np.asarray([k for k, r in enumerate(requests) if r.get("target_true")], np.int64)
        self.rewrite_true = enc([requests[k]["prompt"] for k in self.true_rows],
                                [requests[k]["target_true"] for k in self.true_rows]) if self.true_rows.size else None
        p, new, true, self.para_owner = _flatten(requests, "paraphrase")
        self.para_new = enc(p, new) if p else None
        self.para_true_rows = np.asarray([i for i, t in enumerate(true) if t], np.int64)
        self.para_true = enc([p[i] for i in self.para_true_rows],
                             [true[i] for i in self.para_true_rows]) if self.para_true_rows.size else None
        p, new, true, self.nb_owner = _flatten(requests, "neighborhood")
        self.nb_true = enc(p, true) if p else None
        self.nb_new = enc(p, new) if p else None
        self.capability = (
            enc([e["prompt"] for e in capability_examples], [e["completion"] for e in capability_examples],
                append_eos=True) if capability_examples else None
        )
        self.n = n
        self.base_nb_pred = score(base_model, self.nb_true)["pred"] if self.nb_true is not None else None
        self.base_capability = score(base_model, self.capability)["exact"].mean() if self.capability is not None else None

    def _target_score(self, scored: dict[str, np.ndarray]) -> np.ndarray:
        """The log-likelihood ES/PS/NS compare: per target token or summed."""
        if self.length_normalized:
            return scored["logprob"] / np.maximum(scored["n_tokens"], 1)
        return scored["logprob"]

    def __call__(self, model) -> dict[str, float]:
        out: dict[str, float] = {}
        rw = score(model, self.rewrite_new)
        out["efficacy"] = float(rw["token_acc"].mean())
        out["efficacy_exact"] = float(rw["exact"].mean())
        if self.rewrite_true is not None:
            new_score = self._target_score(rw)[self.true_rows]
            out["ES"] = float(np.mean(new_score > self._target_score(score(model, self.rewrite_true))))
        if self.para_new is not None:
            pa = score(model, self.para_new)
            out["generalization"] = _case_mean(pa["token_acc"], self.para_owner, self.n)
            out["generalization_exact"] = _case_mean(pa["exact"], self.para_owner, self.n)
            if self.para_true is not None:
                wins = self._target_score(pa)[self.para_true_rows] > self._target_score(score(model, self.para_true))
                out["PS"] = _case_mean(wins, self.para_owner[self.para_true_rows], self.n)
        if self.nb_true is not None:
            nb = score(model, self.nb_true)
            out["locality"] = _case_mean(target_agreement(nb["pred"], self.base_nb_pred), self.nb_owner, self.n)
            out["NS"] = _case_mean(self._target_score(nb) > self._target_score(score(model, self.nb_new)),
                                   self.nb_owner, self.n)
        if self.capability is not None:
            acc = float(score(model, self.capability)["exact"].mean())
            out["capability"] = acc
            base = float(self.base_capability)  # retention of nothing is undefined: NaN
            out["capability_retention"] = acc / base if base > 0 else float("nan")
        return out
