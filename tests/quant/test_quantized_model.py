"""A model whose params went through `quantize_params` runs forward, backward and `generate`
unchanged, through the jnp reference or the Pallas kernel (interpret mode here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
import jaxlm.quant as Q

CFG = jaxlm.ModelConfig.tiny(d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=256, init_std=0.1,
                             dtype="bfloat16", param_dtype="bfloat16", max_seq_len=64)
RECIPES = {
    "mxfp4": Q.QuantRecipe("mxfp4"),
    "mxfp4_ceil": Q.QuantRecipe("mxfp4", (("rule", "ceil"),)),
    "nvfp4": Q.QuantRecipe("nvfp4"),
    "int4_g32": Q.QuantRecipe("int4", (("group", 32),)),
}
CFG32 = CFG.replace(dtype="float32", param_dtype="float32")  # for exact-equivalence checks
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 259, (4, 24)), jnp.int32)


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(CFG, seed=0)


def _spread_relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    spread = np.sqrt(np.mean((ref - ref.mean(-1, keepdims=True)) ** 2))
    return float(np.sqrt(np.mean((out - ref) ** 2)) / spread)


@pytest.mark.parametrize("name", [n if n == "nvfp4" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(RECIPES)])
def test_quantized_model_equals_its_dequantized_weights(model, name):
    # float32 compute: the quantized model is exactly the dense model with dequantised weights
    qmodel = Q.quantize_model(jaxlm.build_model(CFG32, seed=0), RECIPES[name])
    params = nnx.to_pure_dict(nnx.state(qmodel))
    names = Q.quantized_names(params)
    assert len(names) == 7 * CFG.n_layers and all("proj.kernel" in n for n in names)
    # the same network with the dequantised weights as plain arrays
    dense = nnx.merge(nnx.graphdef(qmodel), jax.tree.map(
        lambda x: Q.dequantize(x) if isinstance(x, Q.QArray) else x, params, is_leaf=lambda x: isinstance(x, Q.QArray)))
    q_logits = jax.jit(lambda m: m(TOKENS).logits)(qmodel)
    d_logits = jax.jit(lambda m: m(TOKENS).logits)(dense)
    assert _spread_relative_error(q_logits, d_logits) < 1e-5
    # stated error vs the unquantized bf16 model (bf16 compute): 7 RTN-quantized matmuls per
    # layer, each with ~10% relative weight error (tests/quant/test_formats.py), compounding
    # over 2 layers; measured 0.36-0.47 of the logit spread on this random model
    bf16_q = Q.quantize_model(model, RECIPES[name])
    assert _spread_relative_error(bf16_q(TOKENS).logits, model(TOKENS).logits) < 0.6


def test_quantized_model_generates_same_through_kernel_and_reference(model):
    qmodel = Q.quantize_model(model, RECIPES["mxfp4"])
    with Q.backend("reference"):
        ref = jaxlm.generate(qmodel, [[1, 50, 60], [1, 70]], max_new_tokens=6, temperature=0)
    with Q.backend("interpret"):
        ker = jaxlm.generate(qmodel, [[1, 50, 60], [1, 70]], max_new_tokens=6, temperature=0)
    np.testing.assert_array_equal(ref.tokens, ker.tokens)
    assert ref.tokens.shape == (2, 6)
    dense = jaxlm.generate(model, [[1, 50, 60], [1, 70]], max_new_tokens=6, temperature=0)
    assert dense.tokens.shape == ref.tokens.shape


def test_scanned_model_quantizes_per_layer():
    cfg = CFG32.replace(scan_layers=True)
    model = jaxlm.build_model(cfg, seed=0)
    qmodel = Q.quantize_model(model, RECIPES["nvfp4"])
    q = nnx.to_pure_dict(nnx.state(qmodel))["layers"]["mlp"]["up_proj"]["kernel"]
    assert q.shape == (cfg.n_layers, cfg.d_model, cfg.ffn_dim)
    assert q.global_scale.shape == (cfg.n_layers, 1, 1)  # one tensor scale per layer
    unrolled = Q.quantize_model(jaxlm.models.params.model_from_flat(CFG32, jaxlm.models.params.flat_params(model)), RECIPES["nvfp4"])
    np.testing.assert_allclose(np.asarray(qmodel(TOKENS).logits), np.asarray(unrolled(TOKENS).logits), atol=1e-5)
    # the flat view of the scanned quantized model holds each layer's QArray (indexing the
    # stacked QArray raised "'QArray' object is not subscriptable"), equal to the unrolled one
    flat, per_layer = jaxlm.models.params.flat_params(qmodel), jaxlm.models.params.flat_params(unrolled)
    for i in range(cfg.n_layers):
        got, want = flat[f"layers.{i}.mlp.up_proj.kernel"], per_layer[f"layers.{i}.mlp.up_proj.kernel"]
        assert isinstance(got, Q.QArray) and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(want.dequantize()))


def test_gradients_flow_through_quantized_weights(model):
    """d/dx of x @ Q(W) is dy @ deq(W)^T (QLoRA-style training of other params)."""
    w = jnp.asarray(np.random.RandomState(1).randn(64, 32), jnp.float32)
    q = Q.quantize(w, "mxfp4", axis=-2)
    x = jnp.asarray(np.random.RandomState(2).randn(5, 64), jnp.float32)
    from jaxlm.models.layers.linear import linear

    for mode in ("reference", "interpret"):
        with Q.backend(mode):
            g = jax.grad(lambda x: jnp.sum(linear(x, q) ** 2))(x)
        g_ref = jax.grad(lambda x: jnp.sum((x @ Q.dequantize(q)) ** 2))(x)
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)
    # whole model: gradients w.r.t. the unquantized params (norms, embeddings) exist
    qmodel = Q.quantize_model(model, RECIPES["mxfp4"])
    graphdef, state = nnx.split(qmodel)
    params = nnx.to_pure_dict(state)
    float_params = jax.tree.map(lambda x: None if isinstance(x, Q.QArray) else x, params,
                                is_leaf=lambda x: isinstance(x, Q.QArray))

    def loss(fp):
        merged = jax.tree.map(lambda a, b: b if a is None else a, fp, params,
                              is_leaf=lambda x: x is None or isinstance(x, Q.QArray))
        return jnp.mean(nnx.merge(graphdef, merged)(TOKENS).logits.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss))(float_params)  # jitted: eager dispatch compiles every op
    assert float(jnp.abs(grads["final_norm"]["scale"]).sum()) > 0
    assert float(jnp.abs(grads["layers"][0]["attn_norm"]["scale"]).sum()) > 0


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend 'gpu' is invalid"):
        Q.set_backend("gpu")
    assert Q.resolved_backend() in ("reference", "kernel")


@pytest.mark.parametrize("group", [48, 96, 512])
def test_kernel_path_takes_groups_that_do_not_divide_256(group):
    """An INT4 group of 48 or 512 (any even group is a valid format) through the W4A16 kernel
    (interpret mode): the K tile holds whole groups, and the result is dequantize-then-matmul."""
    from jaxlm.quant.linear import quantized_linear

    rng = np.random.default_rng(0)
    w = Q.quantize(jnp.asarray(rng.normal(size=(1536, 24)), jnp.float32), Q.int4(group), axis=0)
    x = jnp.asarray(rng.normal(size=(5, 1536)), jnp.float32)
    want = x @ Q.dequantize(w)
    for mode in ("reference", "interpret"):
        with Q.backend(mode):
            np.testing.assert_allclose(np.asarray(quantized_linear(x, w)), np.asarray(want), rtol=1e-4, atol=1e-3)


def test_recipes_refuse_what_the_model_cannot_run_quantized(model):
    """The embedding (gathered by row) and vectors (norms, biases) selected by a recipe are
    refused naming the parameter (a TypeError at the first forward, or an error naming only a
    shape); a QAT model is refused (its activation quantization would be dropped silently)."""
    params = nnx.to_pure_dict(nnx.split(model)[1])
    with pytest.raises(ValueError, match=r"selects 'embed' \(259, 128\), which the model cannot run quantized"):
        Q.quantize_params(params, Q.QuantRecipe("mxfp4", include=r"^embed$"))
    with pytest.raises(ValueError, match=r"selects 'final_norm.scale' \(128,\)"):
        Q.quantize_params(params, Q.QuantRecipe("mxfp4", include=r"norm\.scale$"))
    # a matrix the model indexes directly (affine-scaled attention's [D, H] projections): it was
    # quantized, then the first forward failed with "'QArray' object is not subscriptable"
    affine = jaxlm.build_model(model.config.replace(attention="affine_scaled"), seed=0)
    affine_params = nnx.to_pure_dict(nnx.split(affine)[1])
    with pytest.raises(ValueError, match=r"selects 'layers.0.attn.(scale|bias)_proj' \(128, \d+\)"):
        Q.quantize_params(affine_params, Q.QuantRecipe("nvfp4", include=r"\.attn\."))
    quantized = Q.quantize_model(affine, Q.QuantRecipe("nvfp4", include=r"\.attn\..*kernel"))
    assert np.isfinite(np.asarray(quantized(jnp.asarray([[1, 5, 9, 2]])).logits)).all()
    qat = jaxlm.build_model(model.config.replace(qat_format="nvfp4"), seed=0)
    with pytest.raises(ValueError, match="qat_format='nvfp4': export it with jaxlm.quant.export_qat"):
        Q.quantize_model(qat, Q.QuantRecipe("nvfp4"))


def test_a_format_option_given_twice_is_an_error():
    """`int4:group=32,group=64` kept group 32 silently, and a keyword overrode the string."""
    assert Q.get_format("int4:group=32,scale=rms").block == 32
    with pytest.raises(ValueError, match="option 'group' is given twice"):
        Q.get_format("int4:group=32,group=64")
    with pytest.raises(ValueError, match=r"option 'group' is given twice \(also as group=32\)"):
        Q.get_format("int4:group=64", group=32)
