"""A quantization-aware-trained model (``ModelConfig.qat_format``) -> stored 4-bit weights
(`jaxlm.quant.qat_export.export_qat`): the same function as the QAT forward, real 4-bit
storage, checkpoints, ``jaxlm quantize --method qat`` and the CLI loading the result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.models.params import flat_params, model_from_flat
from jaxlm.quant.apply import quantize_with
from jaxlm.quant.formats import QArray, dequantize, fake_quant, quantize
from jaxlm.quant.qat_export import ActQuantWeight, export_qat, qat_projections
from token_independence import assert_independent_of_padding_and_cache
from trainers.cli import main

# init_std 0.1: a spread-out function (a 0.02 model's logits are nearly flat); k_shift and an
# E1M2 KV cache on, so the export is checked with everything a ReQAT model carries
CFG = jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64,
                             init_std=0.1, qat_format="nvfp4", kv_quant="e1m2", k_shift=True)
PROJ = ("attn.k_proj", "attn.o_proj", "attn.q_proj", "attn.v_proj", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj")


def _qat_model(scan=False, cfg=CFG):
    flat = flat_params(jaxlm.build_model(cfg.replace(scan_layers=scan), seed=0))
    rng = np.random.default_rng(1)
    for i in range(cfg.n_layers):
        flat[f"layers.{i}.attn.k_shift"] = jnp.asarray(rng.normal(size=(2, 16)), jnp.float32)
    model = model_from_flat(cfg.replace(scan_layers=scan), flat)
    model.tokenizer = jaxlm.ByteTokenizer()
    return model


def _rel(a, b):
    """Relative error against the logit spread (softmax ignores a per-token shift)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b - b.mean(-1, keepdims=True)))


@nnx.jit
def _forward(model, tokens, valid):
    return model(tokens, mask=valid).logits


def _batch(B=8, T=32, seed=0):
    rng = np.random.default_rng(seed)
    valid = np.arange(T)[None] < rng.integers(T // 2, T + 1, (B, 1))  # right-padded rows
    return jnp.asarray(rng.integers(1, 256, (B, T)), jnp.int32), jnp.asarray(valid)


def test_weight_fake_quant_is_the_stored_weight():
    """Per projection: the QAT forward's fake-quantized weight equals the stored QArray
    dequantized, bit for bit (same blocks along the input axis, same RTN rounding, same
    NVFP4 tensor scale), and the activations are quantized by the same call."""
    w = jax.random.normal(jax.random.key(0), (64, 128)) * jnp.linspace(0.1, 3.0, 128)
    np.testing.assert_array_equal(np.asarray(fake_quant(w, "nvfp4", axis=-2)),
                                  np.asarray(dequantize(quantize(w, "nvfp4", axis=-2))))
    model = _qat_model()
    exported = export_qat(model)
    x = jax.random.normal(jax.random.key(1), (3, 5, 64))
    qat, exp = model.layers[0].mlp.up_proj, exported.layers[0].mlp.up_proj
    tw = exp.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(dequantize(tw.weight)), np.asarray(fake_quant(qat.kernel[...], "nvfp4", axis=-2)))
    np.testing.assert_allclose(np.asarray(exp(x)), np.asarray(qat(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # the W4A4 version in tests/quant/test_transforms.py runs by default
def test_qat_model_does_not_depend_on_padding_or_cache_length():
    """Activations are quantized per token, so a token's logits do not depend on the other
    tokens of the call: left padding or the cache length (which changes what padded query
    rows see) leave the real positions' logits unchanged, and cached greedy decoding equals
    recomputation without a cache (with a per-call NVFP4 tensor scale, the cache length
    alone moved this model's logits by ~1)."""
    assert_independent_of_padding_and_cache(_qat_model())


@pytest.mark.parametrize("scan", [False, True])
def test_exported_model_computes_the_qat_model(scan):
    """The QAT forward already runs the stored-weight matmul (`qat_linear`: forward
    ``linear(x_q, quantize(W))``, straight-through backward) and the export quantizes under
    jit as that forward runs, so every projection computes the same bits. Unrolled layers:
    the compiled models' logits are bit-identical. Scanned: the projections still agree
    exactly, but XLA fuses the attention inside the two ``lax.scan`` bodies differently and
    leaves float32 ulps (measured 1.5e-7 of the logit spread); bound 1e-5. (Before the two
    paths were aligned, ulps in every projection flipped a 4-bit code now and then and moved
    a trained model's logits by 2.6e-2 of their spread.) Every projection holds a `QArray`
    (packed uint8 codes)."""
    model = _qat_model(scan)
    exported = export_qat(model)
    assert qat_projections(model) == PROJ and qat_projections(exported) == ()
    c = exported.config
    assert c.qat_format is None and c.kv_quant == "e1m2" and c.k_shift and c.scan_layers == scan
    tokens, valid = _batch()
    got, want = _forward(exported, tokens, valid), _forward(model, tokens, valid)
    if scan:
        print("scanned: exported vs QAT logits, relative to the spread:", _rel(got, want))
        assert _rel(got, want) < 1e-5
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state = nnx.to_pure_dict(nnx.split(exported)[1])
    weights = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ActQuantWeight))
               if isinstance(x, ActQuantWeight)]
    assert len(weights) == (7 if scan else 14)
    for w in weights:
        assert isinstance(w.weight, QArray) and w.weight.codes.dtype == jnp.uint8 and w.act_format.name == "nvfp4"


