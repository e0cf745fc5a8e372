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


def test_input_samples_are_uniform_over_the_whole_calibration_set():
    """TwinQuant's input rows: a uniform draw without replacement over every valid token of
    every batch, so a small batch is not over-represented (each row kept with probability
    n / N), in the set's order, each row the model's actual input at that token."""
    from jaxlm.quant.calibrate import input_samples

    cfg = jaxlm.ModelConfig.tiny(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    rng = np.random.default_rng(1)
    model = model_from_flat(cfg, {k: 0.2 * rng.standard_normal(v.shape).astype(np.float32)
                                  for k, v in param_shapes(cfg).items()})
    big = (rng.integers(0, cfg.vocab_size, (20, 100)).astype(np.int32), np.ones((20, 100), bool))
    small_valid = np.zeros((2, 100), bool)
    small_valid[0] = True  # 100 valid rows, 100 padding rows
    small = (rng.integers(0, cfg.vocab_size, (2, 100)).astype(np.int32), small_valid)
    big[0][:, 0], small[0][:, 0] = np.arange(20), np.arange(20, 22)  # distinct first tokens: distinct rows
    every = input_samples(model, [big, small], ("mlp.down_proj",), n=10**6)["mlp.down_proj"][0]  # [2100, C]
    assert every.shape[0] == 2100
    index = {row.tobytes(): i for i, row in enumerate(every)}
    n, seeds = 50, 200
    from_small = 0
    for seed in range(seeds):
        got = input_samples(model, [big, small], ("mlp.down_proj",), n=n, seed=seed)["mlp.down_proj"][0]
        picked = [index[row.tobytes()] for row in got]
        assert len(picked) == n == len(set(picked)) and picked == sorted(picked)
        from_small += sum(i >= 2000 for i in picked)
    # hypergeometric: mean n K / N per draw, within 4 standard deviations over the seeds
    N, K = 2100, 100
    mean = seeds * n * K / N
    sd = np.sqrt(seeds * n * (K / N) * (1 - K / N) * (N - n) / (N - 1))
    assert abs(from_small - mean) < 4 * sd, (from_small, mean, sd)
