"""Quantization-aware training as a model variant (``ModelConfig.qat_format`` /
``kv_quant``); the ReQAT miniature (QAT + SEM vs PTQ) is `bench/reqat.py`."""

import dataclasses

import pytest

import jaxlm
from jaxlm.models.params import flat_params, model_from_flat

MODEL = jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)


def test_qat_model_fake_quantizes_projections_and_kv_with_straight_through_gradients():
    """A ``qat_format`` model's projection equals fake_quant(x) @ fake_quant(W) (x per token);
    the gradient reaches the full-precision weight as if the quantizer were the identity
    (STE); and ``kv_quant`` changes the model's output."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxlm.models.layers.linear import Linear
    from jaxlm.quant.formats import fake_quant as eager_fake_quant

    # jitted: run eagerly, every op of the quantizer compiles on its own
    fake_quant = jax.jit(eager_fake_quant, static_argnums=(1,), static_argnames=("axis",))
    plain = jaxlm.build_model(MODEL, seed=0)
    qat = model_from_flat(dataclasses.replace(MODEL, qat_format="nvfp4"), flat_params(plain))
    x = jax.random.normal(jax.random.key(0), (3, 64)) * jnp.asarray([[1.0], [10.0], [0.1]])
    proj = qat.layers[0].mlp.up_proj
    # activations: NVFP4 tensor scale per token (row), weights: one per matrix
    xq = jnp.concatenate([fake_quant(x[i:i + 1], "nvfp4", axis=-1) for i in range(3)])
    assert float(jnp.abs(xq - fake_quant(x, "nvfp4", axis=-1)).max()) > 0  # per token != per call
    want = xq @ fake_quant(proj.kernel[...], "nvfp4", axis=-2)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, v: m(v))(proj, x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    layer = Linear(64, 32, axes=("embed", "mlp"), fake_quant="nvfp4", rngs=nnx.Rngs(0))
    g = nnx.jit(nnx.grad(lambda m: m(x).sum()))(layer).kernel[...]
    # STE: d/dW sum(xq @ Wq) = xq^T 1
    np.testing.assert_allclose(np.asarray(g), np.asarray(xq.sum(0)[:, None] * jnp.ones((1, 32))), rtol=1e-5, atol=1e-5)
    tokens = jnp.asarray([[1, 50, 60, 70, 80, 90]])
    kv = model_from_flat(dataclasses.replace(MODEL, kv_quant="e1m2"), flat_params(plain))
    logits = nnx.jit(lambda m: m(tokens).logits)  # jitted: eager dispatch compiles every op
    assert float(jnp.abs(logits(kv) - logits(plain)).max()) > 0
    assert float(jnp.abs(logits(qat) - logits(plain)).max()) > 0


def test_qat_config_errors():
    with pytest.raises(ValueError, match="qat_format"):
        dataclasses.replace(MODEL, qat_format="fp8")
    with pytest.raises(ValueError, match="kv_quant"):
        jaxlm.ModelConfig.tiny(d_model=40, n_heads=4, n_kv_heads=2, kv_quant="e1m2")
