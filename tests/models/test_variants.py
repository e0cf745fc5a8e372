"""Architecture variants at their neutral settings equal the standard model; the efficient
affine form equals the naive sum; every variant works with the KV cache and `generate`, and
with HF-loaded base weights."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.models.layers.attention_variants import affine_scaled_naive
from jaxlm.models.params import flat_params, model_from_flat

BASE = jaxlm.ModelConfig.tiny(init_std=0.3, n_heads=4, n_kv_heads=2)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 259, (3, 10)), jnp.int32)
MASK = jnp.asarray(np.arange(10)[None, :] >= np.array([[0], [3], [5]]))  # left padding
COND = jnp.asarray(np.random.RandomState(1).randint(3, 259, (3, 5)), jnp.int32)


@pytest.fixture(scope="module")
def base():
    return jaxlm.build_model(BASE, seed=0)


def _variant(base, **changes):
    """The base weights in a variant model; variant-only params keep their initial values."""
    cfg = BASE.replace(**changes)
    fresh = flat_params(jaxlm.build_model(cfg, seed=1))
    return model_from_flat(cfg, {**fresh, **flat_params(base)})


def _set(model, name, value):
    """Set a (per-layer) parameter by flat name."""
    cfg = model.config
    return model_from_flat(cfg, {**flat_params(model), name: value})


def _logits(model, **kw):
    return np.asarray(model(TOKENS, mask=MASK, **kw).logits)[np.asarray(MASK)]


def test_affine_scaled_starts_as_softmax(base):
    ref = _logits(base)
    for bias in ("free", "coupled"):
        for act in ("sigmoid2", "exp"):
            np.testing.assert_array_equal(_logits(_variant(base, attention="affine_scaled", affine_bias=bias, affine_scale_act=act)), ref)


@pytest.mark.parametrize("bias", ["free", "coupled"])
def test_affine_efficient_form_equals_naive_sum(base, bias):
    model = _variant(base, attention="affine_scaled", affine_bias=bias)
    rng = np.random.RandomState(2)
    for name in ("layers.0.attn.scale_proj", "layers.0.attn.bias_proj"):
        model = _set(model, name, jnp.asarray(rng.randn(BASE.d_model, BASE.n_heads) * 0.3, jnp.float32))
    attn = model.layers[0].attn
    B, T, D = 3, 10, BASE.d_model
    x = jnp.asarray(rng.randn(B, T, D), jnp.float32)
    q = jnp.asarray(rng.randn(B, T, 4, BASE.head_dim), jnp.float32)
    k = jnp.asarray(rng.randn(B, 2, T, BASE.head_dim), jnp.float32)
    v = jnp.asarray(rng.randn(B, 2, T, BASE.head_dim), jnp.float32)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None] & MASK[:, None, None, :]
    out, _ = attn.attend(q, k, v, causal, inputs=x)
    s, z_b = attn.affine_terms(x)
    assert float(jnp.abs(s - 1).max()) > 0.1  # a real, non-neutral scale
    ref = affine_scaled_naive(q, k, v, causal, s, z_b, scale=BASE.head_dim**-0.5, coupled=bias == "coupled")
    real = np.asarray(MASK)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)


def test_sink_minus_inf_is_softmax_and_finite_sink_absorbs_mass(base):
    ref = _logits(base)
    neutral = _variant(base, attention="sink", sink_init=float("-inf"))
    np.testing.assert_allclose(_logits(neutral), ref, rtol=1e-6, atol=1e-6)
    sunk = _variant(base, attention="sink", sink_init=2.0)
    probs = np.asarray(sunk(TOKENS, mask=MASK, collect=("attn_probs",)).collected["attn_probs"])
    row_mass = probs.sum(-1)[:, 0]  # batch row 0 has no padding
    assert np.all(row_mass <= 1.0) and np.all(row_mass > 0.0) and row_mass.mean() < 0.99


def test_meta_swiglu_beta_zero_is_the_base_model(base):
    ref = _logits(base)
    meta = _variant(base, mlp="meta_swiglu")
    np.testing.assert_array_equal(_logits(meta), ref)  # no condition
    np.testing.assert_array_equal(_logits(meta, condition=COND), ref)  # W_beta = 0 -> beta = 0
    gated = _set(meta, "meta_gate.w_beta", jnp.asarray(np.random.RandomState(3).randn(BASE.meta_rank, BASE.ffn_dim) * 0.1, jnp.float32))
    out = gated(TOKENS, mask=MASK, condition=COND, collect=("mlp_beta",))
    beta = np.asarray(out.collected["mlp_beta"])
    assert beta.shape == (BASE.n_layers, 3, 10, BASE.ffn_dim)
    assert np.abs(beta).max() <= 0.5 and np.abs(beta).max() > 0.05
    other = _logits(gated, condition=COND[::-1])
    assert np.abs(np.asarray(out.logits)[np.asarray(MASK)] - ref).max() > 1e-3
    assert np.abs(other - np.asarray(out.logits)[np.asarray(MASK)]).max() > 1e-4  # the condition matters
    # a row whose condition is empty (all masked) is the base model whatever its padding ids
    # are (the softmax spread evenly over the masked ids: its logits moved by up to 0.7)
    cmask = jnp.asarray([[True] * 5, [False] * 5, [True, True, False, False, False]])
    ids_b = COND.at[1].set(jnp.asarray([9, 17, 200, 3, 5]))
    a = np.asarray(gated(TOKENS, mask=MASK, condition=(COND, cmask)).logits)
    b = np.asarray(gated(TOKENS, mask=MASK, condition=(ids_b, cmask)).logits)
    plain = np.asarray(gated(TOKENS, mask=MASK).logits)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_allclose(a[1], plain[1], rtol=1e-6, atol=1e-6)
    assert np.abs(a[2] - plain[2]).max() > 1e-4  # a row with part of its condition visible is conditioned


def test_graph_rope_with_equal_coordinates_is_rope(base):
    pos = jnp.broadcast_to(jnp.arange(10), (3, 10))
    graph = _variant(base, rope="graph")
    ref = np.asarray(base(TOKENS, pos).logits)
    np.testing.assert_array_equal(np.asarray(graph(TOKENS, pos).logits), ref)  # 1-axis positions
    np.testing.assert_array_equal(np.asarray(graph(TOKENS, jnp.stack([pos, pos], -1)).logits), ref)
    hops = jnp.stack([pos, jnp.zeros_like(pos)], -1)
    assert np.abs(np.asarray(graph(TOKENS, hops).logits) - ref).max() > 1e-3
    from jaxlm.models.layers.rope import graph_pair_mask

    assert graph_pair_mask(BASE.replace(rope="graph")).tolist() == [False] * 4 + [True] * 4
    assert graph_pair_mask(BASE.replace(rope="graph", graph_rope_band="high", graph_rope_pairs=2)).tolist() == [True] * 2 + [False] * 6


VARIANTS = {
    "affine_scaled": dict(attention="affine_scaled"),
    "sink": dict(attention="sink", sink_init=1.0),
    "meta_swiglu": dict(mlp="meta_swiglu"),
    "graph_rope": dict(rope="graph"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_with_cache_and_generate(base, name):
    model = _variant(base, **VARIANTS[name])
    rng = np.random.RandomState(4)
    kw = {}
    if name == "affine_scaled":
        for p in ("layers.0.attn.scale_proj", "layers.1.attn.bias_proj"):
            model = _set(model, p, jnp.asarray(rng.randn(BASE.d_model, BASE.n_heads) * 0.3, jnp.float32))
    if name == "meta_swiglu":
        model = _set(model, "meta_gate.w_beta", jnp.asarray(rng.randn(BASE.meta_rank, BASE.ffn_dim), jnp.float32))
        kw = dict(condition=COND)
    full = model(TOKENS, mask=MASK, **kw).logits
    cache = model.init_cache(3, 12)
    out = model(TOKENS[:, :6], mask=MASK[:, :6], cache=cache, **kw)
    logits, cache = [out.logits], out.cache
    for t in range(6, 10):
        out = model(TOKENS[:, t : t + 1], cache=cache, **kw)
        logits.append(out.logits)
        cache = out.cache
    stepped = jnp.concatenate(logits, axis=1)
    np.testing.assert_allclose(np.asarray(stepped)[np.asarray(MASK)], np.asarray(full)[np.asarray(MASK)], atol=1e-4)
    result = jaxlm.generate(model, [[1, 5, 6], [1, 9]], max_new_tokens=4, temperature=0,
                            condition=COND[:2] if kw else None)
    assert result.tokens.shape == (2, 4)


def test_variants_load_hf_base_weights(tmp_path):
    pytest.importorskip("torch")
    from hf_reference import build_hf_model, hf_logits, padded_batch

    hf = build_hf_model("llama_llama3_rope")
    hf.save_pretrained(tmp_path)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(hf, tokens, mask, positions).logits.numpy()
    for kw in (dict(attention="affine_scaled"), dict(attention="sink", sink_init=float("-inf")),
               dict(mlp="meta_swiglu"), dict(rope="graph")):
        model = jaxlm.load_hf(tmp_path, dtype="float32", **kw)
        out = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), mask=jnp.asarray(mask)).logits)
        np.testing.assert_allclose(out[mask], ref[mask], atol=1e-4, err_msg=str(kw))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_rebuilding_from_flat_params_keeps_each_variables_dtype(scan_layers):
    """The sink logits are float32 in a bf16 model (as initialisation makes them and
    `param_shapes` states): rebuilding from flat params (compression, QAT export, Q-FIT,
    unrolling) keeps them exact (they were rounded to bf16: 0.3001 -> 0.30078125)."""
    from jaxlm.models.params import param_shapes

    cfg = BASE.replace(attention="sink", param_dtype="bfloat16", scan_layers=scan_layers)
    model = jaxlm.build_model(cfg, seed=0)
    sinks = np.asarray([0.3001, -1.2345, 2.7183, 0.1111], np.float32)
    flat = flat_params(model)
    flat = {**flat, **{k: jnp.asarray(sinks) for k in flat if k.endswith("attn.sink")}}
    rebuilt = flat_params(model_from_flat(cfg, flat))
    shapes = param_shapes(cfg)
    for name, value in rebuilt.items():
        assert value.dtype == shapes[name].dtype, name
    for k in (k for k in rebuilt if k.endswith("attn.sink")):
        assert rebuilt[k].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(rebuilt[k]), sinks)
    assert rebuilt["embed"].dtype == jnp.bfloat16
