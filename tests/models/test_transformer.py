"""Transformer forward: layer stacking, KV cache, masks, collected tensors, bad inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.params import flat_params, model_from_flat

CFG = jaxlm.ModelConfig.tiny(qkv_bias=True, qk_norm=True, sliding_window=6)


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(CFG, seed=1)


@pytest.fixture(scope="module")
def forward(model):
    graphdef, params = nnx.split(model)

    @jax.jit
    def f(params, tokens, mask):
        return nnx.merge(graphdef, params)(tokens, mask=mask, collect=("hidden", "attn_probs", "q"))

    return lambda tokens, mask: f(params, tokens, mask)


def _batch(B=3, T=12, seed=0):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randint(0, CFG.vocab_size, (B, T)), jnp.int32)
    mask = np.ones((B, T), bool)
    if B > 1:
        mask[1, :4] = False
    return tokens, jnp.asarray(mask)


def test_scanned_layers_equal_unrolled(model, forward):
    tokens, mask = _batch()
    scanned = model_from_flat(CFG.replace(scan_layers=True), flat_params(model))
    a = forward(tokens, mask)
    b = scanned(tokens, mask=mask, collect=("hidden", "attn_probs", "q"))
    np.testing.assert_allclose(a.logits, b.logits, atol=1e-5)
    for name in a.collected:
        np.testing.assert_allclose(a.collected[name], b.collected[name], atol=1e-5, err_msg=name)


def test_collected_shapes_and_prob_rows(forward):
    tokens, mask = _batch()
    out = forward(tokens, mask)
    L, B, T = CFG.n_layers, *tokens.shape
    assert out.collected["hidden"].shape == (L, B, T, CFG.d_model)
    assert out.collected["q"].shape == (L, B, T, CFG.n_heads, CFG.head_dim)
    probs = np.asarray(out.collected["attn_probs"])
    assert probs.shape == (L, B, CFG.n_heads, T, T)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    # causal + sliding window (6) + padding: real queries see nothing above the diagonal,
    # nothing 6+ back and no pad key (pad queries see no key at all: uniform, unused rows)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    hidden_keys = (j > i) | (i - j >= 6)
    assert np.all(probs[:, [0, 2]][..., hidden_keys] == 0)
    assert np.all(probs[:, 1, :, 4:][..., hidden_keys[4:]] == 0)
    assert np.all(probs[:, 1, :, 4:, :4] == 0)


def test_padding_does_not_change_real_tokens(forward):
    """A left-padded row equals the same tokens run alone without padding."""
    tokens, mask = _batch()
    padded = forward(tokens, mask).logits[1, 4:]
    alone = forward(tokens[1:2, 4:], jnp.ones((1, 8), bool)).logits[0]
    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_cache_prefill_then_decode_equals_full_forward(model):
    tokens, mask = _batch(T=12)
    full = model(tokens, mask=mask).logits
    step = jax.jit(lambda m, tokens, cache: m(tokens, cache=cache))
    cache = model.init_cache(tokens.shape[0], 16)
    out = model(tokens[:, :7], mask=mask[:, :7], cache=cache)
    logits = [out.logits]
    cache = out.cache
    for t in range(7, 12):
        out = step(model, tokens[:, t : t + 1], cache)
        cache = out.cache
        logits.append(out.logits)
    stepped = jnp.concatenate(logits, axis=1)
    np.testing.assert_allclose(np.asarray(stepped)[mask], np.asarray(full)[mask], atol=1e-5)
    assert int(cache.end_index) == 12
    np.testing.assert_array_equal(cache.lengths, mask.sum(1))
    np.testing.assert_array_equal(cache.valid[:, :12], mask)


def test_padding_between_cached_and_new_tokens_takes_no_room_in_the_window(model):
    """A padded chunk appended to a cache (``[pad, pad, x, y, z]``): the sliding window (6)
    counts real tokens, so the result equals the real tokens run alone in one forward."""
    tokens, mask = _batch(T=12)
    cache = model(tokens[:, :7], mask=mask[:, :7], cache=model.init_cache(3, 16)).cache
    chunk_mask = jnp.asarray(np.array([[False, False, True, True, True]] * 3))
    out = model(tokens[:, 7:], mask=chunk_mask, cache=cache).logits
    for b in range(3):
        real = np.concatenate([np.asarray(tokens[b, :7])[np.asarray(mask[b, :7])], np.asarray(tokens[b, 9:])])
        alone = model(jnp.asarray(real)[None]).logits[0, -3:]
        np.testing.assert_allclose(np.asarray(out[b, 2:]), np.asarray(alone), atol=1e-5)


def test_explicit_full_mask_is_used_as_given(model):
    """A bidirectional mask lets the first token see the last one; a causal one does not."""
    tokens, _ = _batch(B=1, T=8)
    causal = model(tokens).logits
    bidir = model(tokens, mask=jnp.ones((1, 8, 8), bool)).logits
    explicit_causal = model(tokens, mask=jnp.tril(jnp.ones((1, 1, 8, 8), bool))).logits
    # the sliding window only applies to the implicit causal mask, so compare the first 6 tokens
    np.testing.assert_allclose(explicit_causal[:, :6], causal[:, :6], atol=1e-5)
    assert np.abs(np.asarray(bidir[:, 0] - causal[:, 0])).max() > 1e-4
    # 0/1 integers read as bool; an additive float mask (HF's 0 / -inf) read inverted, silently
    as_int = model(tokens, mask=jnp.tril(jnp.ones((1, 1, 8, 8), jnp.int32))).logits
    np.testing.assert_array_equal(np.asarray(as_int), np.asarray(explicit_causal))
    additive = jnp.where(jnp.tril(jnp.ones((1, 1, 8, 8), bool)), 0.0, -jnp.inf)
    with pytest.raises(TypeError, match="a full mask must be bool .* an additive float mask"):
        model(tokens, mask=additive)
    with pytest.raises(ValueError, match=f"mask \\[B, 1\\|N, T, S\\] has 3 heads; the model has n_heads={CFG.n_heads}"):
        model(tokens, mask=jnp.ones((1, 3, 8, 8), bool))  # a bare reshape error, or read per K/V head


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_values_and_gradients(model, remat):
    tokens, mask = _batch()
    other = model_from_flat(CFG.replace(remat=remat), flat_params(model))

    def loss(m):
        return jnp.mean(m(tokens, mask=mask).logits ** 2)

    grad = jax.jit(nnx.grad(loss))
    g1 = grad(model)
    g2 = grad(other)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_bad_inputs(model):
    tokens, mask = _batch()
    with pytest.raises(ValueError, match="collect=\\['hiden'\\] is invalid"):
        model(tokens, collect=("hiden",))
    with pytest.raises(TypeError, match="tokens must be integer ids"):
        model(tokens.astype(jnp.float32))
    with pytest.raises(AssertionError):  # chex: rank
        model(tokens[0])
    with pytest.raises(AssertionError):  # chex: positions shape
        model(tokens, jnp.zeros((3, 5), jnp.int32))
    with pytest.raises(ValueError, match="mask must be"):
        model(tokens, mask=jnp.ones((12,), bool))
    cache = model.init_cache(3, 8)
    with pytest.raises(ValueError, match="cache overflow: writing 12 tokens at slot 0 exceeds the cache length 8"):
        model(tokens, cache=cache)
    with pytest.raises(ValueError, match="max_len=999 exceeds ModelConfig.max_seq_len=256"):
        model.init_cache(1, 999)


def test_linear_dispatch_accepts_new_weight_types():
    """A registered weight type flows through the unchanged model (the quantization hook)."""
    from jaxlm.models.layers.linear import linear

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Scaled:  # a toy structured weight: w = s * m
        m: jax.Array
        s: jax.Array

    linear.register(Scaled)(lambda x, w: jnp.dot(x, (w.s * w.m).astype(x.dtype)))
    model = jaxlm.build_model(CFG, seed=2)
    tokens, mask = _batch()
    before = model(tokens, mask=mask).logits
    kernel = model.layers[0].mlp.up_proj.kernel
    kernel.set_value(Scaled(kernel.get_value() / 2, jnp.asarray(2.0)))
    after = jax.jit(lambda m: m(tokens, mask=mask).logits)(model)
    np.testing.assert_allclose(after, before, atol=1e-6)


def test_scan_keeps_program_size_independent_of_depth():
    """With scan_layers the compiled program holds one block whatever the depth;
    unrolled, it grows with every layer."""

    def program_size(cfg):
        model = jaxlm.abstract_model(cfg)
        graphdef, params = nnx.split(model)
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        lowered = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits).lower(params, tokens)
        return len(lowered.as_text())

    small = jaxlm.ModelConfig.tiny(n_layers=2)
    deep = jaxlm.ModelConfig.tiny(n_layers=12)
    scanned = program_size(deep.replace(scan_layers=True)) / program_size(small.replace(scan_layers=True))
    unrolled = program_size(deep) / program_size(small)
    assert scanned < 1.05
    assert unrolled > 3


@pytest.mark.parametrize("tie", [True, False])
def test_bf16_logits_are_accumulated_and_returned_in_float32(tie):
    """With bf16 compute the LM head multiplies bf16 hidden states by the bf16-cast head, but
    sums and returns in float32 (tied or not): the untied head returned bf16-rounded logits
    (up to ~2e-3 apart at |logit| 0.5), so stored teacher log-probs differed from the
    distillation loss's own."""
    cfg = jaxlm.ModelConfig.tiny(vocab_size=300, tie_embeddings=tie, dtype="bfloat16")
    model = jaxlm.build_model(cfg)
    out = model(jnp.array([[1, 5, 7, 9, 11, 13]]))
    head = model.embed[...].T if tie else model.lm_head.kernel.get_value()
    as64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)  # noqa: E731
    want = as64(out.hidden) @ as64(jnp.asarray(head).astype(jnp.bfloat16))
    assert out.logits.dtype == jnp.float32
    np.testing.assert_allclose(as64(out.logits), want, atol=1e-6)


def test_a_cache_overflow_under_jit_reads_nan_not_wrong_numbers(model):
    """Eagerly an overflowing write raises; under jit it cannot, and the write clamps onto the
    last slots: the rows that overflowed read NaN, the others stay exact (per-row slots)."""
    tokens, _ = _batch(T=7)
    B = tokens.shape[0]
    full = model(tokens[:, :6], cache=model.init_cache(B, 6)).cache  # every slot written
    with pytest.raises(ValueError, match="cache overflow"):
        model(tokens[:, 6:7], cache=full)
    step = jax.jit(lambda m, t, c: m(t, cache=c).logits)
    assert np.isnan(np.asarray(step(model, tokens[:, 6:7], full))).all()
    # per-row write slots: row 0 rolled back one token has room, the others do not
    rows = full.per_row().truncate(jnp.array([5] + [6] * (B - 1)), jnp.array([5] + [6] * (B - 1)))
    logits = np.asarray(step(model, tokens[:, 5:6], rows))
    want = np.asarray(model(tokens[:1, :6]).logits)[0, 5]
    np.testing.assert_allclose(logits[0, 0], want, atol=1e-5)
    assert np.isnan(logits[1:]).all()
