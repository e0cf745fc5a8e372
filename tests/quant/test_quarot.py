"""QuaRot (arXiv 2404.00456) folded into the weights: norm fusion, the residual-stream rotation
and the V/O head rotation each compute the same function; the residual stream is the
original times Q; W4A4 on a model with residual outlier channels; refused variants."""

import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.quant.quarot import (
    fuse_norms, quarot_quantize, quarot_transform, random_orthogonal, rotate_heads, rotate_residual,
)
from jaxlm.quant.w4a4 import transform_quantize_model

TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 259, (2, 10)), jnp.int32)

D64 = dict(d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64)  # shared shapes: fewer compiles
CONFIGS = {
    # unrolled, GQA, qkv bias, qk-norm, tied embeddings (fuse_norms unties)
    "unrolled_gqa_bias_qknorm_tied": dict(D64, scan_layers=False, qkv_bias=True, qk_norm=True,
                                          tie_embeddings=True),
    # scanned layers, affine_scaled attention (its scale/bias projections read the residual),
    # d_model 48 (not a power of two: Q from QR), head_dim 12 (random orthogonal per head), MQA
    "scan_affine_d48": dict(scan_layers=True, attention="affine_scaled", d_model=48, n_heads=4, n_kv_heads=1,
                            ffn_dim=96, max_seq_len=64),
}


def _perturb(model, seed):
    """Random norm weights (incl. qk-norm) and affine_scaled projections: a model where
    fusion is not trivial. Returns (unit-norm model, perturbed model)."""
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    key = jax.random.key(seed)

    def one(path, x):
        name = jax.tree_util.keystr(path)
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        if "scale']" in name and "proj" not in name:
            return x * (1.0 + 0.5 * jax.random.normal(k, x.shape))
        if "scale_proj" in name or "bias_proj" in name:
            return 0.3 * jax.random.normal(k, x.shape)
        return x

    return model, nnx.merge(graphdef, jax.tree_util.tree_map_with_path(one, pure))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request):
    cfg = jaxlm.ModelConfig.tiny(**CONFIGS[request.param])
    return _perturb(jaxlm.build_model(cfg, seed=0), seed=1)


@nnx.jit
def _forward(model, tokens):
    return model(tokens).logits


def _logits(model):
    out = _forward(model, TOKENS)
    chex.assert_shape(out, (*TOKENS.shape, model.config.vocab_size))
    return np.asarray(out)


def _rel(a, b):
    """Relative error against the logit spread (softmax ignores a per-token shift)."""
    b = np.asarray(b, np.float64)
    spread = np.linalg.norm(b - b.mean(-1, keepdims=True))
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / spread)


def test_each_step_preserves_the_function(models):
    unit, model = models
    base_unit, base = _logits(unit), _logits(model)
    fused = fuse_norms(model)
    assert not fused.config.tie_embeddings and fused.lm_head is not None
    norms = [fused.final_norm.scale[...]] + [
        getattr(b, n).scale[...] for b in ([fused.layers] if fused.config.scan_layers else fused.layers)
        for n in ("attn_norm", "mlp_norm")
    ]
    assert all(bool(jnp.all(w == 1)) for w in norms)
    if model.config.qk_norm:  # per-head norms after q/k_proj are kept as they are
        np.testing.assert_array_equal(np.asarray(fused.layers[0].attn.q_norm.scale[...]),
                                      np.asarray(model.layers[0].attn.q_norm.scale[...]))
    assert _rel(_logits(fused), base) < 1e-5
    rotated = rotate_residual(unit, seed=3)  # alone: the unit-norm model (a tied one stays tied)
    assert rotated.config == unit.config
    assert _rel(_logits(rotated), base_unit) < 1e-5
    assert _rel(_logits(rotate_heads(unit)), base_unit) < 1e-5
    assert _rel(_logits(quarot_transform(model, seed=3)), base) < 1e-5
    if model.config.scan_layers:  # the W4A4 pipeline (stacked TransformedWeights) without rounding
        exact = quarot_quantize(model, "nvfp4", quantize_weights=False, quantize_activations=False)
        assert _rel(_logits(exact), base) < 1e-5
    # inputs are never mutated
    np.testing.assert_array_equal(_logits(model), base)


def test_residual_stream_is_the_original_times_q(models):
    _, model = models
    d = model.config.d_model
    Q = random_orthogonal(d, seed=5)
    chex.assert_shape(Q, (d, d))
    np.testing.assert_allclose(Q.T.astype(np.float64) @ Q, np.eye(d), atol=1e-5)
    if d & (d - 1) == 0:  # randomized Hadamard: every entry +-1/sqrt(d)
        np.testing.assert_allclose(np.abs(Q), d**-0.5, rtol=1e-6)
    h0 = np.asarray(model(TOKENS, collect=("hidden",)).collected["hidden"], np.float64)
    h1 = np.asarray(quarot_transform(model, Q)(TOKENS, collect=("hidden",)).collected["hidden"])
    chex.assert_shape(h1, (model.config.n_layers, *TOKENS.shape, d))
    np.testing.assert_allclose(h1, h0 @ Q, atol=1e-5 * np.abs(h0).max())
    assert np.abs(h1 - h0).max() > 0.1 * np.abs(h0).max()  # it did rotate


