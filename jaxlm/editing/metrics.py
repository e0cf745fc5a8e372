"""Editing metrics as EasyEdit and CounterFact define them (teacher-forced).

* efficacy / generalisation (EasyEdit ``rewrite_acc`` / ``rephrase_acc``): the fraction of
  target tokens that are the argmax prediction given the prompt and the earlier target
  tokens, averaged over requests; ``*_exact`` counts a request only when every target
  token is the argmax (then greedy decoding produces the target: the autoregressive exact
  match CrispEdit reports);
* CounterFact efficacy success ``ES = E[1{P(new) > P(true)}]`` on rewrite prompts,
  paraphrase success ``PS`` on paraphrases, neighbourhood success ``NS = E[1{P(true) >
  P(new)}]`` on neighbourhood prompts (``experiments/summarize.py``);
* locality (EasyEdit ``editor.py``): agreement of the argmax target tokens on the
  neighbourhood prompts before and after the edit;
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
    """Per row: ``token_acc``, ``exact``, ``logprob`` of the target, ``pred`` (argmax ids)."""
    graphdef, state = nnx.split(model)
    outs = []
    for i in range(0, pairs.tokens.shape[0], batch_size):
        s = slice(i, i + batch_size)
        outs.append(jax.device_get(_score(graphdef, state, jnp.asarray(pairs.tokens[s]),
                                          jnp.asarray(pairs.valid[s]), jnp.asarray(pairs.target_mask[s]))))
    n_correct, n, logprob, pred = (np.concatenate(x) for x in zip(*outs))
    return {"token_acc": n_correct / np.maximum(n, 1), "exact": n_correct == n, "logprob": logprob, "pred": pred}


def _flatten(requests, field):
    prompts, targets_new, targets_true, owner = [], [], [], []
    for k, r in enumerate(requests):
        items = (
            [(p, r["target_new"], r.get("target_true")) for p in r["paraphrase_prompts"]] if field == "paraphrase"
            else [(n["prompt"], r["target_new"], n["target"]) for n in r["neighborhood"]]
        )
        for p, new, true in items:
            prompts.append(p)
            targets_new.append(new)
            targets_true.append(true)
            owner.append(k)
    return prompts, targets_new, targets_true, np.asarray(owner)


def _case_mean(values, owner, n):
    sums = np.bincount(owner, weights=values.astype(float), minlength=n)
    counts = np.bincount(owner, minlength=n)
    ok = counts > 0
    return float(np.mean(sums[ok] / counts[ok])) if ok.any() else float("nan")


class EditEvaluator:
    """Scores a model on edit requests and a capability set; built once from the
    unedited model so locality compares against its predictions."""

    def __init__(self, base_model, requests: Sequence[dict[str, Any]], tokenizer,
                 capability_examples: Sequence[dict[str, Any]] = ()):
        self.requests = list(requests)
        n = len(self.requests)
        enc = functools.partial(encode_pairs, tokenizer)
        self.rewrite_new = enc([r["prompt"] for r in requests], [r["target_new"] for r in requests])
        has_true = all(r.get("target_true") for r in requests)
        self.rewrite_true = enc([r["prompt"] for r in requests], [r["target_true"] for r in requests]) if has_true else None
        p, new, true, self.para_owner = _flatten(requests, "paraphrase")
        self.para_new = enc(p, new) if p else None
        self.para_true = enc(p, true) if p and has_true else None
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

    def __call__(self, model) -> dict[str, float]:
        out: dict[str, float] = {}
        rw = score(model, self.rewrite_new)
        out["efficacy"] = float(rw["token_acc"].mean())
        out["efficacy_exact"] = float(rw["exact"].mean())
        if self.rewrite_true is not None:
            out["ES"] = float(np.mean(rw["logprob"] > score(model, self.rewrite_true)["logprob"]))
        if self.para_new is not None:
            pa = score(model, self.para_new)
            out["generalization"] = _case_mean(pa["token_acc"], self.para_owner, self.n)
            out["generalization_exact"] = _case_mean(pa["exact"], self.para_owner, self.n)
            if self.para_true is not None:
                out["PS"] = _case_mean(pa["logprob"] > score(model, self.para_true)["logprob"], self.para_owner, self.n)
        if self.nb_true is not None:
            nb = score(model, self.nb_true)
            agree = np.mean((nb["pred"] == self.base_nb_pred) | (self.base_nb_pred < 0), axis=1)
            out["locality"] = _case_mean(agree, self.nb_owner, self.n)
            out["NS"] = _case_mean(nb["logprob"] > score(model, self.nb_new)["logprob"], self.nb_owner, self.n)
        if self.capability is not None:
            acc = float(score(model, self.capability)["exact"].mean())
            out["capability"] = acc
            out["capability_retention"] = acc / max(float(self.base_capability), 1e-12)
        return out
