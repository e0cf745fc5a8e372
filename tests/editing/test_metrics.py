"""The editing metrics on hand-built cases, against references written from the benchmarks'
own definitions: EasyEdit's locality (mean over a neighbourhood prompt's target tokens of
argmax agreement before and after the edit) and CounterFact's ES / PS / NS (compare the
targets' negative log-likelihoods divided by their token counts, ``test_batch_prediction``
and ``summarize.py`` of the ROME code).

The model is a bigram table: the logits at a position depend only on that position's
token, so every probability in a case is set by hand."""

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.editing.metrics import EditEvaluator, target_agreement

TOK = ByteTokenizer()
V = TOK.vocab_size


class Bigram(nnx.Module):
    """logits[t] = table[token[t]]: the next-token distribution after each token."""

    def __init__(self, table: np.ndarray):
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def __call__(self, tokens, mask=None):
        return types.SimpleNamespace(logits=self.table[...][tokens])


def bigram_table(rows: dict[str, dict[str, float]]) -> np.ndarray:
    """Log-probabilities: after character ``a`` the next character ``b`` has probability
    ``rows[a][b]``; the rest of the mass is spread evenly over the other tokens."""
    table = np.full((V, V), np.log(1.0 / V), np.float64)
    for prev, nxt in rows.items():
        probs = np.zeros(V)
        for ch, p in nxt.items():
            probs[TOK.encode(ch)[0]] = p
        rest = 1.0 - probs.sum()
        assert rest > 0
        others = probs == 0
        probs[others] = rest / others.sum()
        table[TOK.encode(prev)[0]] = np.log(probs)
    return table


def ref_mean_nll(table, prompt: str, target: str) -> float:
    """CounterFact: -(1/m) sum_j log p(target_j | prompt, target_<j)."""
    ids = TOK.encode(prompt, add_bos=True) + TOK.encode(target)
    n_prompt = len(TOK.encode(prompt, add_bos=True))
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    nll = [-logp[ids[j - 1], ids[j]] for j in range(n_prompt, len(ids))]
    return float(np.mean(nll))


def ref_sum_nll(table, prompt: str, target: str) -> float:
    return ref_mean_nll(table, prompt, target) * len(TOK.encode(target))


def ref_locality(base_table, edited_table, prompt: str, target: str) -> float:
    """EasyEdit: mean over the target tokens of 1{argmax after == argmax before}."""
    ids = TOK.encode(prompt, add_bos=True) + TOK.encode(target)
    n_prompt = len(TOK.encode(prompt, add_bos=True))
    prev = ids[n_prompt - 1 : len(ids) - 1]
    return float(np.mean(np.argmax(base_table[prev], -1) == np.argmax(edited_table[prev], -1)))


# After 'c' the base model says 'z'; the edit flips it to 'x'. Nothing else changes.
BASE_ROWS = {"c": {"z": 0.9}, "a": {"b": 0.9}, "b": {"a": 0.9}}
EDIT_ROWS = {"c": {"x": 0.9}, "a": {"b": 0.9}, "b": {"a": 0.9}}


def test_locality_counts_target_tokens_only():
    base, edited = bigram_table(BASE_ROWS), bigram_table(EDIT_ROWS)
    requests = [
        # The case: neighbourhood 'dc' -> 'z', row [BOS d c z] padded to 6 by the
        # second request's longer row; the flip after 'c' is the only predicted target.
        {"prompt": "q", "target_new": "r", "neighborhood": [{"prompt": "dc", "target": "z"}],
         "paraphrase_prompts": []},
        # Prompt positions change ('c' inside the prompt) but its targets do not.
        {"prompt": "q", "target_new": "r", "neighborhood": [{"prompt": "cab", "target": "ab"}],
         "paraphrase_prompts": []},
    ]
    ev = EditEvaluator(Bigram(base), requests, TOK)
    got = ev(Bigram(edited))["locality"]
    want = np.mean([ref_locality(base, edited, "dc", "z"), ref_locality(base, edited, "cab", "ab")])
    assert want == 0.5  # 0/1 for the first request, 2/2 for the second
    assert got == pytest.approx(want, abs=1e-12)
    assert ev(Bigram(base))["locality"] == 1.0


