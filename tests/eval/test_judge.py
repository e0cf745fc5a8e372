"""Judging from verdict-token probabilities: the batched scorer against one unpadded forward
per prompt, both orders in one call against two calls, the renormalisation over the verdict
pair, and the errors for bad verdicts and inputs."""

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.judge import JudgeTemplate, judge_pairs, judge_points
from jaxlm.eval.scoring import branched_candidate_logprobs, candidate_logprobs

QUESTIONS = ["2+2?", "capital of France?", "7*6?"]
A = ["4", "Paris", "42"]
B = ["5", "Lyon, a larger city in the south-east", "41"]


@pytest.fixture(scope="module")
def judge():
    cfg = jaxlm.ModelConfig.tiny(vocab_size=259, init_std=0.5, max_seq_len=128)
    return jaxlm.build_model(cfg, seed=0, tokenizer=ByteTokenizer())


def unpadded_next_logprobs(model, text):
    ids = model.tokenizer.encode(text, add_bos=True)
    logits = model(np.asarray([ids], np.int32)).logits[0, -1]
    return np.asarray(jax.nn.log_softmax(logits))


def test_scorer_equals_one_unpadded_forward_per_prompt(judge):
    texts = ["a", "a longer prompt with more bytes", "mid-size one"]
    cand = [65, 66, 10]
    got = candidate_logprobs(judge, texts, cand, batch_size=2, bucket=8)
    for row, t in zip(got, texts):
        np.testing.assert_allclose(row, unpadded_next_logprobs(judge, t)[cand], atol=2e-5)


def test_both_orders_in_one_call_equal_two_calls(judge):
    t = JudgeTemplate()
    both = judge_pairs(judge, QUESTIONS, A, B, template=t)
    ab = judge_pairs(judge, QUESTIONS, A, B, template=t, both_orders=False)
    ba = judge_pairs(judge, QUESTIONS, B, A, template=t, both_orders=False)
    # both orders run through the shared-prefix KV cache, the single orders through one plain
    # forward: the same function in float32 with a different summation order
    np.testing.assert_allclose(both.p_ab, ab.p, atol=1e-5)
    np.testing.assert_allclose(both.p_ba, ba.p, atol=1e-5)
    np.testing.assert_allclose(both.p, (ab.p + 1 - ba.p) / 2, atol=1e-5)
    np.testing.assert_array_equal(both.decision, (both.p < 0.5).astype(int))
    p = both.p
    np.testing.assert_allclose(both.entropy, -p * np.log(p) - (1 - p) * np.log(1 - p), atol=1e-9)
    # swapping the responses mirrors the debiased preference exactly
    swapped = judge_pairs(judge, QUESTIONS, B, A, template=t)
    np.testing.assert_allclose(swapped.p, 1 - both.p, atol=1e-6)


def test_verdict_probabilities_are_renormalised_over_the_pair(judge):
    t = JudgeTemplate()
    got = judge_pairs(judge, QUESTIONS[:1], A[:1], B[:1], template=t, both_orders=False)
    lp = unpadded_next_logprobs(judge, t.pairwise.format(question=QUESTIONS[0], first=A[0], second=B[0]))
    a, b = lp[ord("A") + 3], lp[ord("B") + 3]  # the byte tokenizer's ids are bytes + 3
    assert judge.tokenizer.encode("A") == [ord("A") + 3]
    np.testing.assert_allclose(got.p_ab, [np.exp(a) / (np.exp(a) + np.exp(b))], atol=1e-5)
    np.testing.assert_allclose(got.margin, [abs(a - b)], atol=1e-4)
    points = judge_points(judge, QUESTIONS, A, template=t)
    assert points.p_yes.shape == (3,) and np.all((points.p_yes > 0) & (points.p_yes < 1))


