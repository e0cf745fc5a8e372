"""Beam search (`generate(num_beams=K)`): token-for-token and score parity with HF transformers'
beam search, exhaustive search against brute-force enumeration, log-probs against a fresh
forward pass, batch independence and bad settings."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm

torch = pytest.importorskip("torch")  # the reference implementation
transformers = pytest.importorskip("transformers")

from hf_reference import build_hf_model, padded_batch  # noqa: E402

N = 10  # new tokens
PAD = 1  # HF fills finished beams with pad_token_id only when it is truthy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny HF Llama with a sharpened LM head (peaked distributions, so the chosen stop
    tokens are reached early) and the same weights loaded into jaxlm."""
    hf = build_hf_model("llama_llama3_rope", seed=3)
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
    path = tmp_path_factory.mktemp("beam_hf")
    hf.save_pretrained(path)
    tokens, mask, _ = padded_batch(batch=3, length=7)
    ours = jaxlm.load_hf(path, dtype="float32")
    prompts = [t[m].tolist() for t, m in zip(tokens, mask)]
    greedy = np.asarray(jaxlm.generate(ours, prompts, max_new_tokens=N, temperature=0).tokens)
    return dict(hf=hf, ours=ours, tokens=tokens, mask=mask, prompts=prompts, greedy=greedy)


SETTINGS = [  # (num_beams, length_penalty, early_stopping, num_return_sequences, stop tokens from greedy)
    (4, 1.0, False, 2, [(0, 3)]),
    (3, 0.5, True, 3, [(0, 3)]),
    (4, 2.0, "never", 4, [(0, 3), (1, 2)]),
    (2, 1.0, False, 1, []),
    (5, -1.0, "never", 3, [(2, 1)]),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"K{s[0]}-lp{s[1]}-es{s[2]}-R{s[3]}-stops{len(s[4])}")
def test_beams_match_transformers(pair, setting):
    K, lp, early, R, stop_at = setting
    stops = [int(pair["greedy"][b, j]) for b, j in stop_at]  # tokens the beams do reach
    with torch.no_grad():
        ref = pair["hf"].generate(
            input_ids=torch.tensor(pair["tokens"], dtype=torch.long),
            attention_mask=torch.tensor(pair["mask"].astype(np.int64)),
            num_beams=K, max_new_tokens=N, do_sample=False, length_penalty=lp, early_stopping=early,
            num_return_sequences=R, pad_token_id=PAD, eos_token_id=stops or None,
            output_scores=True, return_dict_in_generate=True,
        )
    ref_tokens = ref.sequences[:, pair["tokens"].shape[1]:].numpy()
    out = jaxlm.generate(pair["ours"], pair["prompts"], max_new_tokens=N, num_beams=K, length_penalty=lp,
                         early_stopping=early, num_return_sequences=R, stop_tokens=stops, pad_id=PAD)
    tokens = np.asarray(out.tokens)
    assert tokens.shape == (3 * R, N)
    width = ref_tokens.shape[1]  # HF crops to the longest returned hypothesis
    np.testing.assert_array_equal(tokens[:, :width], ref_tokens)
    assert (tokens[:, width:] == PAD).all()
    np.testing.assert_allclose(np.asarray(out.beam_scores), ref.sequences_scores.numpy(), atol=2e-6, rtol=1e-6)
    lengths = np.asarray(out.lengths)
    for row, n in zip(tokens, lengths):  # the length counts up to and including the stop token
        assert n == N or row[n - 1] in stops
        assert (row[n:] == PAD).all()
    if stops and lp <= 1:  # (length_penalty 2 prefers the full-length hypotheses)
        assert (lengths < N).any()  # a stop token was reached: finishing is exercised


