"""Distillation divergences against numpy/scipy references written from their definitions,
including the tail-aware identity KL = (head + bucket KL) + p_T * (renormalised-tail KL)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

from trainers.distill.divergences import (
    DIVERGENCES,
    bucket_from_head,
    bucketed,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    tail_aware,
    tail_aware_parts,
)


def _dists(seed, n=6, V=13, scale=2.3):
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(size=(n, V)) * scale)
    q = np.exp(rng.normal(size=(n, V)) * 1.7)
    p[0, 3] = 0.0  # a zero-probability teacher bin
    p[1, :] = 0.7  # a flat teacher: every top-K is a tie
    p /= p.sum(-1, keepdims=True)
    q /= q.sum(-1, keepdims=True)
    return p, q


@np.errstate(divide="ignore", invalid="ignore")
def np_kl(p, q):
    out = np.zeros(p.shape[0])
    for i in range(p.shape[0]):
        nz = p[i] > 0
        out[i] = np.sum(p[i, nz] * np.log(p[i, nz] / q[i, nz]))
    return out


@np.errstate(divide="ignore", invalid="ignore")
def np_tail_aware(p, q, k, beta):
    """From the paper's definition: KL over the teacher's top-k and one tail bucket, plus beta
    times the KL of the renormalised tails (ties by the lower index, as lax.top_k)."""
    out = np.zeros(p.shape[0])
    for i in range(p.shape[0]):
        head = np.argsort(-p[i], kind="stable")[:k]
        tail = np.setdiff1d(np.arange(p.shape[1]), head)
        pT, qT = p[i, tail].sum(), q[i, tail].sum()
        bins_p = np.concatenate([p[i, head], [pT]])
        bins_q = np.concatenate([q[i, head], [qT]])
        nz = bins_p > 0
        bucket = np.sum(bins_p[nz] * np.log(bins_p[nz] / bins_q[nz]))
        pt, qt = p[i, tail] / pT, q[i, tail] / qT
        nz = pt > 0
        out[i] = bucket + beta * np.sum(pt[nz] * np.log(pt[nz] / qt[nz]))
    return out


def _logs(p, q):
    with np.errstate(divide="ignore"):
        return jnp.asarray(np.log(p), jnp.float32), jnp.asarray(np.log(q), jnp.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_kl_directions_match_numpy(seed):
    p, q = _dists(seed)
    lp, lq = _logs(p, q)
    np.testing.assert_allclose(forward_kl(lp, lq), np_kl(p, q), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(reverse_kl(lp, lq), np_kl(q, p), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(forward_kl(lp, lp), 0.0, atol=1e-6)


def test_jsd_matches_scipy_and_the_generalized_definition():
    p, q = _dists(2)
    lp, lq = _logs(p, q)
    # scipy's jensenshannon is the square root of the beta = 1/2 JSD (natural log)
    want = np.array([jensenshannon(a, b) ** 2 for a, b in zip(p, q)])
    np.testing.assert_allclose(generalized_jsd(lp, lq, jsd_beta=0.5), want, rtol=1e-4, atol=1e-6)
    beta = 0.3
    m = beta * p + (1 - beta) * q
    np.testing.assert_allclose(generalized_jsd(lp, lq, jsd_beta=beta),
                               beta * np_kl(p, m) + (1 - beta) * np_kl(q, m), rtol=1e-4, atol=1e-6)
    assert float(jnp.max(generalized_jsd(lp, lq, jsd_beta=beta))) <= np.log(2) + 1e-6  # bounded


@pytest.mark.parametrize("k", [0, 1, 3, 12, 13])
def test_tail_aware_matches_numpy_and_decomposes_kl(k):
    p, q = _dists(3)
    lp, lq = _logs(p, q)
    for beta in (0.0, 0.37, 2.0):
        np.testing.assert_allclose(tail_aware(lp, lq, top_k=k, tail_beta=beta), np_tail_aware(p, q, k, beta),
                                   rtol=5e-5, atol=2e-6)
    bucket, tail, pT = tail_aware_parts(lp, lq, k)
    # the exact identity: KL = KL over head + bucket + p_T * KL of the renormalised tails
    np.testing.assert_allclose(bucket + pT * tail, np_kl(p, q), rtol=5e-5, atol=2e-6)
    # beta = p_T reduces the tail-aware divergence to KL
    np.testing.assert_allclose(tail_aware(lp, lq, top_k=k, tail_beta=pT), np_kl(p, q), rtol=5e-5, atol=2e-6)


def test_tail_aware_with_k_zero_is_beta_kl():
    p, q = _dists(4)
    lp, lq = _logs(p, q)
    np.testing.assert_allclose(tail_aware(lp, lq, top_k=0, tail_beta=0.6), 0.6 * np_kl(p, q), rtol=5e-5, atol=1e-6)


def test_buckets_from_full_and_stored_head_agree():
    p, q = _dists(5)
    lp, _ = _logs(p, q)
    idx = jax.lax.top_k(lp, 4)[1]
    full = bucketed(lp, idx)
    np.testing.assert_allclose(np.exp(full).sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(full, bucket_from_head(jnp.take_along_axis(lp, idx, -1)), rtol=1e-4, atol=1e-5)
    # forward KL of the buckets is the tail-aware divergence with beta = 0
    lq = _logs(p, _dists(6)[1])[1]
    np.testing.assert_allclose(forward_kl(bucketed(lp, idx), bucketed(lq, idx)),
                               tail_aware(lp, lq, top_k=4, tail_beta=0.0), rtol=1e-5, atol=1e-6)


def test_registry_lists_the_divergences():
    assert {"forward_kl", "reverse_kl", "jsd", "tail_aware"} <= set(DIVERGENCES)
    with pytest.raises(KeyError, match="forward_kl"):
        DIVERGENCES["forward-kl"]


def test_masked_vocabulary_entries_give_finite_gradients():
    """A -inf logit in both (a banned token): 0 log 0 = 0 in the value and in the gradient."""
    p_logits = jnp.asarray([[1.0, 0.3, -jnp.inf, -0.5]])
    q_logits = jnp.asarray([[0.2, 0.9, -jnp.inf, 0.1]])
    for name in ("forward_kl", "reverse_kl", "jsd", "tail_aware"):
        fn = lambda q: DIVERGENCES[name](jax.nn.log_softmax(p_logits), jax.nn.log_softmax(q), top_k=1).sum()  # noqa
        value, grad = jax.value_and_grad(fn)(q_logits)
        assert np.isfinite(float(value)), name
        assert np.isfinite(np.asarray(grad)[:, [0, 1, 3]]).all(), (name, grad)


def test_tail_aware_keeps_a_tail_whose_mass_underflows():
    """log p_T below -87 flushes exp(log p_T) to 0 in float32, but the renormalised tail is
    still defined: its KL must not vanish."""
    V = 6
    tail_shape = np.array([0.5, 0.3, 0.15, 0.05])
    q_tail = np.array([0.1, 0.2, 0.3, 0.4])
    ref = float(np.sum(tail_shape * np.log(tail_shape / q_tail)))
    for log_pt in (-50.0, -100.0, -150.0):
        p = np.concatenate([[0.0, -1.0], log_pt + np.log(tail_shape)])
        p = p - np.log(np.exp(p[:2]).sum())  # the head holds (all but e^log_pt of) the mass
        q = np.concatenate([[-0.5, -1.5], np.log(q_tail) - 2.0])
        q = q - np.log(np.exp(q).sum())
        _, tail_kl, _ = tail_aware_parts(jnp.asarray([p], jnp.float32), jnp.asarray([q], jnp.float32), 2)
        np.testing.assert_allclose(float(tail_kl[0]), ref, rtol=1e-4)
    assert V == len(p)


def test_a_stored_head_that_rounds_to_all_the_mass_keeps_a_floored_tail():
    """A confident teacher's top-1 stored as -0.0: the tail is below float32's resolution of
    the head's sum, floored there (K 2^-24), so reverse KL and JSD stay finite."""
    head = jnp.asarray([[-0.0, -21.0], [-1e-9, -19.0], [np.log(0.6), np.log(0.3)]], jnp.float32)
    bucket = np.asarray(bucket_from_head(head))
    np.testing.assert_allclose(bucket[:2, -1], np.log(2 * 2.0**-24), rtol=1e-6)
    np.testing.assert_allclose(bucket[2, -1], np.log(0.1), rtol=1e-4)  # a resolved tail is untouched
    q = jax.nn.log_softmax(jnp.asarray([[3.0, -1.0, 0.5], [2.0, 0.0, 0.1], [0.0, 0.0, 0.0]]))
    for fn in (reverse_kl, generalized_jsd, forward_kl):
        value, grad = jax.value_and_grad(lambda x: fn(jnp.asarray(bucket), x).sum())(q)  # noqa: B023
        assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all(), fn.__name__


