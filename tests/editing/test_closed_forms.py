"""MEMIT and AlphaEdit closed forms against numpy references written from the papers."""

import jax.numpy as jnp
import numpy as np

from jaxlm.editing.locate import alphaedit_update, memit_update, nullspace_projector


def _instance(seed=0, n=12, d_in=10, d_out=6):
    rng = np.random.default_rng(seed)
    K = rng.normal(size=(n, d_in))
    R = rng.normal(size=(n, d_out))
    X = rng.normal(size=(200, d_in)) * np.r_[np.full(d_in - 4, 3.0), np.full(4, 1e-3)]
    C0 = X.T @ X / 200
    Kp = rng.normal(size=(5, d_in))
    return K, R, C0, Kp


def test_memit_matches_the_paper_form():
    K, R, C0, _ = _instance()
    lam = 15.0
    # paper: Delta = R K^T (lam C0 + K K^T)^{-1}, keys as columns, W [d_out, d_in]
    Kc, Rc = K.T, R.T
    delta = Rc @ Kc.T @ np.linalg.inv(lam * C0 + Kc @ Kc.T)
    got = memit_update(jnp.asarray(K), jnp.asarray(R), jnp.asarray(C0), lam)  # [d_in, d_out] = delta^T
    np.testing.assert_allclose(np.asarray(got), delta.T, rtol=1e-4, atol=1e-5)


def test_nullspace_projector_matches_svd_reference():
    _, _, C0, _ = _instance(1)
    U, S, _ = np.linalg.svd(C0)
    U_hat = U[:, S < 1e-2]
    np.testing.assert_allclose(np.asarray(nullspace_projector(jnp.asarray(C0), 1e-2)), U_hat @ U_hat.T, atol=1e-5)
    assert U_hat.shape[1] == 4


def test_alphaedit_matches_the_paper_form_and_spares_preserved_keys():
    K, R, C0, Kp = _instance(2)
    lam = 10.0
    U, S, _ = np.linalg.svd(C0)
    P = U[:, S < 1e-2] @ U[:, S < 1e-2].T
    Kc, Rc, Kpc = K.T, R.T, Kp.T
    # paper: Delta = R K1^T P (Kp Kp^T P + K1 K1^T P + lam I)^{-1}
    delta = Rc @ Kc.T @ P @ np.linalg.inv(Kpc @ Kpc.T @ P + Kc @ Kc.T @ P + lam * np.eye(len(P)))
    got = alphaedit_update(jnp.asarray(K), jnp.asarray(R), jnp.asarray(P), jnp.asarray(Kp.T @ Kp), lam)
    np.testing.assert_allclose(np.asarray(got), delta.T, rtol=1e-4, atol=1e-6)
    # keys in the preserved (high-variance) subspace of C0 see no change: k^T dW = 0
    preserved = U[:, S >= 1e-2].T
    np.testing.assert_allclose(preserved @ np.asarray(got), 0.0, atol=1e-5)
