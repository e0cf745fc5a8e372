"""Block transforms for W4A4 (RTN / shared Hadamard / WUSH): exactness before quantization,
WUSH's construction, and the layer-level error claim on inputs with outlier channels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.editing.kfac import token_batches
from jaxlm.quant.calibrate import input_second_moments
from jaxlm.quant.transforms import (
    damped_cholesky_upper, hadamard_transform, identity_transform, transform_activations,
    transform_weights, w4a4_matmul, wush_transform,
)
from jaxlm.quant.w4a4 import TransformedWeight, transform_quantize_model
from token_independence import assert_independent_of_padding_and_cache

C, R = 256, 128


@pytest.fixture(scope="module")
def outlier_layer():
    """Inputs with 8 outlier channels (25x) and mild channel correlation; Gaussian W."""
    rng = np.random.default_rng(0)
    scale = np.ones(C)
    scale[rng.choice(C, 8, replace=False)] = 25.0
    mix = np.eye(C) + 0.3 * rng.normal(size=(C, C)) / np.sqrt(C)
    draw = lambda n: ((rng.normal(size=(n, C)) @ mix) * scale).astype(np.float32)  # noqa: E731
    X_cal, X_test = draw(2048), draw(512)
    W = (rng.normal(size=(C, R)) / np.sqrt(C)).astype(np.float32)
    return X_cal.T @ X_cal / len(X_cal), X_test, W


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("block", [16, 32])
def test_transforms_preserve_the_product_before_quantization(outlier_layer, block):
    H, X, W = outlier_layer
    for T in (identity_transform(C, block), hadamard_transform(C, block), wush_transform(H, W, block)):
        y = jnp.dot(transform_activations(jnp.asarray(X), T), transform_weights(jnp.asarray(W), T))
        assert _rel(y, X @ W) < 1e-5


def test_wush_follows_the_reference_construction(outlier_layer):
    """Block 0 rebuilt step by step with numpy from the card's recipe."""
    H, _, W = outlier_layer
    B = 32
    H64 = H.astype(np.float64)
    Hd = H64 + 0.01 * np.mean(np.diag(H64)) * np.eye(C)
    U = np.linalg.cholesky(Hd).T
    np.testing.assert_allclose(damped_cholesky_upper(H), U, rtol=1e-10)
    Uii = U[:B, :B]
    V, s, _ = np.linalg.svd(Uii @ W[:B].astype(np.float64), full_matrices=False)
    s = s / np.sqrt(R)
    s = s + 0.01 * s.mean()
    from scipy.linalg import hadamard

    T0 = hadamard(B) / np.sqrt(B) @ np.diag(np.sqrt(s)) @ V.T @ np.linalg.inv(Uii).T
    T = np.asarray(wush_transform(H, W, B))
    np.testing.assert_allclose(T[0], T0, rtol=1e-4, atol=1e-6)
    assert not np.allclose(T[0], T[1])  # a distinct, non-orthogonal transform per block
    assert not np.allclose(T[0] @ T[0].T, np.eye(B), atol=1e-2)


def test_w4a4_error_wush_beats_hadamard_and_rtn_on_outlier_inputs(outlier_layer):
    """The WUSH claim in miniature. Measured (relative output error):
    MXFP4 RTN 0.196 > Hadamard 0.154 > WUSH 0.075; NVFP4 Hadamard 0.139 > RTN 0.123 >
    WUSH 0.064 -- a shared Hadamard does not beat plain RTN under NVFP4 (16-element blocks
    with E4M3 scales), so only MXFP4 asserts Hadamard < RTN (docs/quantization.md)."""
    H, X, W = outlier_layer
    Y = X @ W
    for fmt, B in (("mxfp4", 32), ("nvfp4", 16)):
        err = {
            name: _rel(w4a4_matmul(jnp.asarray(X), jnp.asarray(W), T, fmt), Y)
            for name, T in (("rtn", identity_transform(C, B)), ("hadamard", hadamard_transform(C, B)),
                            ("wush", wush_transform(H, W, B)))
        }
        assert err["wush"] < 0.6 * min(err["rtn"], err["hadamard"]), (fmt, err)
        if fmt == "mxfp4":
            assert err["hadamard"] < err["rtn"], err


def test_calibration_streams_second_moments():
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64), seed=0)
    tok = jaxlm.ByteTokenizer()
    texts = [f"{i}+{i * 7}={i * 8}" for i in range(12)]
    whole = input_second_moments(model, token_batches(tok, texts, batch_size=12, seq_len=16), ["mlp.down_proj"])
    streamed = input_second_moments(model, token_batches(tok, texts, batch_size=5, seq_len=16), ["mlp.down_proj"])
    ref = np.asarray(whole["mlp.down_proj"])
    atol = 1e-5 * np.abs(ref).max()  # float32 sums in another order
    np.testing.assert_allclose(np.asarray(streamed["mlp.down_proj"]), ref, rtol=1e-5, atol=atol)
    batch = next(token_batches(tok, texts, batch_size=12, seq_len=16))
    acts = model(jnp.asarray(batch[0]), mask=jnp.asarray(batch[1]), collect=("mlp_act",)).collected["mlp_act"]
    a = np.asarray(acts[1])[batch[1]]
    np.testing.assert_allclose(np.asarray(whole["mlp.down_proj"][1]), a.T @ a / batch[1].sum(), rtol=1e-5, atol=atol)
    with pytest.raises(ValueError, match="mlp.fc1"):
        input_second_moments(model, [batch], ["mlp.fc1"])


