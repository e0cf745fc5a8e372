"""Calibration runs each batch in row slices bounded by `CALIBRATION_BYTES` of taps (all
layers at once): the second moments equal the one-forward ones, padding of the last slice
included."""

import jax.numpy as jnp
import numpy as np

import jaxlm
import jaxlm.quant.calibrate as calibrate
from jaxlm.models.params import model_from_flat, param_shapes
from jaxlm.quant.calibrate import input_second_moments


def test_sliced_calibration_equals_one_forward(monkeypatch):
    cfg = jaxlm.ModelConfig.tiny(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    rng = np.random.default_rng(0)
    model = model_from_flat(cfg, {k: 0.2 * rng.standard_normal(v.shape).astype(np.float32)
                                  for k, v in param_shapes(cfg).items()})
    tokens = rng.integers(0, cfg.vocab_size, (5, 16)).astype(np.int32)
    valid = np.ones((5, 16), bool)
    valid[3, 9:] = False
    whole = input_second_moments(model, [(tokens, valid)])
    # taps per row: L x T x (attn_in + attn_ctx + mlp_in + mlp_act) float32
    row_bytes = 4 * cfg.n_layers * 16 * (2 * cfg.d_model + cfg.o_dim + cfg.ffn_dim)
    calls = []
    sums = calibrate._sums
    monkeypatch.setattr(calibrate, "_sums", lambda *a, **k: calls.append(a[2].shape) or sums(*a, **k))
    monkeypatch.setattr(calibrate, "CALIBRATION_BYTES", 2 * row_bytes)
    sliced = input_second_moments(model, [(tokens, valid)])
    assert calls == [(2, 16)] * 3  # 2 + 2 + 1 rows, the last slice padded to 2
    for name in whole:
        np.testing.assert_allclose(np.asarray(sliced[name]), np.asarray(whole[name]),
                                   atol=1e-6 * float(jnp.abs(whole[name]).max()))
