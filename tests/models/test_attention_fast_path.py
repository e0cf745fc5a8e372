"""The probability-free attention paths (`attention_context`: chunked, jax.nn XLA) against a numpy
reference and the reference einsum path: values and gradients, GQA/MQA, left padding, cache
decoding with partially valid slots, sliding windows, packed segments, rows with no visible key,
bf16; the automatic switch (probabilities only when asked for) and its memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.layers import attention as attn_lib
from jaxlm.models.layers.attention import (
    attention_context, chunked_attention, dot_product_attention, resolve_attention_impl,
)
from jaxlm.models.masks import build_attention_mask, segment_mask

FAST = ("chunked", "xla")


def numpy_attention(q, k, v, mask, scale):
    """float64 masked softmax attention; q [B,T,N,H], k/v [B,K,S,H], mask [B,1|N,T,S]. Rows with
    no visible key get uniform weights over all S slots (the documented convention)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    K = k.shape[1]
    k = np.repeat(k, N // K, axis=1)  # head n uses KV head n // G
    v = np.repeat(v, N // K, axis=1)
    mask = np.broadcast_to(np.asarray(mask, bool), (B, N, T, k.shape[2]))
    scores = np.einsum("btnh,bnsh->bnts", q, k) * scale
    scores = np.where(mask, scores, -np.inf)
    none_visible = ~mask.any(-1, keepdims=True)
    scores = np.where(none_visible, 0.0, scores)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsh->btnh", w, v)


def _qkv(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(B, T, N, H), dtype)
    k = jnp.asarray(rng.randn(B, K, S, H), dtype)
    v = jnp.asarray(rng.randn(B, K, S, H), dtype)
    return q, k, v


def _left_padded_causal(B, T, pads):
    valid = jnp.asarray(np.arange(T)[None, :] >= np.asarray(pads)[:, None])
    return build_attention_mask(kv_valid=valid, q_start=0, num_queries=T)


def _cases():
    """name -> (q, k, v, mask); every case has some rows with no visible key except 'gqa_causal'."""
    B, T, H = 3, 20, 16
    cases = {}
    q, k, v = _qkv(B, T, T, 4, 2, H)
    cases["gqa_causal"] = (q, k, v, build_attention_mask(kv_valid=jnp.ones((B, T), bool), q_start=0, num_queries=T))
    q, k, v = _qkv(B, T, T, 4, 4, H, seed=1)
    cases["mha_left_padded"] = (q, k, v, _left_padded_causal(B, T, [0, 5, 13]))
    q, k, v = _qkv(B, T, T, 4, 1, H, seed=2)
    cases["mqa_left_padded"] = (q, k, v, _left_padded_causal(B, T, [2, 0, 19]))
    # decoding 3 new tokens at slots 9..11 of a 16-slot cache; rows' prompts left-padded, the
    # slots after the write index not yet valid
    S = 16
    q, k, v = _qkv(B, 3, S, 4, 2, H, seed=3)
    valid = np.zeros((B, S), bool)
    valid[0, :12] = True
    valid[1, 4:12] = True
    valid[2, 8:12] = True
    cases["cache_decode"] = (q, k, v, build_attention_mask(kv_valid=jnp.asarray(valid), q_start=9, num_queries=3))
    q, k, v = _qkv(B, T, T, 4, 2, H, seed=4)
    valid = jnp.asarray(np.arange(T)[None, :] >= np.array([[0], [3], [7]]))
    cases["sliding_window"] = (q, k, v, build_attention_mask(kv_valid=valid, q_start=0, num_queries=T, sliding_window=4))
    seg = np.array([[1] * 7 + [2] * 9 + [0] * 4, [1] * 20, [0] * 3 + [1] * 5 + [2] * 5 + [3] * 7])
    q, k, v = _qkv(B, T, T, 4, 2, H, seed=5)
    full = segment_mask(jnp.asarray(seg))
    cases["packed_segments"] = (q, k, v, build_attention_mask(kv_valid=jnp.ones((B, T), bool), q_start=0,
                                                              num_queries=T, full_mask=full))
    q, k, v = _qkv(B, T, T, 4, 2, H, seed=6)
    head_mask = np.random.RandomState(7).rand(B, 4, T, T) > 0.5  # a per-head mask, some rows empty
    head_mask[:, :, 3] = False
    cases["per_head_mask"] = (q, k, v, jnp.asarray(head_mask))
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", FAST + ("reference",))
def test_context_matches_numpy(name, impl, monkeypatch):
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 8)  # several blocks and a padded last one (T = 20)
    q, k, v, mask = CASES[name]
    scale = q.shape[-1] ** -0.5
    got = jax.jit(lambda *a: attention_context(*a, scale=scale, impl=impl))(q, k, v, mask)
    want = numpy_attention(q, k, v, mask, scale)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", FAST)
def test_context_equals_reference_path(name, impl, monkeypatch):
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 8)
    q, k, v, mask = CASES[name]
    scale = q.shape[-1] ** -0.5
    ref = dot_product_attention(q, k, v, mask, scale=scale)[0]
    got = attention_context(q, k, v, mask, scale=scale, impl=impl)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)


