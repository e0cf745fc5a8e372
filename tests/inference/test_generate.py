"""`generate`: cache decoding equals recomputation, log-probs equal a fresh forward pass,
per-sequence stopping, logits processors against numpy references, bad inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.inference import Temperature, TopK, TopP, compose

# init_std 0.5 gives peaked, prompt-dependent distributions (a 0.02 model is near uniform).
CFG = jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64)
PROMPTS = [[5, 9, 200, 17], [3], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53], [100, 7]]


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(CFG, seed=0)


@pytest.fixture(scope="module")
def full_forward(model):
    graphdef, params = nnx.split(model)
    return jax.jit(lambda tokens, mask: nnx.merge(graphdef, params)(tokens, mask=mask).logits)


def _left_pad(seqs, pad=0, width=None):
    T = width or max(map(len, seqs))
    tokens = np.full((len(seqs), T), pad, np.int32)
    mask = np.zeros((len(seqs), T), bool)
    for b, s in enumerate(seqs):
        tokens[b, T - len(s):] = s
        mask[b, T - len(s):] = True
    return jnp.asarray(tokens), jnp.asarray(mask)


def test_greedy_with_cache_equals_recomputation(model, full_forward):
    n = 12
    result = jaxlm.generate(model, PROMPTS, max_new_tokens=n, temperature=0)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(n):  # greedy by full recomputation of every prefix, no cache
        tokens, mask = _left_pad(seqs, width=24)  # one shape: compiled once
        nxt = np.asarray(jnp.argmax(full_forward(tokens, mask)[:, -1], axis=-1))
        seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
    expected = np.array([s[len(p):] for s, p in zip(seqs, PROMPTS)])
    np.testing.assert_array_equal(np.asarray(result.tokens), expected)
    assert len({tuple(r) for r in expected}) == len(PROMPTS)  # prompts matter: a real test
    np.testing.assert_array_equal(result.lengths, n)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_logprobs_equal_fresh_forward(model, full_forward, settings):
    n = 10
    result = jaxlm.generate(model, PROMPTS, max_new_tokens=n, rng=jax.random.key(3), **settings)
    seqs = result.sequences()
    tokens, mask = _left_pad(seqs)
    logp = jax.nn.log_softmax(full_forward(tokens, mask), axis=-1)
    T = tokens.shape[1]
    # generated token j of row b sits at column T - n + j; it is predicted from column - 1
    cols = np.arange(T - n - 1, T - 1)
    fresh = jnp.take_along_axis(logp[:, cols], tokens[:, T - n:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(result.logprobs), np.asarray(fresh), atol=1e-4)
    # sampling log-probs: the processed distribution the token was drawn from
    processors = [Temperature(settings["temperature"])]
    if "top_k" in settings:
        processors += [TopK(settings["top_k"]), TopP(settings["top_p"])]
    processed = jax.nn.log_softmax(compose(processors)(full_forward(tokens, mask)[:, cols].reshape(-1, CFG.vocab_size)), axis=-1)
    picked = jnp.take_along_axis(processed, tokens[:, T - n:].reshape(-1, 1), axis=-1).reshape(len(PROMPTS), n)
    np.testing.assert_allclose(np.asarray(result.sampling_logprobs), np.asarray(picked), atol=1e-4)


def test_per_sequence_stopping(model):
    greedy = jaxlm.generate(model, PROMPTS, max_new_tokens=8, temperature=0)
    stop = int(greedy.tokens[0, 2])  # row 0 emits this at step 2
    result = jaxlm.generate(model, PROMPTS, max_new_tokens=8, temperature=0, stop_tokens=[stop], pad_id=0)
    tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
    for b in range(len(PROMPTS)):
        row = np.asarray(greedy.tokens[b])
        hits = np.flatnonzero(row == stop)
        expected_len = hits[0] + 1 if len(hits) else 8
        assert lengths[b] == expected_len
        np.testing.assert_array_equal(tokens[b, :expected_len], row[:expected_len])
        assert np.all(tokens[b, expected_len:] == 0)
        assert np.all(np.asarray(result.logprobs)[b, expected_len:] == 0)
    assert lengths[0] == 3


def test_same_rng_same_samples_and_text_prompts(model):
    tok = jaxlm.ByteTokenizer()
    a = jaxlm.generate(model, ["hi", "there"], max_new_tokens=5, rng=7, tokenizer=tok, stop_tokens=[])
    b = jaxlm.generate(model, ["hi", "there"], max_new_tokens=5, rng=7, tokenizer=tok, stop_tokens=[])
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.texts == [tok.decode(c) for c in a.completions()]
    assert a.sequences()[0][:3] == [tok.bos_id] + tok.encode("hi")


def test_samples_per_prompt_equals_repeated_prompts(model):
    """Prefilling each prompt once and repeating its cache G times (GRPO's groups) gives the
    rows that G copies of each prompt give: same tokens, log-probs to float32 rounding."""
    from jaxlm.inference import generate_tokens

    graphdef, params = nnx.split(model)
    G = 3
    tokens, mask = _left_pad(PROMPTS)
    kw = dict(max_new_tokens=6, stop_tokens=(7,), processors=(TopK(40),))
    once = generate_tokens(graphdef, params, tokens, mask, jax.random.key(3), samples_per_prompt=G, **kw)
    rep = generate_tokens(graphdef, params, jnp.repeat(tokens, G, 0), jnp.repeat(mask, G, 0), jax.random.key(3), **kw)
    np.testing.assert_array_equal(once.tokens, rep.tokens)
    np.testing.assert_array_equal(once.lengths, rep.lengths)
    np.testing.assert_allclose(once.logprobs, rep.logprobs, atol=1e-5)
    assert len({tuple(r) for r in np.asarray(once.tokens)[:G]}) > 1  # the G rows are distinct samples


def test_sampling_matches_softmax_frequencies():
    """Sampling follows softmax(logits) exactly: chi-square against the law, with a vocabulary
    that is not a multiple of the sampler's block and masked (-inf) entries never drawn."""
    from scipy import stats

    from jaxlm.inference.sampler import sample_categorical

    rng = np.random.RandomState(0)
    V = 300
    logits = rng.randn(V).astype(np.float32) * 1.5
    logits[rng.choice(V, 40, replace=False)] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    draw = jax.jit(lambda k: sample_categorical(k, jnp.tile(jnp.asarray(logits), (25_000, 1))))
    samples = np.concatenate([np.asarray(draw(jax.random.key(i))) for i in range(4)])
    counts = np.bincount(samples, minlength=V)
    assert counts[probs == 0].sum() == 0
    support = probs > 0
    expected = probs[support].astype(np.float64) / probs[support].sum(dtype=np.float64)
    chi2, p = stats.chisquare(counts[support], 100_000 * expected)
    assert p > 1e-3, (chi2, p)


def test_top_k_keeps_both_signed_zeros():
    """-0.0 == +0.0: a tie at the k-th value, so both are kept."""
    kept = np.isfinite(np.asarray(TopK(1)(jnp.asarray([[0.0, -0.0, -1.0], [-0.0, 0.0, -2.0]]))))
    np.testing.assert_array_equal(kept, [[True, True, False], [True, True, False]])
    # the order of the other values is unchanged: negatives, the extremes, the smallest normals
    values = jnp.asarray([[-3e38, -3.0, -1e-38, -0.0, 1e-38, 2.0]])
    for k in range(1, 7):
        got = np.isfinite(np.asarray(TopK(k)(values)))[0]
        want = np.asarray(values)[0] >= np.sort(np.asarray(values)[0])[::-1][k - 1]
        np.testing.assert_array_equal(got, want)


def test_processors_against_numpy():
    rng = np.random.RandomState(0)
    logits = rng.randn(3, 50).astype(np.float32)
    # top-k keeps exactly the k largest
    kept = np.isfinite(np.asarray(TopK(5)(jnp.asarray(logits))))
    for row, k in zip(logits, kept):
        assert set(np.flatnonzero(k)) == set(np.argsort(-row)[:5])
    # top-p keeps the smallest prefix of the sorted distribution whose mass reaches p
    kept = np.isfinite(np.asarray(TopP(0.8)(jnp.asarray(logits))))
    for row, k in zip(logits, kept):
        p = np.exp(row - row.max())
        p /= p.sum()
        order = np.argsort(-p)
        n = int(np.searchsorted(np.cumsum(p[order]), 0.8) + 1)
        assert set(np.flatnonzero(k)) == set(order[:n])
    # temperature: softmax(logits / t), each row shifted so its largest logit is 0
    np.testing.assert_allclose(Temperature(2.0)(jnp.asarray(logits)), (logits - logits.max(-1, keepdims=True)) / 2)
    both = compose([TopK(10), TopP(0.5)])(jnp.asarray(logits))
    assert np.isfinite(np.asarray(both)).sum(-1).max() <= 10
    # top-p near 1 against HF's definition in float64: the dropped tail's mass is at most 1 - p
    wide = rng.randn(200, 1000).astype(np.float32) * 2
    for p in (0.9999, 0.999999):
        kept = np.isfinite(np.asarray(TopP(p)(jnp.asarray(wide))))
        probs = np.exp(wide.astype(np.float64) - wide.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        for row, k in zip(probs, kept):
            order = np.argsort(row, kind="stable")  # ascending: the tail first
            dropped = np.cumsum(row[order]) <= 1 - p
            assert set(np.flatnonzero(k)) == set(order[~dropped]), p


def test_tiny_temperatures_sample_the_argmax(model):
    """t = 1e-8 is a point mass on the argmax: the same tokens as greedy decoding (unshifted,
    logits / t lost the largest entry to rounding and sampled token 0)."""
    prompts = [[1, 40 + i, 50 + i] for i in range(16)]
    greedy = jaxlm.generate(model, prompts, max_new_tokens=4, temperature=0.0)
    for t in (1e-8, 1e-20):
        near = jaxlm.generate(model, prompts, max_new_tokens=4, temperature=t, rng=3)
        np.testing.assert_array_equal(np.asarray(near.tokens), np.asarray(greedy.tokens))
        assert np.isfinite(np.asarray(near.sampling_logprobs)).all()
    with pytest.raises(ValueError, match="temperature=1e-35 is invalid: below 1e-30"):
        Temperature(1e-35)


def test_processor_classes_take_numpy_numbers_and_refuse_bools():
    from jaxlm.inference.logits_processors import TopK, TopP

    assert Temperature(np.float32(0.5)) == Temperature(0.5) and type(Temperature(np.int64(2)).t) is float
    assert TopP(np.float32(0.5)) == TopP(0.5) and TopK(np.int64(3)) == TopK(3)
    for bad in (True, np.True_, "0.5"):  # True == 1 would skip the filter silently
        with pytest.raises(ValueError, match="top_p=.* is invalid"):
            TopP(bad)
    for bad in (True, np.True_, "0.5", float("inf")):
        with pytest.raises(ValueError, match="temperature=.* is invalid"):
            Temperature(bad)


def test_user_processor_composes(model):
    """A pure (logits, state) -> logits function, e.g. a mask banning all but two tokens."""
    allowed = jnp.zeros(CFG.vocab_size, bool).at[jnp.array([11, 12])].set(True)

    def only_two(logits, state):
        return jnp.where(allowed, logits, -jnp.inf)

    result = jaxlm.generate(model, PROMPTS, max_new_tokens=6, logits_processors=[only_two], rng=1)
    assert set(np.unique(np.asarray(result.tokens))) <= {11, 12}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_step_with_no_allowed_token_is_an_error_not_a_nan_draw(model, temperature):
    """A processor that masks every token of a live row (here row 1 from its third token on)
    leaves nothing to draw: an error naming the row and the step, as HF's multinomial raises;
    rows that ended before that step are not affected."""
    def ban_row_one_late(logits, state):
        everything = (jnp.arange(logits.shape[0]) == 1)[:, None] & (state.step >= 2)
        return jnp.where(everything, -jnp.inf, logits)

    with pytest.raises(ValueError, match="row 1, generated token 2 was drawn from a distribution with no finite "
                                         "mass"):
        jaxlm.generate(model, PROMPTS, max_new_tokens=5, temperature=temperature, rng=0,
                       logits_processors=[ban_row_one_late])
    ok = jaxlm.generate(model, PROMPTS, max_new_tokens=2, temperature=temperature, rng=0,
                        logits_processors=[ban_row_one_late])  # ends before the ban
    assert np.isfinite(np.asarray(ok.sampling_logprobs)).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompts=[[1] * 60], max_new_tokens=10), "prompt length 60 \\+ max_new_tokens 10 = 70 exceeds ModelConfig.max_seq_len=64"),
        (dict(prompts=[[1, 2], []], max_new_tokens=2), "prompt 1 is empty"),
        (dict(prompts=[[1, 2, 999]], max_new_tokens=2), "prompt 0 has token ids \\[999\\] outside \\[0, vocab_size=259\\)"),
        (dict(prompts=["text"], max_new_tokens=2), "prompt 0 is text but no tokenizer is known"),
        (dict(prompts=[], max_new_tokens=2), "prompts is empty"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens=0 is invalid"),
        (dict(prompts=[[1]], max_new_tokens=2, temperature=-1.0), "temperature=-1.0 is invalid"),
        (dict(prompts=[[1]], max_new_tokens=2, top_k=0), "top_k=0 is invalid"),
        (dict(prompts=[[1]], max_new_tokens=2, top_p=1.5), "top_p=1.5 is invalid"),
        (dict(prompts=[[1]], max_new_tokens=2, stop_tokens=[300]), "stop_tokens \\[300\\] are outside"),
    ],
)
def test_bad_generate_inputs(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxlm.generate(model, **kwargs)


@dataclasses.dataclass
class _MutableProcessor:  # a plain (unfrozen) dataclass: not hashable
    token: int

    def __call__(self, logits, state):
        return logits.at[..., self.token].set(-jnp.inf)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompts=[[5.7, 9.2]]), TypeError, r"prompt 0 holds 5.7 \(float\): token ids must be ints"),
        (dict(prompts=np.array([[5.9, 9.99]])), TypeError, "dtype float64: token ids must be integers"),
        (dict(prompts=[5, 9, 200]), TypeError, r"prompts\[0\] is the id 5: .*wrap one prompt's ids as \[\[...\]\]"),
        (dict(prompts=[[1, True]]), TypeError, "token ids must be ints"),
        (dict(prompts=[[1]], pad_id=CFG.vocab_size), ValueError, r"pad_id=259 is outside \[0, vocab_size=259\)"),
        (dict(prompts=[[1]], stop_tokens=2), TypeError, r"stop_tokens=2 is invalid: must be a sequence of token ids"),
        (dict(prompts=[[1]], bucket=0), ValueError, "bucket=0 is invalid: must be a positive int"),
        (dict(prompts=[[1]], bucket=-8), ValueError, "bucket=-8 is invalid"),
        (dict(prompts=[[1]], rng="seed"), TypeError, "pass an int seed or a jax.random key"),
        (dict(prompts=[[1]], temperature=float("nan")), ValueError, "must be a finite number >= 0"),
        (dict(prompts=[[1]], top_p=True), ValueError, r"top_p=True is invalid"),  # == 1: the filter was skipped
        (dict(prompts=[[1]], top_p="0.5"), ValueError, r"top_p='0.5' is invalid"),
        (dict(prompts=[[1]], logits_processors=[_MutableProcessor(3)]), TypeError,
         r"logits_processors\[0\] \(_MutableProcessor\) is not hashable"),
    ],
)
def test_ill_typed_generate_inputs(model, kwargs, error, match):
    """Wrong types get an error naming the argument; nothing is truncated or read out of range."""
    with pytest.raises(error, match=match):
        jaxlm.generate(model, **{"max_new_tokens": 2, **kwargs})


