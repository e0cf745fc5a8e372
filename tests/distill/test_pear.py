"""PEAR importance weights against a numpy loop written from the method's definition (card
B.5), for each variant, on packed rows with untrained gaps and padding."""

import jax.numpy as jnp
import numpy as np
import pytest

from trainers.pear import PEARConfig, pear_log_weights, pear_weights


def np_log_weights(ell, valid, seg, variant, gamma, block):
    """Per document, over its trained positions in order: the discounted suffix sums of the
    per-block log-ratio sums (sequence: one block, no discount; token: blocks of one)."""
    out = np.zeros_like(ell)
    for r in range(ell.shape[0]):
        for doc in set(seg[r][seg[r] > 0].tolist()):
            ts = [t for t in range(ell.shape[1]) if valid[r, t] and seg[r, t] == doc]
            size = len(ts) if variant == "sequence" else (1 if variant == "token" else block)
            g = 1.0 if variant == "sequence" else gamma
            blocks = [ts[i:i + size] for i in range(0, len(ts), size)]
            sums = [sum(ell[r, t] for t in b) for b in blocks]
            for bi, b in enumerate(blocks):
                w = sum(g ** (bj - bi) * sums[bj] for bj in range(bi, len(blocks)))
                for t in b:
                    out[r, t] = w
    return out


def _rows(seed, B=3, T=29):
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    seg[0, :10], seg[0, 10:22], seg[0, 22:27] = 1, 2, 3  # three packed documents, padding
    seg[1, :] = 1  # one document filling the row
    seg[2, :4] = 1  # a short one
    valid = (rng.random((B, T)) < 0.7) & (seg > 0)
    valid[0, 3:6] = False  # an untrained gap inside a document
    ell = rng.normal(size=(B, T)) * 0.37
    return ell, valid, seg


@pytest.mark.parametrize("variant", ["sequence", "token", "block"])
@pytest.mark.parametrize("gamma", [0.0, 0.61, 1.0])
def test_log_weights_match_numpy_loop(variant, gamma):
    ell, valid, seg = _rows(0)
    cfg = PEARConfig(variant=variant, gamma=gamma, block_size=3)
    got = pear_log_weights(jnp.asarray(ell), jnp.asarray(valid), jnp.asarray(seg), cfg)
    np.testing.assert_allclose(got, np_log_weights(ell, valid, seg, variant, gamma, 3), rtol=1e-5, atol=1e-5)


def test_gamma_zero_is_the_per_token_ratio_and_one_the_full_suffix():
    ell, valid, seg = _rows(1)
    per_token = pear_log_weights(jnp.asarray(ell), jnp.asarray(valid), jnp.asarray(seg),
                                 PEARConfig(variant="token", gamma=0.0))
    np.testing.assert_allclose(per_token, np.where(valid, ell, 0.0), atol=1e-6)
    suffix = pear_log_weights(jnp.asarray(ell), jnp.asarray(valid), jnp.asarray(seg),
                              PEARConfig(variant="token", gamma=1.0))
    for r, t in zip(*np.nonzero(valid)):
        later = [k for k in range(t, ell.shape[1]) if valid[r, k] and seg[r, k] == seg[r, t]]
        np.testing.assert_allclose(suffix[r, t], ell[r, later].sum(), rtol=1e-5, atol=1e-5)


