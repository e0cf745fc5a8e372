"""Q-FIT (ReQAT): paired pre-RoPE key scaling folded into W_q / W_k and a post-RoPE key
shift leave the model's outputs unchanged before quantization, and lower the error of a
KV4 (E1M2) cache on a trained model."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.data.tasks import Arithmetic
from jaxlm.editing.kfac import token_batches
from jaxlm.interp.interventions import kv_fake_quant
from jaxlm.quant.qfit import apply_qfit, qfit_calibrate, qfit_shift
from tiny_training import train_tiny

TASK = Arithmetic(digits=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = jaxlm.load_checkpoint(train_tiny(
        tmp_path_factory.mktemp("qfit"), TASK, steps=200, eval_examples=16,
        model=jaxlm.ModelConfig.tiny(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64),
    ))
    texts = lambda split, n: [e["prompt"] + e["completion"] for e in (TASK.example(i, split) for i in range(n))]  # noqa: E731
    cal = list(token_batches(model.tokenizer, texts("train", 64), batch_size=64, seq_len=16))
    held = next(token_batches(model.tokenizer, texts("eval", 128), batch_size=128, seq_len=16))
    return model, cal, tuple(map(jnp.asarray, held))


def test_qfit_transforms_are_exact_before_quantization(trained):
    model, cal, (tokens, valid) = trained
    res = qfit_calibrate(model, cal, grid=10)
    assert float(res.alpha_s.max()) > 0 or float(res.alpha_m.max()) > 0  # something to check
    forced = res.replace(alpha_s=jnp.full_like(res.alpha_s, 0.9), alpha_m=jnp.full_like(res.alpha_m, 0.9))
    base = model(tokens, mask=valid).logits
    for r in (res, forced):
        got = apply_qfit(model, r)(tokens, mask=valid, interventions=(qfit_shift(r),)).logits
        np.testing.assert_allclose(np.asarray(got), np.asarray(base), rtol=1e-5, atol=1e-4)
    # the scale alone changes keys (not a no-op) but not the function
    scaled = apply_qfit(model, forced)
    k0 = model(tokens, mask=valid, collect=("k",)).collected["k"]
    k1 = scaled(tokens, mask=valid, collect=("k",)).collected["k"]
    assert float(jnp.abs(k0 - k1).max()) > 1e-3


def test_qfit_lowers_the_kv4_error(trained):
    """Measured: mean |logit error| under an E1M2 KV cache on held-out problems 0.076 without
    Q-FIT vs 0.062 with it (quickstart model: 0.264 vs 0.180); the calibration attention-output
    error is never higher (the grid contains alpha = 0)."""
    model, cal, (tokens, valid) = trained
    res = qfit_calibrate(model, cal)
    assert np.all(np.asarray(res.error) <= np.asarray(res.error_none))
    assert np.any(np.asarray(res.error) < 0.95 * np.asarray(res.error_none))
    base = model(tokens, mask=valid).logits
    kv = kv_fake_quant("e1m2", n_layers=model.config.n_layers)
    plain = float(jnp.mean(jnp.abs(model(tokens, mask=valid, interventions=kv).logits - base)))
    fitted = apply_qfit(model, res)
    qfit = float(jnp.mean(jnp.abs(fitted(tokens, mask=valid, interventions=(qfit_shift(res), *kv)).logits - base)))
    print("KV4 logit error: none", plain, "q-fit", qfit)
    assert qfit < plain


def test_qfit_errors():
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(qk_norm=True), seed=0)
    res = qfit_calibrate(model, [(np.ones((1, 4), np.int32), np.ones((1, 4), bool))], grid=2)
    with pytest.raises(ValueError, match="qk_norm"):
        apply_qfit(model, res)
    odd = jaxlm.build_model(jaxlm.ModelConfig.tiny(d_model=40, n_heads=4, n_kv_heads=2), seed=0)  # head_dim 10
    with pytest.raises(ValueError, match="head_dim=10"):
        qfit_calibrate(odd, [(np.ones((1, 4), np.int32), np.ones((1, 4), bool))])