def test_numpy_scalars_are_accepted(model):
    want = jaxlm.generate(model, [[1, 2]], max_new_tokens=3, temperature=0.5, rng=3)
    got = jaxlm.generate(model, np.array([[1, 2]], np.int32), max_new_tokens=3, temperature=np.float32(0.5),
                         rng=np.int64(3), stop_tokens=jnp.array([7]))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(jaxlm.generate(
        model, [[1, 2]], max_new_tokens=3, temperature=0.5, rng=3, stop_tokens=(7,)).tokens))
    assert want.tokens.shape == got.tokens.shape
    listed = jaxlm.generate(model, [jnp.array([1, 2]), np.array([1, 2])], max_new_tokens=3, temperature=0.5, rng=3,
                            stop_tokens=np.array([7]))
    np.testing.assert_array_equal(np.asarray(listed.tokens[0]), np.asarray(got.tokens[0]))
    # integer settings as numpy scalars (what an array's element or a config read from numpy gives)
    ints = jaxlm.generate(model, [[1, 2]], max_new_tokens=np.int64(3), temperature=0.5, rng=3, top_k=np.int32(5),
                          decode_segments=np.int64(2), top_p=np.float32(0.9))
    np.testing.assert_array_equal(np.asarray(ints.tokens), np.asarray(jaxlm.generate(
        model, [[1, 2]], max_new_tokens=3, temperature=0.5, rng=3, top_k=5, decode_segments=2, top_p=0.9).tokens))
    beams = jaxlm.generate(model, [[1, 2]], max_new_tokens=np.int64(3), num_beams=np.int64(2),
                           num_return_sequences=np.int64(2))
    assert beams.tokens.shape == (2, 3)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_batched_greedy_equals_per_row_decoding(scan_layers):
    """Each row of a batched greedy decode (left-padded, one cache per layer or the scanned
    stacked cache) is what decoding its prompt alone gives, and equals a cache-free
    recomputation of every prefix."""
    model = jaxlm.build_model(CFG.replace(scan_layers=scan_layers), seed=2)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda t, m: nnx.merge(graphdef, params)(t, mask=m).logits)
    n = 10
    batched = jaxlm.generate(model, PROMPTS, max_new_tokens=n, temperature=0)
    seqs = batched.sequences()
    tokens, mask = _left_pad(seqs)
    logits = np.asarray(forward(tokens, mask))
    T = tokens.shape[1]
    decoded_logits = logits[:, T - n - 1: T - 1]
    # A log-prob is logit - logsumexp(logits): its float32 rounding error is set by the
    # spacing of floats at the logits' magnitude, not at |logprob|. Batch 4 and batch 1 run
    # the same math through differently blocked XLA:CPU GEMMs, so the two decodes agree to
    # a few tens of float32 steps at that magnitude over ten cached steps (measured: up to
    # 20 steps at max|logit| ~ 14, about 2e-5). The tokens must still match exactly.
    logprob_tol = 32 * np.spacing(np.float32(np.abs(decoded_logits).max()))
    for b, prompt in enumerate(PROMPTS):
        alone = jaxlm.generate(model, [prompt], max_new_tokens=n, temperature=0, bucket=1)
        np.testing.assert_array_equal(np.asarray(batched.tokens[b]), np.asarray(alone.tokens[0]))
        np.testing.assert_allclose(
            np.asarray(batched.logprobs[b]), np.asarray(alone.logprobs[0]), rtol=0, atol=logprob_tol
        )
    np.testing.assert_array_equal(decoded_logits.argmax(-1), np.asarray(batched.tokens))
    assert len({tuple(r) for r in np.asarray(batched.tokens)}) == len(PROMPTS)