def test_weights_clip_and_use_the_shifted_columns():
    """Position t scores token t + 1: the weights read the behaviour (and fixed target)
    log-probs of the next token; log w is clipped to [-c, c]."""
    B, T = 1, 6
    beh = np.array([[0.0, -1.0, -2.0, -3.0, -0.5, 0.0]], np.float32)
    tgt = np.array([[0.0, -0.5, -9.0, -1.0, -0.5, 0.0]], np.float32)
    batch = {"segment_ids": jnp.ones((B, T), jnp.int32), "behavior_logprobs": jnp.asarray(beh),
             "target_logprobs": jnp.asarray(tgt)}
    valid = jnp.asarray([[True, True, True, True, False, False]])
    cfg = PEARConfig(variant="token", gamma=0.0, clip=2.0, target="fixed")
    w = pear_weights(jnp.zeros((B, T)), batch, valid, cfg)
    ell = (tgt - beh)[0, 1:5]  # targets of positions 0..3 are tokens 1..4
    np.testing.assert_allclose(w[0, :4], np.exp(np.clip(ell, -2, 2)), rtol=1e-6)
    np.testing.assert_array_equal(w[0, 4:], 0.0)
    # target = current: the given log-probs of the targets are pi
    current = pear_weights(jnp.asarray([[-0.5, -9.0, -1.0, -0.5, 0.0, 0.0]]), batch, valid,
                           PEARConfig(variant="token", gamma=0.0, clip=2.0))
    np.testing.assert_allclose(current, w, rtol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(variant="suffix"), "variant"), (dict(gamma=1.5), "gamma"), (dict(block_size=0), "block_size"),
    (dict(clip=0.0), "clip"), (dict(target="teacher"), "target"),
    (dict(normalize="no"), "normalize='no' is invalid"),  # a truthy string self-normalised
])
def test_bad_config_names_the_field(bad, match):
    with pytest.raises(ValueError, match=f"algorithm.pear.{match}"):
        PEARConfig(**bad)


def test_gamma_zero_ignores_an_infinite_later_ratio():
    """gamma = 0 is the per-token ratio: an infinite log-ratio at one token (a behaviour
    log-prob of -inf) must not reach the earlier tokens (0 * inf would be NaN)."""
    ell = np.array([[0.1, -0.2, np.inf, 0.3]], np.float32)
    valid = np.ones((1, 4), bool)
    seg = np.ones((1, 4), np.int32)
    got = np.asarray(pear_log_weights(jnp.asarray(ell), jnp.asarray(valid), jnp.asarray(seg),
                                      PEARConfig(variant="token", gamma=0.0)))
    np.testing.assert_array_equal(got, ell)


def test_unclipped_weights_stay_finite_and_self_normalise():
    """clip=inf on a long document (sum of 119 log-ratios of 1 in the sequence variant): e^119
    overflowed float32 and the self-normalised loss was inf / inf = NaN. log w is held within
    50, so the weighted mean equals the float64 one: the heavy document takes all the weight."""
    B, T = 2, 120
    beh = np.zeros((B, T), np.float32)
    beh[0] = -1.0  # row 0: every target 1 nat likelier under pi than under mu
    batch = {"segment_ids": jnp.ones((B, T), jnp.int32), "behavior_logprobs": jnp.asarray(beh)}
    valid = np.ones((B, T), bool)
    valid[:, -1] = False
    w = np.asarray(pear_weights(jnp.zeros((B, T)), batch, jnp.asarray(valid),
                                PEARConfig(variant="sequence", clip=float("inf"))), np.float64)
    assert np.isfinite(w).all() and np.isfinite(w.sum())
    ce = np.where(np.arange(B)[:, None] == 0, 0.3, 2.0) * valid
    np.testing.assert_allclose((w * ce).sum() / w.sum(), 0.3, rtol=1e-6)
    # a whole batch at the limit: its float32 sums stay finite (at e^80, 4 x 2048 tokens
    # overflowed and the loss was NaN); equal weights give the plain mean
    B, T = 4, 2048
    batch = {"segment_ids": jnp.ones((B, T), jnp.int32), "behavior_logprobs": -jnp.ones((B, T))}
    w = pear_weights(jnp.zeros((B, T)), batch, jnp.ones((B, T), bool), PEARConfig(variant="sequence", clip=float("inf")))
    ce = jnp.full((B, T), 5.0)
    total, count = jnp.sum(w * ce), jnp.sum(w)
    assert np.isfinite(float(total)) and np.isfinite(float(count))
    np.testing.assert_allclose(float(total / count), 5.0, rtol=1e-5)