def test_locality_averages_prompts_within_a_request_then_requests():
    base, edited = bigram_table(BASE_ROWS), bigram_table(EDIT_ROWS)
    nb = [{"prompt": "dc", "target": "z"}, {"prompt": "ab", "target": "ab"}, {"prompt": "b", "target": "czc"}]
    requests = [{"prompt": "q", "target_new": "r", "neighborhood": nb, "paraphrase_prompts": []},
                {"prompt": "q", "target_new": "r", "neighborhood": nb[1:2], "paraphrase_prompts": []}]
    got = EditEvaluator(Bigram(base), requests, TOK)(Bigram(edited))["locality"]
    per_prompt = [ref_locality(base, edited, n["prompt"], n["target"]) for n in nb]
    assert per_prompt[2] == pytest.approx(2 / 3)  # 'b'->'c' kept, 'c'->'z' flipped, 'z'->'c' kept
    assert got == pytest.approx(np.mean([np.mean(per_prompt), per_prompt[1]]), abs=1e-12)


def test_target_agreement_ignores_padding_and_prompt():
    base = np.array([[-1, -1, 7, -1, -1], [-1, 3, 4, 5, -1]])
    pred = np.array([[-1, -1, 8, -1, -1], [-1, 3, 9, 5, -1]])
    np.testing.assert_allclose(target_agreement(pred, base), [0.0, 2 / 3])
    assert np.isnan(target_agreement(pred[:1], np.full((1, 5), -1)))[0]


# After 'a': 'x' at 0.45 and 'z' at 0.35; then 'x' -> 'd' and 'd' -> 'e' at 0.45 each. New target
# 'xde' has summed NLL 3 * 0.799 = 2.40 nats, 0.80 per token; true target 'z' has 1.05.
ES_ROWS = {"a": {"x": 0.45, "z": 0.35}, "x": {"d": 0.45}, "d": {"e": 0.45}}


def _es_requests():
    return [{"prompt": "a", "target_new": "xde", "target_true": "z", "paraphrase_prompts": ["ka", "qqa"],
             "neighborhood": [{"prompt": "ba", "target": "z"}]}]


def test_es_ps_ns_compare_per_token_nll():
    table = bigram_table(ES_ROWS)
    new, true = ref_mean_nll(table, "a", "xde"), ref_mean_nll(table, "a", "z")
    assert new == pytest.approx(-np.log(0.45)) and true == pytest.approx(-np.log(0.35))
    assert ref_sum_nll(table, "a", "xde") > ref_sum_nll(table, "a", "z")  # the two readings disagree
    m = EditEvaluator(Bigram(table), _es_requests(), TOK)(Bigram(table))
    assert m["efficacy_exact"] == 1.0  # greedy decoding writes the new target
    assert m["ES"] == float(new < true) == 1.0
    assert m["PS"] == float(np.mean([ref_mean_nll(table, p, "xde") < ref_mean_nll(table, p, "z")
                                     for p in ("ka", "qqa")])) == 1.0
    assert m["NS"] == float(ref_mean_nll(table, "ba", "z") < ref_mean_nll(table, "ba", "xde")) == 0.0


def test_summed_reading_is_a_flag():
    table = bigram_table(ES_ROWS)
    m = EditEvaluator(Bigram(table), _es_requests(), TOK, length_normalized=False)(Bigram(table))
    assert m["ES"] == float(ref_sum_nll(table, "a", "xde") < ref_sum_nll(table, "a", "z")) == 0.0
    assert m["PS"] == 0.0 and m["NS"] == 1.0
    with pytest.raises(ValueError, match="length_normalized"):
        EditEvaluator(Bigram(table), _es_requests(), TOK, length_normalized="yes")


