"""Direction extraction: last-token capture under padding, the centred mean-difference formula
of the emotion-circuit paper and the PCA option, each against a plain-numpy re-implementation."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

import jaxlm
from jaxlm.interp.directions import capture, last_token_index, mean_difference_directions, pca_directions
from jaxlm.models.config import ModelConfig


# ----------------------------------------------------------------- numpy reference
def reference_directions(acts, labels, groups, E):
    """Loops, straight from the paper: cell means h_{g,e}; h~ = h - mean over classes;
    c_e = mean over groups; v_e = (c_e - mean_e c) / |c_e - mean_e c|. acts [L, N, D]."""
    L, N, D = acts.shape
    group_ids = sorted(set(groups))
    v = np.zeros((E, L, D))
    for layer in range(L):
        centred = {}
        for g in group_ids:
            h = []
            for e in range(E):
                rows = [n for n in range(N) if groups[n] == g and labels[n] == e]
                h.append(np.mean([acts[layer, n] for n in rows], axis=0))
            mu = np.mean(h, axis=0)
            for e in range(E):
                centred[g, e] = h[e] - mu
        c = [np.mean([centred[g, e] for g in group_ids], axis=0) for e in range(E)]
        c_mean = np.mean(c, axis=0)
        for e in range(E):
            u = c[e] - c_mean
            v[e, layer] = u / (np.linalg.norm(u) + 1e-12)
    return v


def reference_pca(acts, labels, groups, E):
    L, N, D = acts.shape
    group_ids = sorted(set(groups))
    mean_diff = reference_directions(acts, labels, groups, E)
    out = np.zeros((E, L, D))
    for layer in range(L):
        rows = []
        for g in group_ids:
            h = [np.mean([acts[layer, n] for n in range(N) if groups[n] == g and labels[n] == e], axis=0)
                 for e in range(E)]
            rows += [x - np.mean(h, axis=0) for x in h]
        _, _, vt = np.linalg.svd(np.stack(rows))
        pc = vt[0]
        for e in range(E):
            out[e, layer] = pc if pc @ mean_diff[e, layer] >= 0 else -pc
    return out


def _data(G=5, E=3, per_cell=1, L=3, D=6, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.tile(np.repeat(np.arange(E), per_cell), G)
    groups = np.repeat(np.array([f"s{g}" for g in range(G)]), E * per_cell)
    order = rng.permutation(len(labels))  # any example order
    labels, groups = labels[order], groups[order]
    # a shared per-group offset (the "scenario") plus class signal plus noise
    offsets = {g: rng.normal(size=(L, D)) * 5 for g in set(groups)}
    signal = rng.normal(size=(E, L, D))
    acts = np.stack([offsets[g] + signal[e] + 0.3 * rng.normal(size=(L, D)) for g, e in zip(groups, labels)], axis=1)
    return acts.astype(np.float32), labels, groups


# ----------------------------------------------------------------- formula
@pytest.mark.parametrize("per_cell", [1, 3])
def test_mean_difference_matches_the_numpy_formula(per_cell):
    acts, labels, groups = _data(per_cell=per_cell)
    got = np.asarray(mean_difference_directions(jnp.asarray(acts), labels, groups))
    want = reference_directions(acts.astype(np.float64), labels, groups, 3)
    assert got.shape == (3, 3, 6)
    np.testing.assert_allclose(got, want, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-6)


def test_without_groups_it_is_the_class_mean_minus_the_mean_of_class_means():
    acts, labels, groups = _data(G=4, E=2, per_cell=2)
    got = np.asarray(mean_difference_directions(acts, labels))
    np.testing.assert_allclose(got, reference_directions(acts, labels, ["one"] * len(labels), 2), atol=2e-6)
    class_means = np.stack([acts[:, labels == e].mean(axis=1) for e in range(2)])
    u = class_means[0] - class_means.mean(axis=0)
    np.testing.assert_allclose(got[0], u / np.linalg.norm(u, axis=-1, keepdims=True), atol=2e-6)
    np.testing.assert_allclose(got[1], -got[0], atol=1e-6)  # two classes: opposite directions


def test_group_centring_removes_the_scenario_offsets():
    """With big per-group offsets and few groups, ungrouped directions are pulled by the
    offsets; grouped ones recover the planted class signal."""
    rng = np.random.default_rng(3)
    L, D, G = 1, 8, 3
    signal = np.zeros((L, D))
    signal[0, 0] = 1.0
    acts, labels, groups = [], [], []
    for g in range(G):
        off = rng.normal(size=(L, D)) * 10
        for e, n_copies in ((0, 1 + g), (1, 1)):  # class 0 over-represented in later groups
            for _ in range(n_copies):
                acts.append(off + (signal if e == 0 else -signal))
                labels.append(e)
                groups.append(g)
    acts = np.stack(acts, axis=1)
    grouped = np.asarray(mean_difference_directions(acts, np.array(labels), np.array(groups)))
    np.testing.assert_allclose(grouped[0, 0], signal[0], atol=1e-5)
    ungrouped = np.asarray(mean_difference_directions(acts, np.array(labels)))
    assert abs(ungrouped[0, 0] @ signal[0]) < 0.9


def test_pca_matches_numpy_and_is_sign_aligned():
    acts, labels, groups = _data(E=2, G=6, per_cell=2)
    got = np.asarray(pca_directions(acts, labels, groups))
    np.testing.assert_allclose(got, reference_pca(acts.astype(np.float64), labels, groups, 2), atol=1e-5)
    md = np.asarray(mean_difference_directions(acts, labels, groups))
    assert np.all(np.einsum("eld,eld->el", got, md) >= 0)
    np.testing.assert_allclose(got[1], -got[0], atol=1e-6)
    three = np.asarray(pca_directions(*_data(E=3)))
    np.testing.assert_allclose(np.linalg.norm(three, axis=-1), 1.0, atol=1e-5)


def test_pca_of_a_class_without_a_mean_difference_is_zero():
    """Identical activations, or class differences that cancel over groups: no direction
    (zeros, as the mean difference gives), not an arbitrary unit axis; two classes give
    exactly +pc and -pc."""
    same = np.ones((2, 8, 4), np.float32)  # [L, N, D]
    labels = np.array([0, 1] * 4)
    np.testing.assert_array_equal(np.asarray(pca_directions(same, labels)), 0.0)
    rng = np.random.default_rng(0)
    acts = rng.normal(size=(2, 8, 4)).astype(np.float32)
    out = np.asarray(pca_directions(acts, labels))
    np.testing.assert_array_equal(out[0], -out[1])
    assert np.abs(out).max() > 0.1
    # group 0 has class 1 above class 0 by d, group 1 below by d: the mean difference cancels
    d = np.array([1.0, 2.0, 0.0, 0.0], np.float32)
    base = rng.normal(size=(2, 1, 4)).astype(np.float32)
    acts = np.concatenate([base, base + d, base + d, base], axis=1)
    out = np.asarray(pca_directions(acts, np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])))
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("counts", [(3, 5), (1, 6), (4, 4)])
def test_identical_classes_of_unequal_size_have_no_direction(counts):
    """Identical rows (prompts ending in one token at layer 0) in classes of different sizes:
    their float32 means differed by an ulp, normalised into a unit vector of noise."""
    rng = np.random.default_rng(1)
    row = (rng.normal(size=(2, 1, 16)) * 8).astype(np.float32)
    n = sum(counts)
    acts = np.broadcast_to(row, (2, n, 16)).copy()
    acts[1] = rng.normal(size=(n, 16)).astype(np.float32)  # layer 1 does differ
    labels = np.array([0] * counts[0] + [1] * counts[1])
    for fn in (mean_difference_directions, pca_directions):
        out = np.asarray(fn(acts, labels))
        np.testing.assert_array_equal(out[:, 0], 0.0)
        np.testing.assert_allclose(np.linalg.norm(out[:, 1], axis=-1), 1.0, rtol=1e-5)
    # and the directions of ordinary data are those of the unshifted float64 definition
    acts = (rng.normal(size=(2, n, 16)) + 50.0).astype(np.float32)
    a = acts.astype(np.float64)
    u = a[:, labels == 0].mean(1) - a[:, labels == 1].mean(1)
    want = np.stack([u / 2, -u / 2]) / np.linalg.norm(u / 2, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(mean_difference_directions(acts, labels)), want, atol=2e-5)


def test_bad_inputs_are_named():
    acts, labels, groups = _data(E=2, G=3)
    with pytest.raises(ValueError, match="acts must be"):
        mean_difference_directions(acts[0], labels, groups)
    with pytest.raises(ValueError, match="labels must be"):
        mean_difference_directions(acts, labels.astype(float), groups)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
        mean_difference_directions(acts, np.where(labels == 1, 5, 0), groups, n_classes=2)
    with pytest.raises(ValueError, match="group 's0' has no example of class 1"):
        keep = ~((groups == "s0") & (labels == 1))
        mean_difference_directions(acts[:, keep], labels[keep], groups[keep])
    with pytest.raises(ValueError, match="groups must be"):
        mean_difference_directions(acts, labels, groups[:-1])
    with pytest.raises(ValueError, match="n_classes=1"):
        mean_difference_directions(acts, np.zeros_like(labels), n_classes=1)
    with pytest.raises(ValueError, match=r"no examples \(N = 0\)"):
        mean_difference_directions(acts[:, :0], labels[:0], groups[:0])
    np.testing.assert_array_equal(np.asarray(mean_difference_directions(acts, labels, groups, n_classes=np.int64(2))),
                                  np.asarray(mean_difference_directions(acts, labels, groups, n_classes=2)))


# ----------------------------------------------------------------- capture
@pytest.fixture(scope="module")
def model():
    return jaxlm.build_model(ModelConfig.tiny(init_std=0.1), seed=0)


def test_capture_reads_each_rows_last_real_token(model):
    lengths = [7, 4, 2]
    seqs = [list(np.asarray(jax.random.randint(jax.random.key(i), (n,), 3, 259))) for i, n in enumerate(lengths)]
    tokens = np.zeros((3, 7), np.int32)
    mask = np.zeros((3, 7), bool)
    for b, s in enumerate(seqs):  # right padding
        tokens[b, : len(s)] = s
        mask[b, : len(s)] = True
    np.testing.assert_array_equal(np.asarray(last_token_index(mask)), [6, 3, 1])
    sites = ("hidden", "attn_out", "mlp_out", "resid_mid", "mlp_act", "q")
    got = capture(model, tokens, mask, sites=sites)
    assert got["hidden"].shape == (2, 3, 64) and got["mlp_act"].shape == (2, 3, 128) and got["q"].shape == (2, 3, 4, 16)
    # jitted: run eagerly, every op of the forward compiles on its own for each length
    forward = nnx.jit(lambda m, t: m(t, collect=("hidden", "attn_out", "mlp_out", "mlp_act", "q")).collected)
    for b, s in enumerate(seqs):
        alone = forward(model, jnp.asarray([s]))
        for site in ("hidden", "attn_out", "mlp_out", "mlp_act", "q"):
            np.testing.assert_allclose(np.asarray(got[site][:, b]), np.asarray(alone[site][:, 0, -1]), atol=1e-5)
        # resid_mid: the residual after attention = layer input + attn_out
        embed = model.embed[...][s[-1]]
        inputs = np.stack([embed, np.asarray(alone["hidden"][0, 0, -1])])
        np.testing.assert_allclose(np.asarray(got["resid_mid"][:, b]),
                                   inputs + np.asarray(alone["attn_out"][:, 0, -1]), atol=1e-5)
    explicit = capture(model, tokens, mask, sites="hidden", position=np.array([6, 3, 1]))
    np.testing.assert_array_equal(np.asarray(explicit["hidden"]), np.asarray(got["hidden"]))
    left = capture(model, tokens, None, sites="hidden", position="last")["hidden"][:, 0]  # row 0 has no padding
    np.testing.assert_allclose(np.asarray(left), np.asarray(got["hidden"][:, 0]), atol=1e-6)


def test_capture_bad_inputs_are_named(model):
    tokens = jnp.ones((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="sites=\\['attn_probs'\\] is invalid"):
        capture(model, tokens, sites=("attn_probs",))
    with pytest.raises(ValueError, match="position='first' is invalid"):
        capture(model, tokens, position="first")
    with pytest.raises(ValueError, match="position must be"):
        capture(model, tokens, position=np.array([0, 4]))
    for bad in (np.array([1.7, 3.9]), np.array([True, False])):  # were truncated / read as 1 and 0
        with pytest.raises(ValueError, match="position must be 'last' or \\[B\\] = \\(2,\\) ints, got"):
            capture(model, tokens, position=bad)
    with pytest.raises(ValueError, match="tokens holds no rows"):
        capture(model, jnp.ones((0, 4), jnp.int32))
    with pytest.raises(ValueError, match="mask rows \\[1\\] have no real token"):
        capture(model, tokens, np.array([[1, 1, 0, 0], [0, 0, 0, 0]], bool))
    with pytest.raises(ValueError, match="mask must be"):
        capture(model, tokens, np.ones((2, 3), bool))
