"""TwinQuant at model level: `LowRankTransformedWeight` in the unchanged model (unrolled and
scan-stacked layers), checkpoints, and ``jaxlm quantize --method twinquant``.

Every projection is [64, 64] (d_model 64, 2 heads of 32 without GQA, ffn 64) and one small
optimisation setting is used everywhere, so the compiled TwinQuant loop is shared by all
projections, layers and tests (one compile per activation setting)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.data.tasks import Arithmetic
from jaxlm.quant import twinquant as tq
from jaxlm.quant.apply import PTQ_METHODS, calibration_batches
from jaxlm.quant.twinquant import LowRankTransformedWeight, TwinQuantConfig, twinquant_quantize_model
from jaxlm.quant.w4a4 import transform_quantize_model

SHAPE = dict(d_model=64, n_heads=2, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
CFG = TwinQuantConfig(rank=8, steps=8, batch=128)


def _rel(a, b):
    """Relative error against the logit spread (softmax ignores a per-token shift)."""
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b - b.mean(-1, keepdims=True)))


@nnx.jit
def _forward(model, tokens, valid):
    return model(tokens, mask=valid).logits


def _logits(model, batch):
    return np.asarray(_forward(model, *map(jnp.asarray, batch)))


@pytest.fixture(scope="module")
def calib():
    texts = [e["prompt"] + e["completion"] for e in (Arithmetic(digits=2).example(i, "train") for i in range(64))]
    batches = calibration_batches(jaxlm.ByteTokenizer(), texts, batch_size=32, seq_len=32)
    assert sum(int(np.asarray(v).sum()) for _, v in batches) >= 512  # full 512-row samples
    return batches


@pytest.fixture(scope="module")
def outlier_model():
    """Scanned layers; 4 of 64 channels of every attn/MLP norm weight scaled 20x, so the
    inputs of q/k/v/gate/up carry outlier channels."""
    cfg = jaxlm.ModelConfig.tiny(**SHAPE, scan_layers=True, init_std=0.1)
    model = jaxlm.build_model(cfg, seed=0, tokenizer=jaxlm.ByteTokenizer())
    s = np.ones(cfg.d_model, np.float32)
    s[np.random.default_rng(0).choice(cfg.d_model, 4, replace=False)] = 20.0
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    for norm in ("attn_norm", "mlp_norm"):
        pure["layers"][norm]["scale"] = pure["layers"][norm]["scale"] * s
    out = nnx.merge(graphdef, pure)
    out.tokenizer = model.tokenizer
    return out


@pytest.fixture(scope="module")
def quantized(outlier_model, calib):
    return twinquant_quantize_model(outlier_model, "nvfp4", calib, cfg=CFG)


@pytest.mark.parametrize("scan", [False, True])
def test_exact_before_quantization(calib, scan):
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**SHAPE, scan_layers=scan), seed=0)
    exact = twinquant_quantize_model(model, "nvfp4", calib, cfg=CFG, quantize_weights=False,
                                     quantize_activations=False)
    layers = exact.layers if scan else exact.layers[0]
    w = layers.attn.q_proj.kernel.get_value()
    assert isinstance(w, LowRankTransformedWeight) and w.P.shape[-2:] == (64, 8)
    if scan:
        assert w.P.shape == (2, 64, 8) and w.T.shape == (2, 4, 16, 16)  # stacked per layer
    assert _rel(_logits(exact, calib[0]), _logits(model, calib[0])) < 1e-5


def test_generate_and_checkpoint_round_trip(quantized, calib, tmp_path):
    w = quantized.layers.mlp.down_proj.kernel.get_value()
    assert type(w.residual.weight).__name__ == "QArray" and w.residual.act_format is not None
    out = jaxlm.generate(quantized, ["12+30="], max_new_tokens=4, temperature=0)
    assert np.asarray(out.tokens).shape[0] == 1
    jaxlm.save_checkpoint(quantized, tmp_path / "q")
    back = jaxlm.load_checkpoint(tmp_path / "q")
    assert isinstance(back.layers.attn.q_proj.kernel.get_value(), LowRankTransformedWeight)
    np.testing.assert_array_equal(_logits(back, calib[0]), _logits(quantized, calib[0]))


def test_w4a4_logit_error_twinquant_below_rtn_on_outlier_inputs(outlier_model, quantized, calib):
    """Measured (logit error / logit spread, NVFP4 W4A4, rank 8, 8 steps, a calibration
    batch): RTN 0.676, TwinQuant 0.569."""
    batch = calib[1]
    base = _logits(outlier_model, batch)
    err = {"rtn": _rel(_logits(transform_quantize_model(outlier_model, "rtn", "nvfp4", None), batch), base),
           "twinquant": _rel(_logits(quantized, batch), base)}
    assert err["twinquant"] < err["rtn"], err


@pytest.mark.slow  # the quantize verb is checked end to end by the GPTQ and A^3 CLI tests
def test_cli_quantize_twinquant_then_eval(tmp_path, monkeypatch, capsys):
    from trainers.cli import main

    assert "twinquant" in PTQ_METHODS
    monkeypatch.setattr(tq, "MODEL_CONFIG", CFG)  # the tests' short setting (shared compiles)
    # scanned layers: the decode loops of the CLI's accuracy checks compile once per layer stack
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(**SHAPE, scan_layers=True), seed=0,
                              tokenizer=jaxlm.ByteTokenizer())
    jaxlm.save_checkpoint(model, tmp_path / "m")
    main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q"), "--method", "twinquant",
          "--format", "nvfp4", "--calibration-n", "64", "--eval-n", "4"])
    assert "twinquant nvfp4 W4A4" in capsys.readouterr().out
    back = jaxlm.load_checkpoint(tmp_path / "q")
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.split(back)[1]),
                             is_leaf=lambda x: isinstance(x, LowRankTransformedWeight))
    tw = [x for x in leaves if isinstance(x, LowRankTransformedWeight)]
    assert len(tw) == 7 and all(x.P.shape[0] == back.config.n_layers for x in tw)  # stacked per layer
    main(["eval", "--model", str(tmp_path / "q"), "--n", "4", "--max-new-tokens", "4"])
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q2"), "--method", "rtn", "--rank", "8"])
    assert e.value.code == 2 and "--rank applies to --method twinquant" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a traceback and exit 1 before
        main(["quantize", str(tmp_path / "m"), "--out", str(tmp_path / "q3"), "--method", "twinquant", "--rank", "inf"])
    assert e.value.code == 2 and "--rank inf is invalid" in capsys.readouterr().err
