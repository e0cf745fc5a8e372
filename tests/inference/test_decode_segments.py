"""The batched decode step's fast paths: `argmax_last` and `first_true` against numpy, and a
decode loop split into segments over a growing KV cache, which must give what one loop over
the full cache gives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.inference import KVCache, generate_tokens
from jaxlm.inference.sampler import auto_decode_segments, segment_ends
from jaxlm.inference.sampling import argmax_last, first_true

CFG = jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=64)
PROMPTS = [[5, 9, 200, 17], [3], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53], [100, 7]]


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(CFG, seed=0)


def _rows(rng, V, kind):
    x = rng.integers(-3, 3, (6, V)).astype(np.float32)  # small integers: many ties for the maximum
    if kind == "nan":
        x[rng.random(x.shape) < 0.05] = np.nan
        x[0, -1] = np.nan  # a NaN in the last (padded) block
    elif kind == "inf":
        x[rng.random(x.shape) < 0.3] = -np.inf
        x[0] = -np.inf  # a row of -inf only
        x[1, V // 2] = np.inf
        x[2, V - 1] = np.inf
    elif kind == "mixed":  # +inf and -inf in blocks before a row's first NaN; NaN after +inf
        x[rng.random(x.shape) < 0.2] = -np.inf
        x[:, 0] = np.inf
        x[:3, -1] = np.nan
        x[3, V // 2] = np.nan
    elif kind == "normal":
        x = rng.normal(size=(6, V)).astype(np.float32)
    return x


@pytest.mark.parametrize("V", [1, 128, 129, 1000])
@pytest.mark.parametrize("kind", ["ties", "nan", "inf", "mixed", "normal"])
def test_argmax_last_equals_numpy_argmax(V, kind):
    """First index of the maximum, a NaN counting as the largest (numpy's and jnp's rule), for
    every vocabulary size (blocks of 128, a padded last block), eager, jitted and vmapped."""
    x = _rows(np.random.default_rng(V), V, kind)
    want = np.argmax(x, axis=-1)
    np.testing.assert_array_equal(np.asarray(argmax_last(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax_last)(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(argmax_last)(x[:, None])[:, 0]), want)
    assert argmax_last(x).dtype == jnp.int32


def test_argmax_last_keeps_leading_axes():
    x = np.random.default_rng(0).normal(size=(2, 3, 700)).astype(np.float32)
    got = argmax_last(x)
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(got), x.argmax(-1))


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.float16])
def test_argmax_last_other_dtypes(dtype):
    """Integer rows (padded with the type's minimum, ties with it included) and half floats."""
    rng = np.random.default_rng(2)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.min + 3, size=(6, 300)).astype(dtype)  # many ties at the minimum
        x[0] = info.min
    else:
        x = rng.normal(size=(6, 300)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax_last)(x)), x.argmax(-1))


def test_first_true_against_numpy():
    hit = np.random.default_rng(1).random((50, 37)) < 0.05
    hit[0] = False  # no True: the length
    want = np.where(hit.any(-1), hit.argmax(-1), hit.shape[-1])
    np.testing.assert_array_equal(np.asarray(jax.jit(first_true)(hit)), want)


def test_segment_ends_and_their_errors():
    assert segment_ends(128, 4) == (32, 64, 96, 128)
    assert segment_ends(10, 3) == (4, 7, 10)
    assert segment_ends(3, 8) == (1, 2, 3)  # never an empty segment
    assert segment_ends(7, 1) == (7,)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="decode_segments=.* is invalid: must be a positive int or None"):
            segment_ends(8, bad)
        # generate_tokens (public) failed on ends[0] of an empty tuple
        with pytest.raises(ValueError, match=f"max_new_tokens={bad!r} is invalid: must be a positive int"):
            segment_ends(bad, 2)


def test_auto_segments_split_only_large_caches():
    """Small caches (tests, batch 1) keep one loop; the benchmark's batch-64 cache (84 MB of
    float32 keys and values) gets the maximum; short generations are never split finely."""
    assert auto_decode_segments(CFG, 4, 16, 32) == 1
    bench = jaxlm.ModelConfig.tiny(d_model=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=1024,
                                   vocab_size=512, max_seq_len=160)
    assert auto_decode_segments(bench, 1, 32, 128) == 1  # 1.3 MB
    assert auto_decode_segments(bench, 64, 32, 128) == 4  # 84 MB
    assert auto_decode_segments(bench, 64, 32, 40) == 1  # fewer than 2 x 32 new tokens
    assert auto_decode_segments(bench, 64, 32, 128, cache_dtype="bfloat16") == 4