def test_a_head_holding_the_whole_vocabulary_has_no_tail():
    """Stored top-K with K = V (`jaxlm logprobs --top-k V`): no token is left for a tail, so
    its bucket is empty; floored, it gave the teacher mass where the student has none and
    forward KL was inf (the float64 KL of the head alone is finite)."""
    V = 5
    rng = np.random.default_rng(0)
    p = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, V)), jnp.float32))
    q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, V)), jnp.float32))
    bucket = bucket_from_head(p, vocab_size=V)
    assert bucket.shape == (3, V + 1) and np.isneginf(np.asarray(bucket[:, -1])).all()
    student = jnp.concatenate([q, jnp.full((3, 1), -jnp.inf)], -1)
    p64, q64 = np.asarray(p, np.float64), np.asarray(q, np.float64)
    want = (np.exp(p64) * (p64 - q64)).sum(-1)
    np.testing.assert_allclose(np.asarray(forward_kl(bucket, student)), want, rtol=1e-4)
    assert np.isfinite(np.asarray(bucket_from_head(p[:, :3], vocab_size=V))).all()  # K < V: a real tail



def test_a_student_without_mass_on_the_teachers_tail_diverges_to_inf_not_nan():
    """q_T = 0 (masked logits) with p_T > 0: KL is +inf, as forward KL says; the renormalised
    student tail was -inf - -inf = NaN, and 0 * NaN kept it NaN even at beta 0."""
    from trainers.distill.divergences import tail_aware

    p = jax.nn.log_softmax(jnp.asarray([[2.0, 1.0, 0.5, 0.0]]))
    q = jnp.asarray([[0.0, 0.0, -jnp.inf, -jnp.inf]])
    q = q - jax.nn.logsumexp(q, axis=-1, keepdims=True)
    assert np.isposinf(float(forward_kl(p, q)[0]))
    for beta in (0.0, 0.5):  # the teacher's top-2 is the student's support: its whole tail is -inf
        assert np.isposinf(float(tail_aware(p, q, top_k=2, tail_beta=beta)[0]))


