"""K-FAC factors (three estimation modes) and CrispEdit's matrix-free projector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlm
from jaxlm.editing.kfac import kfac_factors, merge_factors
from jaxlm.editing.weights import layer_kernels
from jaxlm.editing.projection import (
    energy_mask, explicit_projector, project_updates, projector_from_factors,
)
from jaxlm.interp import perturb
from jaxlm.models.config import ModelConfig


@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(ModelConfig.tiny(d_model=16, n_heads=2, n_kv_heads=1, ffn_dim=24, init_std=0.3), seed=0)


@pytest.fixture(scope="module")
def batch():
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 6), 3, 259), np.int32)
    valid = np.ones((2, 6), bool)
    valid[1, 4:] = False  # right padding
    return tokens, valid


def test_empirical_fisher_statistics_reproduce_the_kernel_gradient(model, batch):
    """d (the pulled-back cotangent) is exactly dL/dy of the summed CE: sum_t a_t d_t^T
    equals the down_proj kernel gradient from jax.grad (checked through the sums)."""
    tokens, valid = batch
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(jnp.asarray(tokens), mask=jnp.asarray(valid)).logits[:, :-1]
        lp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(lp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * (valid[:, :-1] & valid[:, 1:]))

    c = model.config
    g = layer_kernels(jax.grad(loss)(state), c, "mlp.down_proj", range(c.n_layers))
    delta = jnp.zeros((c.n_layers, *tokens.shape, c.d_model))

    def logits_of(delta):
        out = model(jnp.asarray(tokens), mask=jnp.asarray(valid), collect=("mlp_act",),
                    interventions=(perturb("mlp_out", delta),))
        return out.logits, out.collected["mlp_act"]

    logits, pull, acts = jax.vjp(logits_of, delta, has_aux=True)
    from jaxlm.editing.kfac import output_cotangent

    (d,) = pull(output_cotangent(logits, jnp.asarray(tokens), jnp.asarray(valid), "empirical_fisher", None))
    for layer in range(c.n_layers):
        np.testing.assert_allclose(
            np.einsum("bti,btj->ij", acts[layer], d[layer]), np.asarray(g[layer]), rtol=1e-4, atol=1e-6
        )


def _exact_ggn_B(model, tokens, valid, layer):
    """(1/n) sum_t sum_s J_st^T H_s J_st with J = d logits_s / d y_t (dense Jacobian)."""
    c = model.config
    delta = jnp.zeros((c.n_layers, *tokens.shape, c.d_model))

    def logits_of(delta):
        return model(jnp.asarray(tokens), mask=jnp.asarray(valid), interventions=(perturb("mlp_out", delta),)).logits

    z = logits_of(delta)[:, :-1]
    J = jax.jacrev(lambda dl: logits_of(delta.at[layer].set(dl))[:, :-1])(delta[layer])  # [B,S,V,B,T,D]
    p = jax.nn.softmax(z, axis=-1)
    H = jax.vmap(jax.vmap(lambda p: jnp.diag(p) - jnp.outer(p, p)))(p)  # [B,S,V,V]
    w = (valid[:, :-1] & valid[:, 1:]).astype(np.float32)
    B = 0
    for b in range(tokens.shape[0]):
        for s in range(tokens.shape[1] - 1):
            Js = J[b, s][:, b]  # [V, T, D]
            B = B + w[b, s] * jnp.einsum("vtd,vu,ute->de", Js, H[b, s], Js)
    return B / valid.sum()


@pytest.mark.parametrize("mode", ["ggn", "sampled_fisher"])
def test_stochastic_modes_converge_to_the_exact_gauss_newton_factor(model, batch, mode):
    tokens, valid = batch
    exact = np.asarray(_exact_ggn_B(model, tokens, valid, layer=1))
    est = kfac_factors(model, [(tokens, valid)] * 4, layers=[1], mode=mode, samples=512, seed=1).B[0]
    rel = np.linalg.norm(np.asarray(est) - exact) / np.linalg.norm(exact)
    assert rel < 0.1, rel  # Monte-Carlo error ~ 1/sqrt(2048)
    emp = kfac_factors(model, [(tokens, valid)], layers=[1], mode="empirical_fisher").B[0]
    assert np.linalg.norm(np.asarray(emp) - exact) / np.linalg.norm(exact) > 0.2  # a different statistic


def test_input_factor_and_token_weighted_merge(model, batch):
    tokens, valid = batch
    f = kfac_factors(model, [(tokens, valid)], layers=[0, 1])
    acts = model(jnp.asarray(tokens), mask=jnp.asarray(valid), collect=("mlp_act",)).collected["mlp_act"]
    a = np.asarray(acts[0])[valid]
    np.testing.assert_allclose(np.asarray(f.A[0]), a.T @ a / valid.sum(), rtol=1e-5, atol=1e-7)
    assert float(f.tokens) == valid.sum()
    f1 = kfac_factors(model, [(tokens[:1], valid[:1])], layers=[0, 1])
    f2 = kfac_factors(model, [(tokens[1:], valid[1:])], layers=[0, 1])
    m = merge_factors([f1, f2], "tokens")
    np.testing.assert_allclose(np.asarray(m.A), np.asarray(f.A), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m.B), np.asarray(f.B), rtol=1e-5, atol=1e-7)
    ms = merge_factors([f1, f2])  # sample-weighted: one sequence each -> the plain mean
    np.testing.assert_allclose(np.asarray(ms.A), np.asarray((f1.A + f2.A) / 2), rtol=1e-5, atol=1e-7)
    assert float(ms.samples) == 2 and float(ms.tokens) == valid.sum()
    with pytest.raises(ValueError, match="layers"):
        merge_factors([f, kfac_factors(model, [(tokens, valid)], layers=[1])])
    with pytest.raises(ValueError, match="module='mlp.up_proj'"):
        kfac_factors(model, [(tokens, valid)], module="mlp.up_proj", layers=[0])
    with pytest.raises(ValueError, match="mode='hessian'"):
        kfac_factors(model, [(tokens, valid)], layers=[0], mode="hessian")


def test_factors_of_a_model_with_per_layer_ffn_widths(batch):
    """``layer_ffn_dims``: the collected MLP inputs are one array per layer. Layers of one
    width stack (A and B as for each layer alone); layers of different widths are refused."""
    tokens, valid = batch
    cfg = ModelConfig.tiny(d_model=16, n_heads=2, n_kv_heads=1, ffn_dim=24, init_std=0.3, n_layers=3,
                           layer_ffn_dims=(24, 20, 24))
    model = jaxlm.build_model(cfg, seed=0)
    f = kfac_factors(model, [(tokens, valid)], layers=[0, 2])
    acts = model(jnp.asarray(tokens), mask=jnp.asarray(valid), collect=("mlp_act",)).collected["mlp_act"]
    for n, layer in enumerate((0, 2)):
        a = np.asarray(acts[layer], np.float64)[valid]
        want = a.T @ a / valid.sum()  # float64; float32 sums of 10 products differ by ~1e-5 of the largest
        np.testing.assert_allclose(np.asarray(f.A[n]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        alone = kfac_factors(model, [(tokens, valid)], layers=[layer])
        np.testing.assert_allclose(np.asarray(f.B[n]), np.asarray(alone.B[0]), rtol=1e-5, atol=1e-9)
    with pytest.raises(ValueError, match=r"input widths differ \(\[20, 24\]"):
        kfac_factors(model, [(tokens, valid)], layers=[0, 1])


def _random_factors(d_in, d_out, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(50, d_in)) * np.linspace(3, 0.1, d_in)
    b = rng.normal(size=(50, d_out)) * np.linspace(2, 0.2, d_out)
    from jaxlm.editing.kfac import KFACFactors

    return KFACFactors(A=jnp.asarray([a.T @ a / 50], jnp.float32), B=jnp.asarray([b.T @ b / 50], jnp.float32),
                       tokens=jnp.asarray(50.0), samples=jnp.asarray(50.0), layers=(0,), module="mlp.down_proj")


def test_matrix_free_projector_equals_explicit_and_is_idempotent():
    d_in, d_out = 6, 4
    proj = projector_from_factors(_random_factors(d_in, d_out), energy=0.8)
    G = jax.random.normal(jax.random.key(0), (1, d_in, d_out))
    P = explicit_projector(proj)
    np.testing.assert_allclose(np.asarray(proj(G)[0]).ravel(), np.asarray(P @ G[0].ravel()), atol=1e-5)
    np.testing.assert_allclose(np.asarray(proj(proj(G))), np.asarray(proj(G)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(P @ P), np.asarray(P), atol=1e-5)
    assert 0 < float(proj.kept_fraction[0]) < 1


def test_projector_zeroes_the_top_energy_directions():
    f = _random_factors(6, 4, seed=1)
    proj = projector_from_factors(f, energy=0.8)
    s_A, U_A = np.linalg.eigh(np.asarray(f.A[0], np.float64))
    s_B, U_B = np.linalg.eigh(np.asarray(f.B[0], np.float64))
    M = np.outer(s_A, s_B)
    order = np.argsort(M.ravel())[::-1]
    r = np.searchsorted(np.cumsum(M.ravel()[order]) / M.sum(), 0.8) + 1
    removed = order[:r]  # numpy reference of the energy rule
    np.testing.assert_array_equal(np.flatnonzero(~np.asarray(proj.keep[0]).ravel()), np.sort(removed))
    for k in removed:  # a gradient along a removed eigen-direction is annihilated
        i, j = divmod(k, 4)
        G = np.outer(U_A[:, i], U_B[:, j])[None].astype(np.float32)
        np.testing.assert_allclose(np.asarray(proj(jnp.asarray(G))), 0.0, atol=1e-5)
    # the kept part's curvature vec(G)^T (A kron B) vec(G) is below tau * |G|^2
    G = jax.random.normal(jax.random.key(2), (1, 6, 4))
    g = np.asarray(proj(G)[0], np.float64).ravel()
    curv = g @ np.kron(np.asarray(f.A[0], np.float64), np.asarray(f.B[0], np.float64)) @ g
    assert curv <= M.ravel()[order][r - 1] * (g @ g) + 1e-6
    assert np.all(np.asarray(energy_mask(jnp.asarray(s_A), jnp.asarray(s_B), 0.0)))
    # no curvature at all: nothing holds energy, so nothing is blocked
    assert np.all(np.asarray(energy_mask(jnp.zeros(4), jnp.asarray(s_B), 0.9)))
    # the cumulative energy lands exactly on the threshold (20 of 25 at 0.8, float64 reference:
    # the ten 2s are blocked, the five 1s kept); float32 division put it one ulp under and the
    # rule blocked everything (the edit did nothing)
    keep = np.asarray(energy_mask(jnp.ones(5), jnp.array([2.0, 1.0, 2.0]), 0.8))
    np.testing.assert_array_equal(keep, np.broadcast_to([False, True, False], (5, 3)))


def test_optax_transformation_projects_before_the_optimizer():
    import optax

    proj = projector_from_factors(_random_factors(6, 4), energy=0.8)
    params = {"edited": jnp.zeros((1, 6, 4)), "frozen": jnp.zeros(3)}
    grads = {"edited": jax.random.normal(jax.random.key(0), (1, 6, 4)), "frozen": jnp.ones(3)}
    tx = optax.chain(project_updates({"edited": proj, "frozen": None}), optax.sgd(1.0))
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["edited"]), -np.asarray(proj(grads["edited"])), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(updates["frozen"]), -np.ones(3))
