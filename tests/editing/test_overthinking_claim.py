"""Overthinking task vectors' claim in miniature (`bench/overthinking_claim.py`, the numbers
docs/editing.md reports): extrapolating past a reasoning model R that saw a secret in 3% of
its training traces surfaces the secret several times more often than R does, more than a
random direction of matched norm, and a layer-attenuation schedule does it while keeping
R's task quality."""

import pytest

from bench_runner import run_bench


@pytest.mark.slow  # trains the base and the reasoning model (about 4 minutes on 2 cores)
def test_extrapolation_surfaces_the_secret_and_head_only_attenuation_keeps_quality():
    got = run_bench("overthinking_claim.py")
    r, alphas = got["reasoning"], [str(a) for a in got["alphas"] if a > 1]
    assert r["accuracy"] > 0.95 and 0 < r["surfaced"] < 0.06, r  # R solves the task and rarely tells
    # plain O_alpha = M + alpha (R - M): several times R's rate at its best alpha ...
    best = max(alphas, key=lambda a: got["uniform"][a]["surfaced"])
    uniform = got["uniform"][best]
    assert uniform["surfaced"] >= 4 * r["surfaced"], (best, uniform, r)
    # ... more than the same-size step along a random direction ...
    assert got["random_uniform"][best]["surfaced"] < 0.5 * uniform["surfaced"], got["random_uniform"][best]
    # ... but at the cost of the task: no alpha keeps the accuracy and surfaces much more
    assert uniform["accuracy"] < r["accuracy"] - 0.5, uniform
    assert got["kept_quality"]["uniform"]["surfaced"] < 2 * r["surfaced"], got["kept_quality"]["uniform"]
    # amplifying only the read-out (head_only) surfaces it while keeping the accuracy and the
    # trace perplexity close to R's; the random direction on the same parameters does less
    kept = got["kept_quality"]["head_only"]
    assert kept["surfaced"] >= 4 * r["surfaced"] and kept["accuracy"] >= r["accuracy"] - 0.1, kept
    assert kept["perplexity"] < 1.05 * r["perplexity"], kept
    control = got["random_head_only"][str(kept["alpha"])]
    assert control["surfaced"] < 0.5 * kept["surfaced"], control