def test_tail_weight_zero_drops_an_infinite_tail_term():
    """Student mass 0 on part of the teacher's tail (not all of it): the bucket KL is finite and
    the tail KL inf; beta = 0 means no tail term, and 0 * inf made the loss NaN."""
    from trainers.distill.divergences import tail_aware

    p = jax.nn.log_softmax(jnp.asarray([[2.0, 1.0, 0.5, 0.0]]))
    q = jax.nn.log_softmax(jnp.asarray([[1.0, 1.5, 0.0, -jnp.inf]]))
    pn, qn = np.exp(np.asarray(p[0], np.float64)), np.exp(np.asarray(q[0], np.float64))
    # K + 1 bins: tokens 0, 1 and the tail bucket {2, 3}
    pb, qb = np.array([pn[0], pn[1], pn[2] + pn[3]]), np.array([qn[0], qn[1], qn[2] + qn[3]])
    expected = float(np.sum(pb * np.log(pb / qb)))
    assert float(tail_aware(p, q, top_k=2, tail_beta=0.0)[0]) == pytest.approx(expected, rel=1e-5)
    assert np.isposinf(float(tail_aware(p, q, top_k=2, tail_beta=0.5)[0]))
    g = jax.grad(lambda qq: tail_aware(p, qq, top_k=2, tail_beta=0.0).sum())(q)  # q holds -inf
    assert np.isfinite(np.asarray(g)).all()