def test_bad_judge_inputs(judge):
    with pytest.raises(ValueError, match="one token"):
        judge_pairs(judge, QUESTIONS, A, B, template=JudgeTemplate(first="AA"))
    with pytest.raises(ValueError, match="differ in length"):
        judge_pairs(judge, QUESTIONS, A, B[:2])
    with pytest.raises(ValueError, match="lacks the field"):
        JudgeTemplate(pairwise="{question} {first}")
    with pytest.raises(ValueError, match=r"\[0, 259\)"):
        candidate_logprobs(judge, ["x"], [300])
    assert judge_pairs(judge, [], [], []).p.shape == (0,)
    # a prompt past max_seq_len: the one-order path scored it silently (the branched path refused)
    with pytest.raises(ValueError, match=r"prompt 1 has 201 tokens, more than ModelConfig.max_seq_len=128"):
        candidate_logprobs(judge, ["ok", "x" * 200], [65])
    with pytest.raises(ValueError, match="more than ModelConfig.max_seq_len=128"):
        judge_points(judge, ["q" * 200], ["a"])


@pytest.mark.parametrize("bad, match", [
    (259, r"prompt 1 holds token id 259: ids must be \[0, 259\)"),  # gave NaN log-probs
    (-1, r"prompt 1 holds token id -1"),  # wrapped around to 258
    (7.9, r"prompt 1 holds 7.9: token-id prompts must hold ints"),  # cut to 7
    (True, r"prompt 1 holds True"),
])
def test_token_id_prompts_are_checked_against_the_vocabulary(judge, bad, match):
    from jaxlm.eval.evidence_drop import evidence_drop
    from jaxlm.eval.scoring import branched_candidate_logprobs

    prompts = [[1, 5, 9], [1, 5, bad]]
    with pytest.raises(ValueError, match=match):
        candidate_logprobs(judge, prompts, [65])
    with pytest.raises(ValueError, match=match):
        branched_candidate_logprobs(judge, [prompts], [65])
    with pytest.raises(ValueError, match=match):
        evidence_drop(judge, prompts, ["a. b.", "c. d."])
    np_ids = [np.asarray([1, 5, 9]), np.asarray([1, 5, 258], np.int64)]  # numpy ints are ints
    assert candidate_logprobs(judge, np_ids, [65]).shape == (2, 1)


def test_branched_scoring_equals_scoring_each_prompt(judge):
    groups = [("shared start, then one", "shared start, then two!"), ("x", "x"), ("abc", "xyz long other")]
    cand = [65, 66, 70]
    got = branched_candidate_logprobs(judge, groups, cand, batch_size=2, bucket=8)
    flat = candidate_logprobs(judge, [p for g in groups for p in g], cand)
    np.testing.assert_allclose(got.reshape(-1, 3), flat, atol=3e-5)
    with pytest.raises(ValueError, match="same number"):
        branched_candidate_logprobs(judge, [("a", "b"), ("c",)], cand)


def test_branched_groups_that_fit_alone_are_scored_together(judge):
    """A long shared prefix with short branches and a short prefix with long branches each
    fit max_seq_len = 128 but not in one padded batch: they go to separate batches."""
    groups = [("q" * 110 + " A", "q" * 110 + " B"), ("w" + "a" * 100, "w" + "b" * 100)]
    cand = [65, 66]
    got = branched_candidate_logprobs(judge, groups, cand, batch_size=4, bucket=8)
    flat = candidate_logprobs(judge, [p for g in groups for p in g], cand, batch_size=1)
    np.testing.assert_allclose(got.reshape(-1, 2), flat, atol=3e-5)
    with pytest.raises(ValueError, match=r"group 1: a prompt of 130 tokens exceeds ModelConfig.max_seq_len=128"):
        branched_candidate_logprobs(judge, [("a", "b"), ("x" * 129, "y")], cand)


@pytest.mark.parametrize("pairwise, match", [
    ("{question} {first} {second} {bogus}", r"has field\(s\) \['\{bogus\}'\] other than"),
    ("{question} {first} {second} {0}", r"has field\(s\) \['\{0\}'\]"),
    ('{question} {first} {second} {"v": 1}', "other than"),
    ("{question} {first} {second} {", "Single '{' encountered"),
    ("{question} {first}", r"lacks the field\(s\) \['\{second\}'\]"),
])
def test_judge_template_fields_are_checked_when_built(pairwise, match):
    """Every ``{field}`` of a template is one the judge fills; literal braces are doubled."""
    from jaxlm.eval.judge import JudgeTemplate

    with pytest.raises(ValueError, match=match):
        JudgeTemplate(pairwise=pairwise)
    assert JudgeTemplate(pairwise="{{json}} {question} {first} {second}").pairwise.startswith("{{")