def test_cache_grows_with_empty_slots():
    for per_layer in (False, True):
        cache = KVCache.init(CFG, 2, 8, per_layer=per_layer)
        k = jax.tree.map(lambda x: x + 1.0, cache.k)
        cache = cache.replace(k=k, valid=cache.valid.at[:, :3].set(True), end_index=jnp.asarray(3, jnp.int32))
        grown = cache.grow(12)
        assert grown.max_len == 12 and grown.valid.shape == (2, 12)
        np.testing.assert_array_equal(np.asarray(grown.valid[:, :8]), np.asarray(cache.valid))
        assert not np.asarray(grown.valid[:, 8:]).any()
        for old, new in zip(jax.tree.leaves(cache.k), jax.tree.leaves(grown.k)):
            np.testing.assert_array_equal(np.asarray(new)[..., :8, :], np.asarray(old))
            assert not np.asarray(new)[..., 8:, :].any()
        assert int(grown.end_index) == 3 and grown.grow(12) is grown
        with pytest.raises(ValueError, match="would shrink the cache of 12 slots"):
            grown.grow(4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_segmented_decode_equals_one_loop(model, temperature):
    """Any number of segments gives one loop's tokens, log-probs (to float32 rounding: only
    the number of masked slots in each softmax differs) and lengths, greedy and sampled (the
    same draws); greedy also with stop tokens that end rows early, and with groups of samples
    per prompt and a final cache of full length."""
    n = 10
    kw = dict(max_new_tokens=n, temperature=temperature, rng=5, bucket=1)
    one = jaxlm.generate(model, PROMPTS, decode_segments=1, **kw)
    stop = int(one.tokens[1, 3])
    # a log-prob is logit - logsumexp(logits): its float32 rounding follows the spacing of
    # floats at the logits' magnitude; each segment's softmax sums a different number of
    # masked (exactly zero) terms, so XLA:CPU may order the sum differently
    seqs = one.sequences()
    width = max(map(len, seqs))
    padded = np.array([[0] * (width - len(s)) + s for s in seqs])
    present = np.array([[0] * (width - len(s)) + [1] * len(s) for s in seqs], bool)
    top = float(np.abs(np.asarray(model(jnp.asarray(padded), mask=jnp.asarray(present)).logits)).max())
    tol = 32 * np.spacing(np.float32(top))
    for segments in ((3, 10) if temperature == 0 else (3,)):
        split = jaxlm.generate(model, PROMPTS, decode_segments=segments, **kw)
        np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(one.tokens))
        np.testing.assert_allclose(np.asarray(split.logprobs), np.asarray(one.logprobs), rtol=0, atol=tol)
        np.testing.assert_array_equal(np.asarray(split.lengths), n)
    if temperature:
        return
    a = jaxlm.generate(model, PROMPTS, decode_segments=1, stop_tokens=[stop], **kw)
    b = jaxlm.generate(model, PROMPTS, decode_segments=4, stop_tokens=[stop], **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    assert int(a.lengths[1]) == 4

    graphdef, params = nnx.split(model)
    block, mask = np.zeros((2, 10), np.int32), np.zeros((2, 10), bool)
    for r, p in enumerate(PROMPTS[2:]):
        block[r, 10 - len(p):], mask[r, 10 - len(p):] = p, True
    finals = [generate_tokens(graphdef, params, jnp.asarray(block), jnp.asarray(mask), jax.random.key(1),
                              max_new_tokens=n, greedy=True, samples_per_prompt=3, decode_segments=s)
              for s in (1, 3)]
    np.testing.assert_array_equal(np.asarray(finals[0].tokens), np.asarray(finals[1].tokens))
    assert finals[1].cache.k.shape == finals[0].cache.k.shape == (CFG.n_layers, 6, CFG.n_kv_heads, 10 + n, CFG.head_dim)
    valid = np.asarray(finals[0].cache.valid)
    np.testing.assert_array_equal(np.asarray(finals[1].cache.valid), valid)
    got, want = (np.asarray(f.cache.k).transpose(1, 3, 0, 2, 4)[valid] for f in finals)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_segmented_decode_input_errors(model):
    with pytest.raises(ValueError, match="decode_segments=0 is invalid"):
        jaxlm.generate(model, PROMPTS, max_new_tokens=4, decode_segments=0)
    with pytest.raises(ValueError, match="decode_segments= applies to the plain decode loop"):
        jaxlm.generate(model, PROMPTS, max_new_tokens=4, decode_segments=2, draft=model)


def test_each_segment_reads_only_its_own_cache_length(model):
    """In the compiled program each segment's loop carries a cache of its own length (prompt +
    the tokens it can reach), never the full one, and updates it in place."""
    graphdef, params = nnx.split(model)
    block, mask = np.zeros((len(PROMPTS), 10), np.int32), np.zeros((len(PROMPTS), 10), bool)
    for r, p in enumerate(PROMPTS):
        block[r, 10 - len(p):], mask[r, 10 - len(p):] = p, True
    n = 12
    hlo = generate_tokens.lower(graphdef, params, jnp.asarray(block), jnp.asarray(mask), jax.random.key(0),
                                max_new_tokens=n, greedy=True, decode_segments=3).compile().as_text()
    whiles = re.findall(r"= \((.*?)\) while\(", hlo)
    lengths = []
    for carried in whiles:
        slots = {int(s) for s in re.findall(rf"f32\[{len(PROMPTS)},{CFG.n_kv_heads},(\d+),{CFG.head_dim}\]", carried)}
        assert len(slots) <= 1, carried
        lengths += sorted(slots)
    assert sorted(lengths) == [10 + 4, 10 + 8, 10 + 12]