def test_storage_bytes():
    """Bytes of the 14 projections (2 layers, 73,728 weights): fp32 kernels 294,912 B vs
    stored NVFP4 41,528 B (4-bit codes + one E4M3 scale per 16 + a 4-byte tensor scale per
    matrix: 7.1x smaller)."""
    model = _qat_model()
    exported = export_qat(model)
    dense = sum(v.nbytes for k, v in flat_params(model).items() if k.endswith("_proj.kernel"))
    q = [v for k, v in flat_params(exported).items() if k.endswith("_proj.kernel")]
    stored = sum(w.weight.nbytes + w.weight.global_scale.nbytes for w in q)
    print(f"projections: fp32 {dense} B, NVFP4 {stored} B ({dense / stored:.2f}x)")
    assert stored == sum(np.prod(w.weight.shape) * 9 // 16 + 4 for w in q)
    assert dense / stored > 7


@pytest.mark.parametrize("scan", [False, True])
def test_checkpoint_round_trip_is_bit_identical(tmp_path, scan):
    exported = export_qat(_qat_model(scan))
    jaxlm.save_checkpoint(exported, tmp_path / "q")
    back = jaxlm.load_checkpoint(tmp_path / "q")
    assert back.config == exported.config
    leaf = (back.layers if scan else back.layers[0]).attn.q_proj.kernel.get_value()
    assert isinstance(leaf, ActQuantWeight) and isinstance(leaf.weight, QArray)
    tokens, valid = _batch()
    np.testing.assert_array_equal(np.asarray(_forward(back, tokens, valid)), np.asarray(_forward(exported, tokens, valid)))


def test_quantize_with_routes_and_refuses():
    model = _qat_model()
    out = quantize_with(model, "qat", "nvfp4")
    assert out.config.qat_format is None
    with pytest.raises(ValueError, match="qat_format='nvfp4'.*method 'qat'"):
        quantize_with(model, "wush", "nvfp4", ["1+1=2"])
    with pytest.raises(ValueError, match="format 'mxfp4' conflicts with the model's ModelConfig.qat_format='nvfp4'"):
        quantize_with(model, "qat", "mxfp4")
    with pytest.raises(ValueError, match="weights_only"):
        quantize_with(model, "qat", "nvfp4", weights_only=True)
    plain = jaxlm.build_model(jaxlm.ModelConfig.tiny(), seed=0)
    with pytest.raises(ValueError, match="qat_format=None"):
        quantize_with(plain, "qat", "nvfp4")
    with pytest.raises(ValueError, match="qat_format is None"):
        export_qat(plain)


@pytest.mark.slow  # the quantize verb is checked end to end by the GPTQ and A^3 CLI tests
def test_cli_quantize_qat_then_eval_and_generate(tmp_path, capsys):
    model = _qat_model(scan=True)
    jaxlm.save_checkpoint(model, tmp_path / "m")
    main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q"), "--method", "qat", "--format", "nvfp4",
          "--calibration-n", "4", "--eval-n", "4"])
    assert "qat nvfp4 W4A4" in capsys.readouterr().out
    back = jaxlm.load_checkpoint(tmp_path / "q")
    assert back.config.qat_format is None and isinstance(back.layers.mlp.up_proj.kernel.get_value(), ActQuantWeight)
    main(["eval", "--model", str(tmp_path / "q"), "--n", "4", "--max-new-tokens", "4"])
    main(["generate", "--model", str(tmp_path / "q"), "--prompt", "12+30=", "--max-new-tokens", "4", "--temperature", "0"])
    assert "'12+30=' ->" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q2"), "--method", "qat", "--eval-n", "4"])
    assert e.value.code == 2 and "ModelConfig.qat_format='nvfp4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q3"), "--method", "rtn", "--format", "nvfp4"])
    assert "--method qat" in capsys.readouterr().err
