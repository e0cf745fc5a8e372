"""Bayes-optimal centroids: every closed form's risk equals a brute-force minimum over a grid
(numbers) or over every subset (sets, edge sets), MBR restricted to the samples, weights from
log-probabilities, and the response -> latent parsers."""

import itertools

import numpy as np
import pytest

from jaxlm.eval.bayes_optimal import (bayes_optimal, bayes_risk, edge_latent, mbr, normalised_weights,
                                      number_latent, set_latent)


def brute_force(latents, w, d, grid):
    risks = [sum(wk * d(g, l) for l, wk in zip(latents, w)) for g in grid]
    return grid[int(np.argmin(risks))], min(risks)


@pytest.mark.parametrize("seed", range(5))
def test_numeric_closed_forms_equal_a_grid_search(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    x = list(np.round(rng.normal(size=n) * 3, 1))  # on the grid's 0.1 lattice, with repeats likely
    w = rng.dirichlet(np.ones(n))
    grid = list(np.round(np.arange(-15, 15.001, 0.1), 1))
    for name, d in (("absolute", lambda a, b: abs(a - b)), ("squared", lambda a, b: (a - b) ** 2)):
        got = bayes_optimal(x, name, weights=w)
        _, want = brute_force(x, w, d, grid)
        if name == "squared":  # the mean is off the lattice: the grid's best is at most 0.05^2 worse
            assert got.risk <= want + 1e-12 and want - got.risk <= 0.0025 + 1e-9
            assert got.latent == pytest.approx(np.dot(x, w))
        else:
            assert got.risk == pytest.approx(want, abs=1e-9)


def test_mode_median_and_ties():
    assert bayes_optimal(["a", "b", "b", "c"]).latent == "b"
    assert bayes_optimal(["a", "b", "b", "c"]).risk == pytest.approx(0.5)
    assert bayes_optimal(["a", "b"]).latent == "a"  # tie: first seen
    # weighted mode follows the weights, not the counts
    assert bayes_optimal(["a", "b", "b"], weights=[0.6, 0.2, 0.2]).latent == "a"
    # a tie in exact arithmetic stays a tie when the float sums differ in the last bit
    for weights in ([3, 1, 2], [0.3, 0.1, 0.2]):
        assert bayes_optimal(["a", "b", "b"], weights=weights).latent == "a"
    # finite weights whose sum overflows keep their ratios (they normalised to all zeros)
    huge = bayes_optimal([1.0, 3.0], "squared", weights=[1e308, 1e308])
    assert huge.latent == 2.0 and huge.risk == pytest.approx(1.0)
    assert bayes_optimal(["a", "b", "b"], weights=[1e308] * 3).latent == "b"
    np.testing.assert_allclose(normalised_weights(3, [1e308, 1e308, 5e307]), [0.4, 0.4, 0.2], rtol=1e-15)
    np.testing.assert_allclose(normalised_weights(2, [5e-324, 5e-324]), [0.5, 0.5])
    # an even split: every point between the middle two is a median; risk is the same
    got = bayes_optimal([1.0, 2.0, 3.0, 10.0], "absolute")
    assert got.latent == 2.0 and got.risk == pytest.approx((1 + 0 + 1 + 8) / 4)
    assert bayes_risk(3.0, [1.0, 2.0, 3.0, 10.0], np.full(4, 0.25), "absolute") == pytest.approx(got.risk)


@pytest.mark.parametrize("name", ["set_hamming", "edge_hamming"])
def test_set_majority_equals_the_best_subset(name):
    rng = np.random.default_rng(7)
    universe = [("a", "b"), ("a", "c"), ("b", "c"), ("c", "d")] if name == "edge_hamming" else list("wxyz")
    subsets = [frozenset(s) for r in range(len(universe) + 1) for s in itertools.combinations(universe, r)]
    for _ in range(20):
        n = int(rng.integers(1, 7))
        latents = [subsets[i] for i in rng.integers(len(subsets), size=n)]
        w = rng.dirichlet(np.ones(n))
        got = bayes_optimal(latents, name, weights=w)
        _, want = brute_force(latents, w, lambda a, b: len(a ^ b), subsets)
        assert got.risk == pytest.approx(want, abs=1e-12)
    # the centroid need not be a sample: {x,y}, {y,z}, {x,z} -> every element has weight 2/3
    got = bayes_optimal([frozenset("xy"), frozenset("yz"), frozenset("xz")], "set_hamming")
    assert got.latent == frozenset("xyz")
    assert mbr([frozenset("xy"), frozenset("yz"), frozenset("xz")], "set_hamming").latent in (
        frozenset("xy"), frozenset("yz"), frozenset("xz"))


def test_generic_solver_and_mbr():
    latents = [1.0, 2.0, 7.0]
    got = bayes_optimal(latents, lambda a, b: abs(a - b) ** 0.5, candidates=np.linspace(0, 8, 81).tolist())
    _, want = brute_force(latents, np.full(3, 1 / 3), lambda a, b: abs(a - b) ** 0.5, np.linspace(0, 8, 81).tolist())
    assert got.risk == pytest.approx(want)
    assert mbr([0.0, 1.0, 5.0], "squared").latent == 1.0


def test_weights_and_parsers():
    np.testing.assert_allclose(normalised_weights(2, log_weights=[0.0, np.log(3.0)]), [0.25, 0.75])
    with pytest.raises(ValueError, match="non-negative"):
        normalised_weights(2, [1.0, -1.0])
    with pytest.raises(ValueError, match="no sampled"):
        bayes_optimal([])
    with pytest.raises(KeyError, match="unknown dissimilarity"):
        bayes_optimal([1.0], "cosine")
    assert number_latent("so the answer is 12, not 3.5") == 3.5
    assert number_latent("none") is None
    cases = {"x = -.5": -0.5, "answer: .75": 0.75, "The total is 1,234.": 1234.0, "so it costs $2,500": 2500.0,
             "12,345,678.5 units": 12345678.5, "a list 1,2,3": 3.0, "1,2345": 2345.0, "-3": -3.0,
             # a hyphen after a number or word is not a sign
             "between 1-5": 5.0, "pages 10-12": 12.0, "x=-3": -3.0, "(-2)": -2.0,
             # scientific notation is one number, as float() reads it
             "6.02e23": 6.02e23, "The answer is 1.5e3.": 1500.0, "2.5E-4": 2.5e-4, "-1e+2 here": -100.0,
             "1e5x": 5.0,
             # the minus sign U+2212, as typeset output writes it (read as 3)
             "The answer is \u22123": -3.0, "x = \u22120.5e2": -50.0}
    assert {t: number_latent(t) for t in cases} == cases
    for d in ("absolute", "squared"):  # a NaN latent gave a wrong median and a NaN mean
        with pytest.raises(ValueError, match="latents hold 1 non-finite value"):
            bayes_optimal([1.0, float("nan"), 3.0], d)
    assert set_latent(" a, b ,,c") == frozenset("abc")
    assert edge_latent("b-a, c-b x") == frozenset({("a", "b"), ("b", "c")})
    assert edge_latent("a>b", directed=True) == frozenset({("a", "b")})