def test_final_cache_keeps_the_stacked_layout_and_equals_a_prefill(model):
    """The decode loop keeps one buffer per layer; the returned cache is the model's stacked
    ``[L, B, K, S, H]`` layout and holds what a prefill of prompt + completion writes."""
    from jaxlm.inference import KVCache, generate_tokens

    graphdef, params = nnx.split(model)
    tokens, mask = _left_pad(PROMPTS)
    n = 5
    final = generate_tokens(graphdef, params, tokens, mask, jax.random.key(0), max_new_tokens=n, greedy=True)
    B, P = tokens.shape
    assert final.cache.k.shape == (CFG.n_layers, B, CFG.n_kv_heads, P + n, CFG.head_dim)
    # the last generated token is chosen but never fed back, so the cache holds P + n - 1 tokens
    seq = jnp.concatenate([tokens, final.tokens[:, : n - 1]], axis=1)
    seq_mask = jnp.concatenate([mask, jnp.ones((B, n - 1), bool)], axis=1)
    pre = model.backbone(seq, cache=KVCache.init(CFG, B, P + n), mask=seq_mask).cache
    valid = np.asarray(seq_mask)
    for got, want in ((final.cache.k, pre.k), (final.cache.v, pre.v)):
        got, want = np.asarray(got)[:, :, :, : P + n - 1], np.asarray(want)[:, :, :, : P + n - 1]
        got, want = got.transpose(1, 3, 0, 2, 4)[valid], want.transpose(1, 3, 0, 2, 4)[valid]
        # one prefill vs token-by-token: float32 rounding, relative to the keys' scale (~7)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(final.cache.valid)[:, : P + n - 1], valid)