def test_logprobs_and_scores_are_the_returned_tokens(pair):
    """Each returned token's log-prob equals a fresh forward pass on prompt + hypothesis, and
    the beam score is their sum over length ** length_penalty."""
    model, lp = pair["ours"], 0.7
    stop = int(pair["greedy"][0, 3])
    out = jaxlm.generate(model, pair["prompts"], max_new_tokens=N, num_beams=3, num_return_sequences=3,
                         length_penalty=lp, stop_tokens=[stop], pad_id=PAD)
    lengths, logprobs = np.asarray(out.lengths), np.asarray(out.logprobs)
    seqs = out.sequences()
    T = max(map(len, seqs))  # one left-padded forward over every hypothesis
    tokens = np.array([[PAD] * (T - len(q)) + q for q in seqs], np.int32)
    mask = np.array([[False] * (T - len(q)) + [True] * len(q) for q in seqs])
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens), mask=jnp.asarray(mask)).logits, axis=-1))
    for r, n in enumerate(lengths):
        fresh = logp[r, np.arange(T - n - 1, T - 1), tokens[r, T - n:]]
        np.testing.assert_allclose(logprobs[r, :n], fresh, atol=1e-4)
        assert (logprobs[r, n:] == 0).all()
        np.testing.assert_allclose(out.beam_scores[r], fresh.sum() / n ** lp, rtol=1e-5)
    scores = np.asarray(out.beam_scores).reshape(3, 3)
    assert (np.diff(scores, axis=1) <= 0).all()  # best first


@pytest.mark.parametrize("scan_layers", [False, True])
def test_wide_beams_are_exhaustive(scan_layers):
    """With K >= V ** (N - 1) beams no prefix is ever pruned: the K returned hypotheses are
    exactly the K most likely of all V ** N continuations (length_penalty 0), found here by
    scoring every sequence with a full forward pass (per-layer and stacked caches)."""
    V, n, K = 5, 3, 25
    config = jaxlm.ModelConfig.tiny(vocab_size=V, init_std=0.5, max_seq_len=16, scan_layers=scan_layers)
    model = jaxlm.build_model(config, seed=1)
    prompt = [2, 0, 4]
    out = jaxlm.generate(model, [prompt], max_new_tokens=n, num_beams=K, num_return_sequences=K,
                         length_penalty=0.0, early_stopping="never", stop_tokens=[], pad_id=0)
    conts = np.array(list(itertools.product(range(V), repeat=n)), np.int32)
    seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
    graphdef, params = nnx.split(model)
    logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(jnp.asarray(seqs)).logits, axis=-1)
    P = len(prompt)
    total = np.asarray(jnp.take_along_axis(logp[:, P - 1:-1], jnp.asarray(conts)[..., None], -1)[..., 0].sum(-1))
    order = np.argsort(-total, kind="stable")[:K]
    np.testing.assert_array_equal(np.asarray(out.tokens), conts[order])
    # cached decoding vs one full forward: float32 sums in a different order (as in test_generate)
    np.testing.assert_allclose(np.asarray(out.beam_scores), total[order], atol=1e-4)


