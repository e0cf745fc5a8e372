"""Neuron and head attributions: exact linear identities against the collected sublayer
outputs, and head importance against a direct `mask_heads` forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.interp import mask_heads
from jaxlm.interp.attribution import head_contributions, head_importance, neuron_contributions
from jaxlm.models.config import ModelConfig

LENGTHS = (7, 5, 3)


@pytest.fixture(scope="module", params=[False, True], ids=["layers", "scan_layers"])
def model(request):
    return jaxlm.build_model(ModelConfig.tiny(init_std=0.1, scan_layers=request.param), seed=0)


@pytest.fixture(scope="module")
def batch():
    """Right-padded rows of lengths 7, 5, 3 (pad id 0 after each)."""
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (3, 7), 3, 259))
    mask = np.arange(7)[None, :] < np.asarray(LENGTHS)[:, None]
    return jnp.asarray(np.where(mask, tokens, 0)), jnp.asarray(mask)


def _unit(d, seed=2):
    v = jax.random.normal(jax.random.key(seed), (d,))
    return v / jnp.linalg.norm(v)


def _at_last(x, mask):  # x [B, T, ...] -> [B, ...] at each row's last real token
    return x[jnp.arange(x.shape[0]), jnp.asarray(mask).sum(1) - 1]


@pytest.mark.parametrize("layer", [0, 1])
def test_neuron_contributions_sum_to_the_mlp_output_projection(model, batch, layer):
    tokens, mask = batch
    v = _unit(model.config.d_model)
    c = neuron_contributions(model, tokens, mask, v, layer)
    assert c.shape == (3, model.config.ffn_dim)
    out = model(tokens, mask=mask, collect=("mlp_out", "mlp_act")).collected
    np.testing.assert_allclose(np.asarray(c.sum(-1)), np.asarray(_at_last(out["mlp_out"][layer], mask) @ v), atol=1e-5)
    # and each term is a_i (W_down @ v)_i with the [F, D] kernel
    W = (model.layers.mlp.down_proj.kernel[...][layer] if model.config.scan_layers
         else model.layers[layer].mlp.down_proj.kernel[...])
    np.testing.assert_allclose(np.asarray(c), np.asarray(_at_last(out["mlp_act"][layer], mask) * (W @ v)), atol=1e-6)
    # a per-layer [L, D] direction is read at `layer`
    per_layer = jnp.stack([_unit(model.config.d_model, 9), v]) if layer == 1 else jnp.stack([v, _unit(64, 9)])
    np.testing.assert_allclose(np.asarray(neuron_contributions(model, tokens, mask, per_layer, layer)), np.asarray(c))


@pytest.mark.parametrize("layer", [0, 1])
def test_head_contributions_sum_to_the_attention_output_projection(model, batch, layer):
    tokens, mask = batch
    v = _unit(model.config.d_model)
    d = head_contributions(model, tokens, mask, v, layer)
    assert d.shape == (3, model.config.n_heads)
    attn_out = model(tokens, mask=mask, collect=("attn_out",)).collected["attn_out"][layer]
    np.testing.assert_allclose(np.asarray(d.sum(-1)), np.asarray(_at_last(attn_out, mask) @ v), atol=1e-5)
    # reading at attn_out of the same layer, masking a head removes exactly its direct term
    imp = head_importance(model, tokens, mask, v, layer, read_site="attn_out")
    np.testing.assert_allclose(np.asarray(imp), np.asarray(d), atol=1e-5)


@pytest.mark.parametrize("read_site, read_layer", [("mlp_in", None), ("hidden", 1), ("resid_mid", 1)])
def test_head_importance_is_baseline_minus_masked_projection(model, batch, read_site, read_layer):
    tokens, mask = batch
    c = model.config
    layer = 0
    v = jnp.stack([_unit(c.d_model, 3), _unit(c.d_model, 4)])  # per layer: read at read_layer
    imp = head_importance(model, tokens, mask, v, layer, read_site=read_site, read_layer=read_layer)
    rl = layer if read_layer is None else read_layer

    graphdef, state = nnx.split(model)

    @jax.jit
    def projection(interventions=()):  # compiled once, reused for every head
        names = ("hidden", "mlp_out") if read_site == "resid_mid" else (read_site,)
        out = nnx.merge(graphdef, state)(tokens, mask=mask, collect=names, interventions=interventions).collected
        x = out["hidden"] - out["mlp_out"] if read_site == "resid_mid" else out[read_site]
        return _at_last(x[rl], mask) @ v[rl]

    base = projection()
    for h in range(c.n_heads):
        scale = jnp.ones((c.n_layers, c.n_heads)).at[layer, h].set(0.0)
        masked = projection((mask_heads(scale, n_layers=c.n_layers),))
        np.testing.assert_allclose(np.asarray(imp[:, h]), np.asarray(base - masked), atol=1e-5)
    assert float(jnp.abs(imp).max()) > 1e-3


def test_contributions_of_a_quantization_aware_model_sum_to_its_outputs(batch):
    """Under QAT (and once exported) a projection multiplies fake-quantized inputs by its
    quantized weight: the contributions are of those, so they still sum to the outputs."""
    from jaxlm.quant.qat_export import export_qat

    tokens, mask = batch
    qat = jaxlm.build_model(ModelConfig.tiny(init_std=0.1, qat_format="nvfp4"), seed=0)
    v = _unit(qat.config.d_model)
    for model in (qat, export_qat(qat)):
        out = model(tokens, mask=mask, collect=("mlp_out", "attn_out")).collected
        for layer in (0, 1):
            np.testing.assert_allclose(np.asarray(neuron_contributions(model, tokens, mask, v, layer).sum(-1)),
                                       np.asarray(_at_last(out["mlp_out"][layer], mask) @ v), atol=2e-5)
            np.testing.assert_allclose(np.asarray(head_contributions(model, tokens, mask, v, layer).sum(-1)),
                                       np.asarray(_at_last(out["attn_out"][layer], mask) @ v), atol=2e-5)


def test_bad_inputs_are_named(model, batch):
    tokens, mask = batch
    v = _unit(64)
    with pytest.raises(ValueError, match=r"layer=2 is invalid: must be an int in \[0, 2\)"):
        neuron_contributions(model, tokens, mask, v, 2)
    with pytest.raises(ValueError, match=r"direction must be \[D\] = \(64,\)"):
        head_contributions(model, tokens, mask, jnp.ones(32), 0)
    with pytest.raises(ValueError, match="read_layer=0 is before layer=1"):
        head_importance(model, tokens, mask, v, 1, read_layer=0)
    with pytest.raises(ValueError, match="read_site='mlp_act' is invalid"):
        head_importance(model, tokens, mask, v, 0, read_site="mlp_act")
    empty = jnp.ones((0, 4), jnp.int32)  # crashed in a reshape without naming anything
    with pytest.raises(ValueError, match="at least one row"):
        head_importance(model, empty, None, v, 0)
    with pytest.raises(ValueError, match="tokens holds no rows"):
        neuron_contributions(model, empty, None, v, 0)


def test_a_layer_may_be_any_integer_scalar(model, batch):
    """``jnp.argmax`` over per-layer scores gives a 0-d JAX array: it is a layer index (it was
    refused as 'Array(1) is invalid'); bools and 0-d floats are not."""
    tokens, mask = batch
    v = _unit(64)
    want = np.asarray(neuron_contributions(model, tokens, mask, v, 1))
    for layer in (jnp.int32(1), jnp.asarray(1), np.int64(1)):
        np.testing.assert_array_equal(np.asarray(neuron_contributions(model, tokens, mask, v, layer)), want)
    for bad in (True, jnp.asarray(1.0), jnp.asarray([1])):
        with pytest.raises(ValueError, match="layer=.* is invalid"):
            neuron_contributions(model, tokens, mask, v, bad)