def test_greedy_generation_is_unchanged():
    cfg = jaxlm.ModelConfig.tiny(**D64, qkv_bias=True, init_std=0.2)
    _, model = _perturb(jaxlm.build_model(cfg, seed=2), seed=4)
    prompts = [[5, 17, 99, 3], [40, 41]]
    a = jaxlm.generate(model, prompts, max_new_tokens=6, temperature=0, stop_tokens=())
    b = jaxlm.generate(quarot_transform(model), prompts, max_new_tokens=6, temperature=0, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


@pytest.fixture(scope="module")
def outlier_model():
    """Residual outlier channels: 4 of 64 channels of the embeddings and of every o_proj /
    down_proj output scaled by 30x (so the normed inputs of q/k/v/gate/up carry them too)."""
    cfg = jaxlm.ModelConfig.tiny(**D64, init_std=0.1)
    model = jaxlm.build_model(cfg, seed=0)
    s = np.ones(cfg.d_model, np.float32)
    s[np.random.default_rng(0).choice(cfg.d_model, 4, replace=False)] = 30.0
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    pure["embed"] = pure["embed"] * s
    for layer in pure["layers"].values():
        layer["attn"]["o_proj"]["kernel"] = layer["attn"]["o_proj"]["kernel"] * s
        layer["mlp"]["down_proj"]["kernel"] = layer["mlp"]["down_proj"]["kernel"] * s
    return nnx.merge(graphdef, pure)


def test_w4a4_error_quarot_vs_rtn_on_residual_outliers(outlier_model):
    """Measured (logit error / logit spread, W4A4, 2 layers):
    NVFP4: RTN 0.516, shared Hadamard 0.474, QuaRot 0.475;
    MXFP4: RTN 0.675, shared Hadamard 0.635, QuaRot 0.589.
    QuaRot < RTN in both formats (asserted). Under NVFP4 the per-block Hadamard ties QuaRot
    here (with a per-sequence activation scale, before, it was worse than RTN: 0.546 vs
    0.497); not asserted (docs/quantization.md)."""
    base = _logits(outlier_model)
    exact = quarot_quantize(outlier_model, "nvfp4", quantize_weights=False, quantize_activations=False)
    assert _rel(_logits(exact), base) < 1e-5  # the whole QuaRot pipeline without rounding
    errs = {}
    for fmt in ("nvfp4", "mxfp4"):
        errs[fmt] = {
            "rtn": _rel(_logits(transform_quantize_model(outlier_model, "rtn", fmt, None)), base),
            "hadamard": _rel(_logits(transform_quantize_model(outlier_model, "hadamard", fmt, None)), base),
            "quarot": _rel(_logits(quarot_quantize(outlier_model, fmt)), base),
        }
    for fmt, e in errs.items():
        assert e["quarot"] < e["rtn"], (fmt, errs)


def test_quantize_with_quarot_round_trips_through_a_checkpoint(outlier_model, tmp_path):
    from jaxlm.quant.apply import PTQ_METHODS, quantize_with

    assert "quarot" in PTQ_METHODS
    model = nnx.merge(*nnx.split(outlier_model))
    model.tokenizer = jaxlm.ByteTokenizer()
    q = quantize_with(model, "quarot", "nvfp4")
    assert q.tokenizer is not None
    jaxlm.save_checkpoint(q, tmp_path / "q")
    back = jaxlm.load_checkpoint(tmp_path / "q")
    np.testing.assert_array_equal(_logits(back), _logits(q))


def test_refused_variants_raise_clear_errors(outlier_model):
    model = outlier_model
    unit = fuse_norms(model)
    with pytest.raises(ValueError, match="call fuse_norms"):
        rotate_residual(_perturb(model, seed=1)[1])
    d = model.config.d_model
    with pytest.raises(ValueError, match="not orthogonal"):
        rotate_residual(unit, 2 * np.eye(d))
    with pytest.raises(ValueError, match=r"Q has shape \(8, 8\)"):
        rotate_residual(unit, np.eye(8))
    small = dict(d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1, max_seq_len=32)
    meta = jaxlm.abstract_model(jaxlm.ModelConfig.tiny(mlp="meta_swiglu", meta_rank=8, **small))
    for fn in (fuse_norms, rotate_residual, quarot_transform):
        with pytest.raises(ValueError, match="ModelConfig.mlp='meta_swiglu'"):
            fn(meta)
    qat = jaxlm.abstract_model(jaxlm.ModelConfig.tiny(qat_format="nvfp4", **small))
    with pytest.raises(ValueError, match="ModelConfig.qat_format='nvfp4'"):
        fuse_norms(qat)
    kvq = jaxlm.abstract_model(jaxlm.ModelConfig.tiny(kv_quant="nvfp4", **{**small, "d_model": 64}))
    with pytest.raises(ValueError, match="ModelConfig.kv_quant='nvfp4'"):
        rotate_heads(kvq)
    already = transform_quantize_model(unit, "rtn", "nvfp4", None)
    with pytest.raises(ValueError, match="already quantized"):
        fuse_norms(already)


def test_an_edit_models_next_token_head_is_transformed_too():
    """ME-DLM edit models read the final norm's output with a second head (``next_logits``):
    fusion scales it and the rotation rotates it, like ``lm_head``."""
    cfg = jaxlm.ModelConfig.tiny(mode="diffusion", mask_token_id=1, next_token_head=True, **D64)
    _, model = _perturb(jaxlm.build_model(cfg, seed=0), seed=2)
    base = model(TOKENS)
    for transformed in (fuse_norms(model), quarot_transform(model, seed=3)):
        out = transformed(TOKENS)
        assert _rel(out.logits, base.logits) < 1e-5
        assert _rel(out.next_logits, base.next_logits) < 1e-5