def test_rows_are_independent_of_the_batch(pair):
    """A prompt's beams do not depend on the other prompts in its batch (left padding, the
    per-prompt stopping rule, the cache reorder across prompts)."""
    model, stop = pair["ours"], int(pair["greedy"][1, 2])
    kw = dict(max_new_tokens=N, num_beams=3, num_return_sequences=2, stop_tokens=[stop], pad_id=PAD)
    batched = jaxlm.generate(model, pair["prompts"], **kw)
    for b, prompt in enumerate(pair["prompts"]):
        alone = jaxlm.generate(model, [prompt], **kw)
        np.testing.assert_array_equal(np.asarray(batched.tokens)[2 * b: 2 * b + 2], np.asarray(alone.tokens))
        np.testing.assert_allclose(np.asarray(batched.beam_scores)[2 * b: 2 * b + 2], alone.beam_scores, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_beams=0), "num_beams=0 is invalid"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping='sometimes' is invalid"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences=3 is invalid"),
        (dict(num_return_sequences=2), "num_return_sequences=2 is invalid"),
        (dict(num_beams=2, length_penalty=float("nan")), "length_penalty=nan is invalid"),
        # equal to True / False under ==, but not the rule: 1.0 and 0.0 were run as False
        (dict(num_beams=2, early_stopping=1.0), "early_stopping=1.0 is invalid"),
        (dict(num_beams=2, early_stopping=0.0), "early_stopping=0.0 is invalid"),
        (dict(num_beams=2, early_stopping=1), "early_stopping=1 is invalid"),
        (dict(num_beams=2, length_penalty=np.True_), "length_penalty=.*True.* is invalid"),
        (dict(num_beams=2, temperature=0.7), "deterministic beam search"),
        (dict(num_beams=2, top_p=0.9), "deterministic beam search"),
        (dict(num_beams=2, decode_segments=2), "does not combine"),
    ],
)
def test_bad_beam_settings(pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxlm.generate(pair["ours"], [[3, 4]], max_new_tokens=4, **kwargs)


def test_numpy_settings_are_the_python_ones(pair):
    """``np.True_`` is early stopping (it passed the check and ran the False rule) and a
    float32 length penalty is a length penalty (it was refused)."""
    model, stop = pair["ours"], int(pair["greedy"][0, 3])
    kw = dict(max_new_tokens=N, num_return_sequences=3, stop_tokens=[stop], pad_id=PAD)
    want = jaxlm.generate(model, pair["prompts"], num_beams=3, length_penalty=0.5, early_stopping=True, **kw)
    got = jaxlm.generate(model, pair["prompts"], num_beams=np.int64(3), length_penalty=np.float32(0.5),
                         early_stopping=np.True_, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.beam_scores), np.asarray(want.beam_scores))


@pytest.fixture(scope="module")
def byte_model():
    return jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64), seed=5,
                             tokenizer=jaxlm.ByteTokenizer())


def test_grammar_beams_are_the_best_strings_of_a_finite_language(byte_model):
    """Under the grammar ab|cd|efg|h, four beams find every string of the language, ranked by
    the model's own log-probs (summed over the string, over length ** length_penalty) as a
    full forward pass scores them; a string ends where the grammar is complete."""
    from jaxlm.inference.grammar import compile_regex

    tok = byte_model.tokenizer
    words = ["ab", "cd", "efg", "h"]
    g = compile_regex("|".join(words), tok, cache_dir=None)
    prompt = tok.encode("Q?", add_bos=True)
    lp = 0.5
    out = jaxlm.generate(byte_model, [prompt], max_new_tokens=6, num_beams=4, num_return_sequences=4,
                         length_penalty=lp, grammar=g, add_bos=False)
    scores = []
    for w in words:
        ids = tok.encode(w)
        logp = jax.nn.log_softmax(byte_model(jnp.asarray([prompt + ids])).logits[0], axis=-1)
        scores.append(float(sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(ids))) / len(ids) ** lp)
    order = np.argsort(scores)[::-1]
    assert out.texts == [words[i] for i in order]
    np.testing.assert_allclose(np.asarray(out.beam_scores), np.asarray(scores)[order], atol=1e-4)