def test_equal_targets_count_as_neither_success():
    """A tie (new == true) is not a success for ES or NS: CounterFact compares strictly."""
    table = bigram_table(ES_ROWS)
    req = [{"prompt": "a", "target_new": "xde", "target_true": "xde", "paraphrase_prompts": ["ka"],
            "neighborhood": [{"prompt": "ba", "target": "xde"}]}]
    m = EditEvaluator(Bigram(table), req, TOK)(Bigram(table))
    assert m["ES"] == 0.0 and m["PS"] == 0.0 and m["NS"] == 0.0


def test_per_request_means_with_non_dyadic_probabilities():
    """Several requests of different target lengths and probabilities that are not binary
    fractions: ES/PS/NS equal the reference per request, then averaged."""
    rows = {"a": {"x": 0.3, "z": 0.27}, "x": {"d": 0.31}, "b": {"z": 0.7, "x": 0.1}, "k": {"m": 0.2, "n": 0.19},
            "m": {"o": 0.21}, "o": {"p": 0.33}}
    table = bigram_table(rows)
    reqs = [
        {"prompt": "a", "target_new": "xd", "target_true": "z", "paraphrase_prompts": ["ba", "ka"],
         "neighborhood": [{"prompt": "b", "target": "z"}, {"prompt": "a", "target": "z"}]},
        {"prompt": "k", "target_new": "mop", "target_true": "n", "paraphrase_prompts": ["kk"],
         "neighborhood": [{"prompt": "bk", "target": "n"}]},
    ]
    m = EditEvaluator(Bigram(table), reqs, TOK)(Bigram(table))
    nll = lambda p, t: ref_mean_nll(table, p, t)  # noqa: E731
    es = np.mean([nll(r["prompt"], r["target_new"]) < nll(r["prompt"], r["target_true"]) for r in reqs])
    ps = np.mean([np.mean([nll(p, r["target_new"]) < nll(p, r["target_true"]) for p in r["paraphrase_prompts"]])
                  for r in reqs])
    ns = np.mean([np.mean([nll(n["prompt"], n["target"]) < nll(n["prompt"], r["target_new"])
                           for n in r["neighborhood"]]) for r in reqs])
    assert (m["ES"], m["PS"], m["NS"]) == pytest.approx((es, ps, ns), abs=1e-12)
    assert 0 < es < 1 or 0 < ps < 1 or 0 < ns < 1  # the case is not all-or-nothing
    # a request without target_true has no ES / PS of its own; the others keep theirs
    mixed = [reqs[0], {k: v for k, v in reqs[1].items() if k != "target_true"}]
    m = EditEvaluator(Bigram(table), mixed, TOK)(Bigram(table))
    r = reqs[0]
    assert m["ES"] == float(nll(r["prompt"], r["target_new"]) < nll(r["prompt"], r["target_true"]))
    assert m["PS"] == pytest.approx(np.mean([nll(p, r["target_new"]) < nll(p, r["target_true"])
                                             for p in r["paraphrase_prompts"]]), abs=1e-12)
    assert m["NS"] == pytest.approx(ns, abs=1e-12)  # neighbourhoods need no target_true


def test_requests_without_optional_fields_and_retention_of_a_zero_capability():
    """A plain list of requests needs only prompt and target_new; retention relative to an
    unedited capability of 0 is undefined (NaN), not a huge ratio."""
    table = bigram_table(BASE_ROWS)
    held = [{"prompt": "c", "completion": "q"}]  # the base model never says "q" after "c"
    ev = EditEvaluator(Bigram(table), [{"prompt": "c", "target_new": "x"}], TOK, held)
    edited = bigram_table({"c": {"q": 0.9}})
    edited[TOK.encode("q")[0], TOK.eos_id] = 5.0  # "q" then EOS: the held-out completion, exactly
    out = ev(Bigram(edited))
    assert ev.base_capability == 0.0 and out["capability"] == 1.0 and np.isnan(out["capability_retention"])
    assert "generalization" not in out and "locality" not in out
