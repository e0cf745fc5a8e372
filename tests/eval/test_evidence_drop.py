"""Evidence Drop: segmentation that round-trips the text, the drop recursion against a loop
written from the definition (running mean and EMA), the per-step evidence of a tiny model
against one unpadded forward, and bad flags."""

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm.data.tokenizers import ByteTokenizer
from jaxlm.eval.evidence_drop import evidence_drop, evidence_drops, segment_steps


def test_segmentation_round_trips():
    text = "a=1\nb=2\n\nc=3"
    steps = segment_steps(text)
    assert steps == ["a=1\n", "b=2\n\n", "c=3"] and "".join(steps) == text
    marked = "intro Step 1: x. Step 2: y."
    assert segment_steps(marked, by="marker") == ["intro ", "Step 1: x. ", "Step 2: y."]
    assert segment_steps("") == []
    with pytest.raises(ValueError, match="'line' or 'marker'"):
        segment_steps(text, by="sentence")


def test_drops_match_the_definition():
    e = [-0.5, -0.4, -2.0, -0.3, -1.0]
    want = [0.0]
    for t in range(1, len(e)):
        want.append(max(0.0, np.mean(e[:t]) - e[t]))
    np.testing.assert_allclose(evidence_drops(e), want)
    ema, ref, want_ema = 0.5, e[0], [0.0]
    for t in range(1, len(e)):
        want_ema.append(max(0.0, ref - e[t]))
        ref = 0.5 * ref + 0.5 * e[t]
    np.testing.assert_allclose(evidence_drops(e, ema=ema), want_ema)
    np.testing.assert_array_equal(evidence_drops([1.0, 1.0, 1.0]), [0.0, 0.0, 0.0])  # constant: no drop
    assert evidence_drops([]).size == 0


@pytest.fixture(scope="module")
def model():
    cfg = jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=128)
    return jaxlm.build_model(cfg, seed=0, tokenizer=ByteTokenizer())


def test_a_trace_past_the_model_length_is_refused(model):
    with pytest.raises(ValueError, match=r"prompt \+ trace 1 has .* tokens, more than ModelConfig.max_seq_len=128"):
        evidence_drop(model, ["q", "q"], ["a. b.", "long step. " * 20])


def test_step_evidence_equals_an_unpadded_forward(model):
    prompt, trace = "Q: 2+3*4?\n", "3*4=12\n2+12=14\nanswer 14"
    got = evidence_drop(model, [prompt, "short"], [trace, "x\ny"], evidence="logprob")
    tok = model.tokenizer
    ids = tok.encode(prompt, add_bos=True)
    starts = [len(ids)]
    for s in segment_steps(trace):
        ids += tok.encode(s)
        starts.append(len(ids))
    logp = np.asarray(jax.nn.log_softmax(model(np.asarray([ids], np.int32)).logits[0]))
    token_lp = np.array([logp[i - 1, ids[i]] for i in range(1, len(ids))])
    want = [token_lp[a - 1:b - 1].mean() for a, b in zip(starts[:-1], starts[1:])]
    np.testing.assert_allclose(got.evidence[0], want, atol=2e-5)
    assert got.mean_logprob[0] == pytest.approx(token_lp[starts[0] - 1:].mean(), abs=2e-5)
    d = evidence_drops(want)
    assert got.score[0] == pytest.approx(d.max(), abs=2e-5) and got.step[0] == int(np.argmax(d))
    for kind in ("entropy", "hidden_similarity"):
        e = evidence_drop(model, [prompt], [trace], evidence=kind).evidence[0]
        assert e.shape == (3,) and np.all(np.isfinite(e))
    single = evidence_drop(model, [prompt], ["one step only"])
    assert single.score[0] == 0.0 and single.step[0] == -1
    with pytest.raises(ValueError, match="evidence="):
        evidence_drop(model, [prompt], [trace], evidence="density")


def test_hidden_similarity_reference_skips_empty_steps():
    """Each step's evidence is the cosine of its mean hidden state to the mean of the earlier
    steps' means; a step with no tokens repeats the previous evidence and adds nothing."""
    from jaxlm.eval.evidence_drop import step_evidence

    hidden = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    step_of_token = np.array([0, 1, 3, 3])  # step 2 has no token

    def cos(a, b):
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    e = step_evidence(np.zeros(4), np.zeros(4), hidden, step_of_token, 4, kind="hidden_similarity", vocab_size=10)
    step3 = hidden[2:].mean(0)
    np.testing.assert_allclose(e, [1.0, cos(hidden[1], hidden[0]), cos(hidden[1], hidden[0]),
                                   cos(step3, (hidden[0] + hidden[1]) / 2)], atol=1e-12)


def test_a_subword_trace_is_scored_as_the_model_reads_it():
    """With a byte-level BPE the trace is scored in its own tokenization (splitting at the
    steps made " Step" into " " + "Step" at every boundary): the trace tokens' mean log-prob is
    the one of encode(prompt) + encode(trace), each token in the step of its first character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlm.data.tokenizers import HFTokenizer

    trace = "Step 1: x = 2. Step 2: y = x + 3. Step 3: answer 5."
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([trace, "Q: what is y?\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = HFTokenizer(bpe, bos_id=1, eos_id=2, pad_id=0)
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=tok.vocab_size, init_std=0.3, max_seq_len=128),
                              seed=0, tokenizer=tok)
    prompt = "Q: what is y?\n"
    got = evidence_drop(model, [prompt], [trace], by="marker")
    head, body = tok.encode(prompt, add_bos=True), tok.encode(trace)
    assert [tok.decode([t]) for t in body].count(" Step") == 2  # " Step" is one token, not " " + "Step"
    ids = head + body
    logp = np.asarray(jax.nn.log_softmax(model(np.asarray([ids], np.int32)).logits[0]))
    token_lp = np.array([logp[i - 1, ids[i]] for i in range(len(head), len(ids))])
    assert got.mean_logprob[0] == pytest.approx(token_lp.mean(), abs=2e-5)
    _, offsets = tok.encode_with_offsets(trace)
    starts = np.cumsum([0] + [len(s) for s in segment_steps(trace, by="marker")])
    step = np.searchsorted(starts, [a for a, _ in offsets], side="right") - 1
    want = [token_lp[step == t].mean() for t in range(len(starts) - 1)]
    np.testing.assert_allclose(got.evidence[0], want, atol=2e-5)
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        evidence_drop(model, [prompt], [trace], batch_size=0)