def test_grammar_beams_stay_in_the_language(byte_model):
    from jaxlm.inference.grammar import compile_json_schema, compile_regex

    tok = byte_model.tokenizer
    grammars = [compile_regex(r"[a-c]{2,5}(-[0-9]+)?", tok, cache_dir=None),
                compile_json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                                    tok, any_whitespace=False, cache_dir=None)]
    out = jaxlm.generate(byte_model, ["x=", "{"], max_new_tokens=16, num_beams=3, num_return_sequences=3,
                         grammar=grammars)
    for i, text in enumerate(out.texts):
        g = grammars[i // 3]
        if out.lengths[i] < 16:  # finished: the whole string is in the language
            assert g.matches(text), text
        else:  # cut by max_new_tokens: a prefix of the language (every token was allowed)
            state = g.tables.start
            for t in tok.encode(text):
                state = g.tables.step(state, t)
                assert state >= 0, text


def test_grammar_masks_before_a_top_k_processor(byte_model):
    """TopK ranks the tokens the grammar allows (as in the sampler): beams under a digits-only
    grammar with TopK(2) find the same strings as without it (here every step keeps at least
    the two allowed tokens the beams use), never an empty output."""
    from jaxlm.inference.grammar import compile_regex
    from jaxlm.inference.logits_processors import TopK

    g = compile_regex(r"[0-9]{3}", byte_model.tokenizer, cache_dir=None)
    plain = jaxlm.generate(byte_model, ["x", "y"], max_new_tokens=5, num_beams=2, grammar=g)
    top2 = jaxlm.generate(byte_model, ["x", "y"], max_new_tokens=5, num_beams=2, grammar=g,
                          logits_processors=[TopK(2)])
    assert all(g.matches(t) for t in top2.texts) and top2.texts == plain.texts
    assert np.all(np.asarray(top2.beam_scores) > -1e8)


def test_fewer_hypotheses_than_return_sequences_leave_empty_rows(byte_model):
    """A language of two strings asked for four: the reference-style -1e9 start of the extra
    beams (and finished beams run on at -1e9) returned copies of the two strings scored about
    -1e9 / len. The extra rows are empty instead: length 0, score -inf. The same with a TopK(1)
    processor and no grammar: one hypothesis, the greedy string."""
    from jaxlm.inference.grammar import compile_regex
    from jaxlm.inference.logits_processors import TopK

    tok = byte_model.tokenizer
    g = compile_regex("ab|cd", tok, cache_dir=None)
    out = jaxlm.generate(byte_model, ["Q?", "R!"], max_new_tokens=6, num_beams=4, num_return_sequences=4,
                         grammar=g)
    for b in range(2):
        rows = slice(4 * b, 4 * b + 4)
        assert sorted(out.texts[rows][:2]) == ["ab", "cd"] and out.texts[rows][2:] == ["", ""]
        np.testing.assert_array_equal(np.asarray(out.lengths[rows])[2:], [0, 0])
        scores = np.asarray(out.beam_scores[rows])
        assert np.all(np.isfinite(scores[:2])) and np.all(scores[:2] > -100) and np.all(np.isneginf(scores[2:]))
    greedy = jaxlm.generate(byte_model, ["Q?"], max_new_tokens=5, temperature=0)
    beams = jaxlm.generate(byte_model, ["Q?"], max_new_tokens=5, num_beams=3, num_return_sequences=3,
                           logits_processors=[TopK(1)])
    assert beams.texts == [greedy.texts[0], "", ""]
    np.testing.assert_array_equal(np.asarray(beams.lengths), [5, 0, 0])


def test_a_processor_reading_the_generated_tokens_sees_each_beam_as_a_row(pair):
    """A state-reading processor (no token generated twice) gets one row of ``state.tokens``
    per row of logits, as when sampling; the beams equal transformers' with the same rule
    written as an HF logits processor."""
    P = pair["tokens"].shape[1]

    class NoRepeatHF(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for row, ids in enumerate(input_ids[:, P:]):
                scores[row, ids] = -float("inf")
            return scores

    def no_repeat(logits, state):
        rows = jnp.arange(logits.shape[0])[:, None]
        seen = jnp.arange(state.tokens.shape[1])[None, :] < state.step
        banned = jnp.zeros(logits.shape, bool).at[rows, state.tokens].max(seen)
        return jnp.where(banned, -jnp.inf, logits)

    with torch.no_grad():
        ref = pair["hf"].generate(
            input_ids=torch.tensor(pair["tokens"], dtype=torch.long),
            attention_mask=torch.tensor(pair["mask"].astype(np.int64)), num_beams=3, max_new_tokens=N,
            do_sample=False, num_return_sequences=2, pad_token_id=PAD, eos_token_id=None,
            logits_processor=transformers.LogitsProcessorList([NoRepeatHF()]), output_scores=True,
            return_dict_in_generate=True)
    out = jaxlm.generate(pair["ours"], pair["prompts"], max_new_tokens=N, num_beams=3, num_return_sequences=2,
                         stop_tokens=(), pad_id=PAD, logits_processors=[no_repeat])
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens, ref.sequences[:, P:].numpy())
    assert all(len(set(row)) == len(row) for row in tokens.tolist())
    np.testing.assert_allclose(np.asarray(out.beam_scores), ref.sequences_scores.numpy(), atol=2e-6, rtol=1e-6)