def test_rows_with_no_visible_key_get_the_mean_of_all_values():
    """Left-padding query rows see no key: every path gives them uniform weights over all S
    slots (the reference's convention), finite, never NaN."""
    q, k, v, mask = CASES["mha_left_padded"]  # row 2 is padded for its first 13 queries
    assert not np.asarray(mask)[2, 0, :13].any()
    mean_v = np.asarray(v, np.float64).mean(axis=2)  # [B, K, H]
    for impl in FAST + ("reference",):
        got = np.asarray(attention_context(q, k, v, mask, scale=0.25, impl=impl))
        np.testing.assert_allclose(got[2, :13], np.broadcast_to(mean_v[2], (13, 4, 16)), atol=2e-6)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("name", ["gqa_causal", "mqa_left_padded", "cache_decode", "packed_segments"])
def test_gradients_equal_reference_path(name, impl, monkeypatch):
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 8)
    q, k, v, mask = CASES[name]
    w = jnp.asarray(np.random.RandomState(9).randn(*q.shape[:-1], v.shape[-1]), jnp.float32)
    scale = q.shape[-1] ** -0.5

    def loss(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))

    ref = loss(lambda q, k, v: dot_product_attention(q, k, v, mask, scale=scale)[0])(q, k, v)
    got = loss(lambda q, k, v: attention_context(q, k, v, mask, scale=scale, impl=impl))(q, k, v)
    for g, r in zip(got, ref):
        assert float(jnp.max(jnp.abs(r))) > 1e-3  # a real gradient
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5)


@pytest.mark.parametrize("impl", FAST)
def test_bf16(impl, monkeypatch):
    """bf16 inputs: the fast paths equal the bf16 reference path to bf16 rounding, and all of them
    are within bf16 accuracy of the float64 numpy reference."""
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 8)
    q, k, v, mask = CASES["mqa_left_padded"]
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5
    ref = dot_product_attention(q, k, v, mask, scale=scale)[0]
    got = attention_context(q, k, v, mask, scale=scale, impl=impl)
    assert got.dtype == jnp.bfloat16
    want = numpy_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask, scale)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), atol=1.6e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


def test_chunked_block_sizes_agree():
    q, k, v, mask = CASES["packed_segments"]
    ref = dot_product_attention(q, k, v, mask, scale=0.25)[0]
    for chunk in (1, 3, 8, 20, 64):
        got = chunked_attention(q, k, v, mask, scale=0.25, chunk=chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)


def test_resolve_attention_impl(monkeypatch):
    q, k, v = _qkv(1, attn_lib.QUERY_CHUNK + 1, attn_lib.QUERY_CHUNK + 1, 4, 2, 16)
    one = q[:, :1]
    assert resolve_attention_impl("auto", q, k, v, need_probs=True) == "reference"
    assert resolve_attention_impl("xla", q, k, v, need_probs=True) == "reference"
    assert resolve_attention_impl("auto", q, k, v, need_probs=False) == "chunked"
    assert resolve_attention_impl("auto", q[:, :8], k, v, need_probs=False) == "reference"
    assert resolve_attention_impl("auto", one, k, v, need_probs=False) == "reference"  # decoding
    for impl in ("reference", "chunked", "xla", "cudnn"):
        assert resolve_attention_impl(impl, q, k, v, need_probs=False) == impl
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert resolve_attention_impl("auto", *half, need_probs=False) == "cudnn"
    assert resolve_attention_impl("auto", half[0][:, :1], *half[1:], need_probs=False) == "reference"
    assert resolve_attention_impl("auto", q, k, v, need_probs=False) == "chunked"  # fp32: not cuDNN
    with pytest.raises(ValueError, match=r"ModelConfig.attention_impl='flash' is invalid: must be one of"):
        resolve_attention_impl("flash", q, k, v, need_probs=False)