def test_transformed_model_is_exact_without_quantization_and_runs_quantized():
    """Unrolled layers; the stacked layout (transforms and QArrays stacked per layer under
    lax.scan) runs in the checkpoint round trip below."""
    cfg = jaxlm.ModelConfig.tiny(d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128, scan_layers=False)
    model = jaxlm.build_model(cfg, seed=0)
    tok = jaxlm.ByteTokenizer()
    batches = list(token_batches(tok, [f"{i}*{i}={i * i}" for i in range(16)], batch_size=16, seq_len=16))
    tokens, valid = map(jnp.asarray, batches[0])
    base = model(tokens, mask=valid).logits
    for method in ("hadamard", "wush"):
        exact = transform_quantize_model(model, method, "nvfp4", batches, quantize_weights=False,
                                         quantize_activations=False)
        assert _rel(exact(tokens, mask=valid).logits, np.asarray(base)) < 1e-5
    q = transform_quantize_model(model, "wush", "nvfp4", batches)
    leaves = jax.tree.leaves(jax.tree.map(lambda x: x, q.layers, is_leaf=lambda x: isinstance(x, TransformedWeight)),
                             is_leaf=lambda x: isinstance(x, TransformedWeight))
    assert sum(isinstance(x, TransformedWeight) for x in leaves) >= 1
    out = q(tokens, mask=valid).logits
    assert np.isfinite(np.asarray(out)).all() and 0 < _rel(out, np.asarray(base)) < 1.0
    with pytest.raises(ValueError, match="method='gptq'"):
        transform_quantize_model(model, "gptq", "nvfp4", batches)
    with pytest.raises(ValueError, match="wush needs calibration"):
        transform_quantize_model(model, "wush", "nvfp4", None)


def test_w4a4_model_does_not_depend_on_padding_or_cache_length():
    """NVFP4 activations get one tensor scale per token (`fake_quant_tokens`), so a WUSH
    W4A4 model's logits do not depend on padding, batch rows or the cache length, and cached
    greedy decoding equals recomputation. With the earlier per-sequence scale, `jaxlm eval`
    and `jaxlm quantize`'s own check scored one GPTQ model 81.0% and 80.5%, and this test
    with unrolled layers failed (logits up to 0.4 apart). Scanned layers (stacked transforms)."""
    cfg = jaxlm.ModelConfig.tiny(d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64, init_std=0.1,
                                 scan_layers=True)
    model = jaxlm.build_model(cfg, seed=0)
    tok = jaxlm.ByteTokenizer()
    batches = list(token_batches(tok, [f"{i}*{i}={i * i}" for i in range(16)], batch_size=16, seq_len=16))
    assert_independent_of_padding_and_cache(transform_quantize_model(model, "wush", "nvfp4", batches))


def test_hadamard_transform_is_orthogonal_and_shared():
    T = np.asarray(hadamard_transform(64, 16))
    np.testing.assert_allclose(T[0] @ T[0].T, np.eye(16), atol=1e-6)
    np.testing.assert_array_equal(T[0], T[3])


@pytest.mark.slow  # quantized checkpoint round trips run by default in test_qat_export, test_twinquant_model and test_quarot
def test_quantized_checkpoints_round_trip_exactly(tmp_path):
    """QArray and TransformedWeight leaves survive save_checkpoint / load_checkpoint with
    their formats (no re-quantization on load), with stacked layers under lax.scan (the
    layout whose QArray global scale needed a per-layer axis)."""
    from jaxlm.quant.recipe import quantize_model

    cfg = jaxlm.ModelConfig.tiny(d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128, scan_layers=True)
    model = jaxlm.build_model(cfg, seed=0, tokenizer=jaxlm.ByteTokenizer())
    batches = list(token_batches(model.tokenizer, ["1+2=3", "4+4=8"], batch_size=2, seq_len=8))
    tokens = jnp.asarray(batches[0][0])
    for i, q in enumerate((transform_quantize_model(model, "wush", "nvfp4", batches), quantize_model(model))):
        jaxlm.save_checkpoint(q, tmp_path / f"q{i}")
        back = jaxlm.load_checkpoint(tmp_path / f"q{i}")
        np.testing.assert_array_equal(np.asarray(back(tokens).logits), np.asarray(q(tokens).logits))
        assert back.tokenizer is not None


def test_wush_with_an_all_zero_weight_block_is_invertible():
    """Dead input channels (a block of zero weight rows) give a zero block target: its
    transform must still be invertible, so the product is exact before quantization and the
    quantized layer finite (it was NaN), in RTN and in GPTQ mode."""
    from jaxlm.quant.gptq import gptq_transform_quantize

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 64))
    H = x.T @ x / 256
    for dead in (slice(0, 32), slice(32, 64)):
        W = rng.standard_normal((64, 32)).astype(np.float32)
        W[dead] = 0.0
        T = wush_transform(H, W, 32)
        assert np.isfinite(np.asarray(T)).all()
        exact = transform_activations(jnp.asarray(x[:4], jnp.float32), T) @ transform_weights(jnp.asarray(W), T)
        np.testing.assert_allclose(np.asarray(exact), x[:4] @ W, atol=1e-3)
        assert np.isfinite(np.asarray(w4a4_matmul(jnp.asarray(x[:4], jnp.float32), jnp.asarray(W), T, "mxfp4"))).all()
        T2, q = gptq_transform_quantize(H, W, "mxfp4", "wush")
        assert np.isfinite(np.asarray(T2)).all() and np.isfinite(np.asarray(jaxlm.quant.dequantize(q))).all()
