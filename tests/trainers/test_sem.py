"""Selective entropy minimisation (ReQAT's SEM) against a numpy reference of the code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers.config import SFTConfig
from trainers.losses import next_token_targets, sem_entropy_sum, sem_weights, sft_loss_sum, token_entropy


def _batch(seed=0, B=3, T=9, V=11):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    loss_mask = rng.random((B, T)) < 0.8
    seg = np.ones((B, T), np.int32)
    seg[2, 6:] = 0  # padding
    logits = (rng.normal(size=(B, T, V)) * rng.uniform(0.2, 4.0, (B, T, 1))).astype(np.float32)
    return {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": seg}, logits


def _numpy_sem(logits, valid, threshold):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    H = -(p * np.log(p)).sum(-1)
    h = np.sort(H[valid])
    k = max(int(np.floor(len(h) * threshold)), 1)
    tau, h_min = h[k - 1], h[0]
    w = np.clip(1 - (H - h_min) / (tau - h_min + 1e-12), 0, None) * valid
    return H, w, float((w * H).sum())


def test_token_entropy_of_a_banned_token_is_zero_log_zero():
    """A -inf logit is a token of probability 0: it adds 0 log 0 = 0, not NaN."""
    logits = np.array([[[1.0, 2.0, -np.inf, 0.5]]], np.float32)
    p = np.exp(logits[0, 0, [0, 1, 3]] - logits[0, 0, [0, 1, 3]].max())
    p /= p.sum()
    np.testing.assert_allclose(np.asarray(token_entropy(jnp.asarray(logits)))[0, 0], -(p * np.log(p)).sum(), rtol=1e-6)
    grad = jax.grad(lambda x: token_entropy(x).sum())(jnp.asarray(logits))
    assert np.isfinite(np.asarray(grad)).all()


@pytest.mark.parametrize("threshold", [0.25, 0.75, 1.0])
def test_sem_weights_and_term_match_numpy(threshold):
    batch, logits = _batch()
    _, valid = next_token_targets({k: jnp.asarray(v) for k, v in batch.items()})
    valid = np.asarray(valid)
    H, w, total = _numpy_sem(logits.astype(np.float64), valid, threshold)
    np.testing.assert_allclose(np.asarray(token_entropy(jnp.asarray(logits))), H, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sem_weights(jnp.asarray(H, jnp.float32), jnp.asarray(valid), threshold)),
                               w, rtol=1e-4, atol=1e-5)
    got = float(sem_entropy_sum(jnp.asarray(logits), {k: jnp.asarray(v) for k, v in batch.items()}, threshold))
    assert got == pytest.approx(total, rel=1e-4)
    assert (w > 0).sum() <= max(int(np.floor(valid.sum() * threshold)), 1)  # only tokens below tau


@pytest.mark.parametrize("n, threshold, k", [(180, 0.65, 117), (180, 0.35, 63), (90, 0.7, 63), (7, 0.25, 1),
                                             (3, 0.1, 1), (1000, 0.65, 650), (2000, 0.0015, 3), (3000, 0.3333, 999),
                                             (10000, 0.12345, 1234)])
def test_sem_cutoff_is_floor_of_n_times_the_threshold_as_written(n, threshold, k):
    """tau is the k-th smallest entropy, k = floor(N x threshold) exactly (180 x 0.65 = 117: in
    float32, 0.65 is 0.6499999762 and the product floors to 116)."""
    H = jnp.arange(n, dtype=jnp.float32)  # distinct entropies: the k-th smallest is k - 1
    w = np.asarray(sem_weights(H, jnp.ones(n, bool), threshold))
    # weights fall to 0 at tau = H[k - 1] (up to float32 rounding of (H - H_min) / (tau - H_min))
    assert w[0] == 1.0 and (w[1:k - 1] > 1e-6).all() and (w[k:] == 0).all()
    assert k == 1 or w[k - 1] <= 1e-6


def test_sem_gradient_flows_through_entropy_not_weights():
    """d/dz of sum_t w_t H_t with w frozen: lowering a weighted token's entropy is rewarded,
    and tokens with weight 0 (above tau) get no gradient from the term."""
    batch, logits = _batch(1)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    g = jax.grad(lambda z: sem_entropy_sum(z, b, 0.25))(jnp.asarray(logits))
    _, valid = next_token_targets(b)
    H = token_entropy(jnp.asarray(logits))
    w = sem_weights(H, valid, 0.25)
    frozen = jax.grad(lambda z: jnp.sum(jax.lax.stop_gradient(w) * token_entropy(z)))(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(g), np.asarray(frozen), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(g)[np.asarray(w) == 0] == 0)
    ce, n = sft_loss_sum(jnp.asarray(logits), b)
    assert float(n) == float(valid.sum()) and float(ce) > 0


def test_sem_config_errors():
    with pytest.raises(ValueError, match="sem_threshold=0"):
        SFTConfig(sem_threshold=0.0)
    with pytest.raises(ValueError, match="sem_lambda=-1"):
        SFTConfig(sem_lambda=-1.0)
    # NaN / inf pass a plain ">= 0"; a negative beta_l1 rewards growing |beta|
    for field, value in (("sem_lambda", float("inf")), ("beta_l1", -1.0), ("beta_l1", float("nan"))):
        with pytest.raises(ValueError, match=rf"algorithm.{field}={value!r} is invalid: must be a finite number >= 0"):
            SFTConfig(**{field: value})