def test_config_field_is_validated():
    with pytest.raises(ValueError, match=r"ModelConfig.attention_impl='flash' is invalid: must be one of \("):
        jaxlm.ModelConfig.tiny(attention_impl="flash")
    assert jaxlm.ModelConfig.tiny().attention_impl == "auto"


# ------------------------------------------------------------------------------- model level
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 259, (2, 24)), jnp.int32)
MASK = jnp.asarray(np.arange(24)[None, :] >= np.array([[0], [9]]))


def _model(impl, **kw):
    return jaxlm.build_model(jaxlm.ModelConfig.tiny(attention_impl=impl, init_std=0.3, **kw), seed=1)


@pytest.mark.parametrize("kw", [dict(), dict(sliding_window=5, scan_layers=True), dict(attention="affine_scaled")])
def test_model_logits_and_gradients_equal_reference(kw, monkeypatch):
    """A model on the fast paths (several query blocks) gives the reference model's logits and
    parameter gradients; asking for ``attn_probs`` gives the reference probabilities."""
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 8)

    def run(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(params):
            out = nnx.merge(graphdef, params)(TOKENS, mask=MASK)
            lp = jax.nn.log_softmax(out.logits, -1)
            return -jnp.mean(jnp.take_along_axis(lp[:, :-1], TOKENS[:, 1:, None], -1)), out.logits

        (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logits, grads

    ref_logits, ref_grads = run(_model("reference", **kw))
    for impl in FAST:  # ("auto" is "chunked" here: T = 24 > QUERY_CHUNK)
        logits, grads = run(_model(impl, **kw))
        valid = np.asarray(MASK)
        # float32 rounding of another summation order is relative to the magnitudes summed, so
        # the tolerance is 1e-5 of each tensor's scale (logits reach ~10 here)
        want = np.asarray(ref_logits)[valid]
        np.testing.assert_allclose(np.asarray(logits)[valid], want, atol=1e-5 * np.abs(want).max())
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            r = np.asarray(r)
            np.testing.assert_allclose(np.asarray(g), r, atol=1e-5 * np.abs(r).max())
    probs = _model("auto", **kw)(TOKENS, mask=MASK, collect=("attn_probs",)).collected["attn_probs"]
    want = _model("reference", **kw)(TOKENS, mask=MASK, collect=("attn_probs",)).collected["attn_probs"]
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want), atol=1e-6)


def _fwd_bwd_temp_bytes(impl, T, **kw):
    cfg = jaxlm.ModelConfig.tiny(attention_impl=impl, n_heads=4, n_kv_heads=4, max_seq_len=T, **kw)
    graphdef, params = nnx.split(jaxlm.abstract_model(cfg), nnx.Param)
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)

    def loss(params, tokens):
        return jnp.mean(nnx.merge(graphdef, params)(tokens).logits[..., 0])

    return jax.jit(jax.grad(loss)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("kw", [dict(), dict(attention="affine_scaled")])
def test_automatic_path_does_not_hold_the_probability_matrix(monkeypatch, kw):
    """Forward + backward temporaries: the reference grows with T^2 (it keeps [B, N, T, T]
    float32 probabilities per layer), the automatic (chunked) path with T: doubling T from
    1024 to 2048 multiplies the first by ~4 and the second by ~2, and at 2048 the chunked
    path's temporaries are smaller than one layer's probability matrix. The affine-scaled
    variant's uniform term runs on the same path (it built a dense [B, N, T, S] float32 weight
    array: 109 MB at 2048, x2.98 per doubling)."""
    monkeypatch.setattr(attn_lib, "QUERY_CHUNK", 128)
    ref = {T: _fwd_bwd_temp_bytes("reference", T, **kw) for T in (1024, 2048)}
    auto = {T: _fwd_bwd_temp_bytes("auto", T, **kw) for T in (1024, 2048)}
    probs_bytes = 4 * 4 * 2048 * 2048  # B = 1, N = 4, float32
    assert ref[2048] / ref[1024] > 3.5, ref
    assert auto[2048] / auto[1024] < 2.5, auto
    assert auto[2048] < probs_bytes < ref[2048] / 4, (auto, ref)