def test_per_layer_cache_needs_unrolled_layers():
    with pytest.raises(ValueError, match="per_layer=True.*scan_layers=False"):
        jaxlm.KVCache.init(CFG.replace(scan_layers=True), 1, 8, per_layer=True)
    cache = jaxlm.KVCache.init(CFG, 2, 8, per_layer=True)
    assert cache.is_per_layer and len(cache.k) == CFG.n_layers and cache.k[0].shape == (2, CFG.n_kv_heads, 8, CFG.head_dim)
    assert cache.stacked().k.shape == (CFG.n_layers, 2, CFG.n_kv_heads, 8, CFG.head_dim)


def test_sampled_tokens_are_the_documented_inverse_cdf_draws(model, full_forward):
    """Sampling at temperature 1 draws, at step i, ``rng, key = split(rng)``, ``k_block, k_token =
    split(key)`` and one uniform from each: a block of 128 tokens by its mass, then a token in it.
    Replayed in float64 numpy from a cache-free forward pass, the same uniforms give the same
    tokens (so a seed keeps giving the same samples)."""
    n = 8
    rng = jax.random.key(11)
    result = jaxlm.generate(model, PROMPTS, max_new_tokens=n, rng=rng, stop_tokens=[])
    seqs = result.sequences()
    tokens, mask = _left_pad(seqs)
    logits = np.asarray(full_forward(tokens, mask), np.float64)
    T = tokens.shape[1]
    B, V = len(PROMPTS), CFG.vocab_size
    for i in range(n):
        rng, key = jax.random.split(rng)
        k_block, k_token = jax.random.split(key)
        u_block = np.asarray(jax.random.uniform(k_block, (B, 1)), np.float64)[:, 0]
        u_token = np.asarray(jax.random.uniform(k_token, (B, 1)), np.float64)[:, 0]
        step = logits[:, T - n - 1 + i]
        mass = np.exp(step - step.max(-1, keepdims=True))
        mass = np.pad(mass, ((0, 0), (0, (-V) % 128))).reshape(B, -1, 128)
        for b in range(B):
            cdf = np.cumsum(mass[b].sum(-1))
            block = int(np.argmax(cdf > u_block[b] * cdf[-1]))
            inner = np.cumsum(mass[b, block])
            assert int(result.tokens[b, i]) == block * 128 + int(np.argmax(inner > u_token[b] * inner[-1]))


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.split("\n"):
        if line.rstrip().endswith("{") and line.lstrip().startswith(("%", "ENTRY %")):
            name = line.split("%", 1)[1].split(" ", 1)[0]
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def test_decode_loop_copies_no_cache_buffer(model):
    """In the compiled decode loop every value shaped like a layer's cache buffer [B, K, S, H] is a
    loop-carried buffer or its in-place dynamic-update-slice: no copy or slice of the cache per
    token (the per-layer buffers of the unrolled model)."""
    import re

    from jaxlm.inference import generate_tokens

    graphdef, params = nnx.split(model)
    tokens, mask = _left_pad(PROMPTS)
    n = 6
    hlo = generate_tokens.lower(graphdef, params, tokens, mask, jax.random.key(0), max_new_tokens=n,
                                greedy=True).compile().as_text()
    comps = _computations(hlo)
    entry = next(lines for name, lines in comps.items() if f"ENTRY %{name}" in hlo)
    bodies = [m.group(1) for line in entry for m in [re.search(r"while\(.*body=%([^,\s]+)", line)] if m]
    shape = f"f32[{len(PROMPTS)},{CFG.n_kv_heads},{tokens.shape[1] + n},{CFG.head_dim}]"
    body = comps[bodies[-1]]  # the decode loop (the last while of the program)
    users = [line for line in body if re.search(r"= " + re.escape(shape) + r"[{ ]", line)]
    assert len(users) >= 2 * CFG.n_layers, users  # the k and v writes of every layer
    for line in users:
        op = re.search(r"= \S+ ([a-z\-]+)\(", line).group(1)
        if op in ("get-tuple-element", "parameter", "bitcast"):
            continue
        assert op == "fusion", line
        fused = comps[re.search(r"calls=%([^,\s]+)", line).group(1)]
        assert any("dynamic-update-slice(" in f for f in fused), line
