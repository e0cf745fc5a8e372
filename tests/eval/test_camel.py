"""CAMEL's gate: tau = 0 never reflects and tau = inf always does (each equal to running that
policy by hand), the final-verdict parser, and the accuracy-vs-tokens curve from one
always-reflect run."""

import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.camel import CamelTemplate, final_verdict, gate_curve, gated_judge
from jaxlm.eval.judge import judge_pairs, pairwise_prompts

Q = ["1+1?", "3*3?", "capital of Peru?"]
A = ["2", "9", "Lima"]
B = ["3", "6", "Cusco"]


@pytest.fixture(scope="module")
def model():
    cfg = jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=160)
    return jaxlm.build_model(cfg, seed=1, tokenizer=ByteTokenizer())


def test_tau_zero_never_reflects(model):
    got = gated_judge(model, Q, A, B, tau=0.0)
    one_order = judge_pairs(model, Q, A, B, both_orders=False)
    assert not got.reflected.any() and np.all(got.tokens == 1)
    np.testing.assert_array_equal(got.final, got.initial)
    np.testing.assert_array_equal(got.initial, (one_order.p_ab < 0.5).astype(int))
    np.testing.assert_allclose(got.margin, one_order.margin, atol=1e-4)


def test_tau_inf_always_reflects_as_by_hand(model):
    t = CamelTemplate()
    got = gated_judge(model, Q, A, B, tau=float("inf"), max_reflection_tokens=12)
    assert got.reflected.all()
    prompts = pairwise_prompts(Q, A, B, t.judge)
    letters = ["A", "B"]
    by_hand = jaxlm.generate(model, [p + letters[v] + t.reflect for p, v in zip(prompts, got.initial)],
                             max_new_tokens=12, temperature=0.0)
    assert got.reflections == by_hand.texts
    np.testing.assert_array_equal(got.tokens, 1 + np.asarray(by_hand.lengths))
    for i, text in enumerate(by_hand.texts):
        v = final_verdict(text, t)
        assert got.final[i] == (got.initial[i] if v is None else v)
    # the curve's ends are the never- and always-reflect policies
    labels = np.array([0, 0, 0])
    lo, hi = gate_curve(got, labels, [0.0, float("inf")])
    assert lo["tokens"] == 1.0 and lo["accuracy"] == np.mean(got.initial == labels)
    assert hi["tokens"] == got.tokens.mean() and hi["accuracy"] == np.mean(got.final == labels)


def test_final_verdict_parser_and_errors(model):
    t = CamelTemplate()
    assert final_verdict("B looks wrong. Final: A", t) == 0
    assert final_verdict("Final: A ... on reflection Final: B", t) == 1
    assert final_verdict("no verdict here", t) is None
    with pytest.raises(ValueError, match="tau"):
        gated_judge(model, Q, A, B, tau=-1.0)
    with pytest.raises(ValueError, match="always-reflect"):
        gate_curve(gated_judge(model, Q, A, B, tau=0.0), [0, 0, 0], [1.0])
