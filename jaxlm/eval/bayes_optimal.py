"""Bayes-optimal responses in a task's latent space (Tomov, Fuchsgruber & Günnemann 2026,
"Task-Awareness Improves LLM Generations and Uncertainty"; method card §7.5).

Sampled responses ``s_1..s_N`` (weights ``w_k``: uniform, or normalised sequence
probabilities) are mapped to task latents ``l_k = phi(s_k)`` (a label, a number, a set, a
graph's edge set). Under the task's dissimilarity ``d``, the Bayes-optimal response is the
centroid and its Bayesian risk is the uncertainty:

    l* = argmin_l sum_k w_k d(l, l_k),        U = min_l sum_k w_k d(l, l_k).

Closed forms (`DISSIMILARITIES`): 0-1 -> weighted mode, absolute -> weighted median,
squared -> weighted mean, set symmetric difference (Hamming) -> keep ``e`` iff
``sum_k w_k [e in l_k] > 1/2``, edge-Hamming on graphs -> the per-edge majority (the same
rule on edge sets). The centroid need not be one of the samples; minimum Bayes risk (MBR)
decoding is the special case that restricts ``l`` to the samples (`mbr`). Any other
``d(a, b)`` goes through the generic solver over a candidate set (`centroid_over`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np

from jaxlm.registry import Registry


def normalised_weights(n: int, weights=None, *, log_weights=None) -> np.ndarray:
    """Uniform weights, given weights normalised, or ``softmax(log_weights)`` (e.g. sequence
    log-probabilities, so duplicates count by their model probability)."""
    if n == 0:
        raise ValueError("no sampled responses: the centroid of nothing is undefined")
    if weights is not None and log_weights is not None:
        raise ValueError("pass weights or log_weights, not both")
    if log_weights is not None:
        lw = np.asarray(log_weights, np.float64).ravel()
        if lw.size != n or not np.all(np.isfinite(lw)):
            raise ValueError(f"log_weights must be {n} finite values")
        w = np.exp(lw - lw.max())
    elif weights is not None:
        w = np.asarray(weights, np.float64).ravel()
        if w.size != n or np.any(w < 0) or not np.all(np.isfinite(w)) or not w.max(initial=0.0) > 0:
            raise ValueError(f"weights must be {n} non-negative finite values with a positive sum")
        w = w / w.max()  # finite weights whose sum overflows (1e308 twice) keep their ratios
    else:
        w = np.ones(n)
    return w / w.sum()


def zero_one(a, b) -> float:
    return float(a != b)


def absolute(a, b) -> float:
    return float(abs(float(a) - float(b)))


def squared(a, b) -> float:
    return float((float(a) - float(b)) ** 2)


def set_hamming(a, b) -> float:
    """``|a symmetric-difference b|``."""
    return float(len(frozenset(a) ^ frozenset(b)))


edge_hamming = set_hamming  # a graph is its edge set (edges as sorted pairs for undirected graphs)


def weighted_mode(latents: Sequence[Hashable], w: np.ndarray) -> Hashable:
    """The latent with the largest total weight (ties, up to float rounding of the sums: the
    first seen)."""
    mass: dict[Hashable, float] = {}
    for l, wk in zip(latents, w):
        mass[l] = mass.get(l, 0.0) + float(wk)
    top = max(mass.values())
    return next(l for l in mass if mass[l] >= top - 1e-12 * max(abs(top), 1.0))  # dicts keep first-seen order


def _finite(latents: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray(latents, np.float64)
    if not np.isfinite(x).all():  # a NaN sorts last: the median came out wrong, the mean NaN
        raise ValueError(f"latents hold {int((~np.isfinite(x)).sum())} non-finite value(s): the weighted {what} "
                         "needs numbers (drop the responses with no number first)")
    return x


def weighted_median(latents: Sequence[float], w: np.ndarray) -> float:
    """The smallest ``x`` among the latents with ``sum_{l_k <= x} w_k >= 1/2`` (a minimiser of
    the weighted absolute error; when the weights split exactly, every point between the two
    middle latents is one)."""
    x = _finite(latents, "median")
    order = np.argsort(x, kind="mergesort")
    cum = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cum, 0.5 - 1e-12)])


def weighted_mean(latents: Sequence[float], w: np.ndarray) -> float:
    return float(np.dot(_finite(latents, "mean"), w))


def set_majority(latents: Sequence[Iterable], w: np.ndarray) -> frozenset:
    """Every element whose total weight is more than one half."""
    mass: dict[Hashable, float] = {}
    for l, wk in zip(latents, w):
        for e in frozenset(l):
            mass[e] = mass.get(e, 0.0) + wk
    return frozenset(e for e, m in mass.items() if m > 0.5 + 1e-12)


@dataclasses.dataclass(frozen=True)
class Dissimilarity:
    """A task dissimilarity ``d(a, b)`` and, where one exists, its closed-form centroid."""

    distance: Callable[[Any, Any], float]
    centroid: Callable[[Sequence[Any], np.ndarray], Any] | None = None


DISSIMILARITIES: Registry = Registry("dissimilarity")
DISSIMILARITIES.register("zero_one")(Dissimilarity(zero_one, weighted_mode))
DISSIMILARITIES.register("absolute")(Dissimilarity(absolute, weighted_median))
DISSIMILARITIES.register("squared")(Dissimilarity(squared, weighted_mean))
DISSIMILARITIES.register("set_hamming")(Dissimilarity(set_hamming, set_majority))
DISSIMILARITIES.register("edge_hamming")(Dissimilarity(edge_hamming, set_majority))


def _dissimilarity(d) -> Dissimilarity:
    if isinstance(d, Dissimilarity):
        return d
    if isinstance(d, str):
        return DISSIMILARITIES[d]
    if callable(d):
        return Dissimilarity(d)
    raise ValueError(f"dissimilarity must be a registered name {sorted(DISSIMILARITIES)}, a Dissimilarity or "
                     f"a function d(a, b), got {d!r}")


def bayes_risk(candidate, latents: Sequence[Any], w: np.ndarray, d) -> float:
    """``sum_k w_k d(candidate, l_k)``."""
    dist = _dissimilarity(d).distance
    return float(sum(wk * dist(candidate, l) for l, wk in zip(latents, w)))


def centroid_over(candidates: Sequence[Any], latents: Sequence[Any], w: np.ndarray, d) -> tuple[Any, float]:
    """The generic solver: the candidate of least Bayes risk (first on ties) and that risk."""
    if not len(candidates):
        raise ValueError("centroid_over needs at least one candidate")
    risks = [bayes_risk(c, latents, w, d) for c in candidates]
    best = int(np.argmin(risks))
    return candidates[best], float(risks[best])


@dataclasses.dataclass(frozen=True)
class BayesOptimal:
    """The centroid (the Bayes-optimal latent), its Bayes risk (the uncertainty) and the
    normalised weights used."""

    latent: Any
    risk: float
    weights: np.ndarray


def bayes_optimal(latents: Sequence[Any], d="zero_one", *, weights=None, log_weights=None,
                  candidates: Sequence[Any] | None = None) -> BayesOptimal:
    """The Bayes-optimal latent of the samples under ``d``: its closed form when ``d`` has one
    and no ``candidates`` are given, else the generic solver over ``candidates`` (default:
    the samples themselves, i.e. MBR)."""
    latents = list(latents)
    w = normalised_weights(len(latents), weights, log_weights=log_weights)
    diss = _dissimilarity(d)
    if candidates is None and diss.centroid is not None:
        best = diss.centroid(latents, w)
        return BayesOptimal(best, bayes_risk(best, latents, w, diss), w)
    best, risk = centroid_over(list(candidates) if candidates is not None else latents, latents, w, diss)
    return BayesOptimal(best, risk, w)


def mbr(latents: Sequence[Any], d="zero_one", *, weights=None, log_weights=None) -> BayesOptimal:
    """Minimum Bayes risk selection: the sample of least Bayes risk."""
    return bayes_optimal(latents, d, weights=weights, log_weights=log_weights, candidates=list(latents))


# ---------------------------------------------------------------- response -> latent maps
# an optional sign (not a hyphen after a word or number: "1-5" is 1 and 5); digits with or
# without thousands separators ("1,234"), or none before a decimal point (".75"); an optional
# fraction and an optional exponent ("6.02e23", "2.5E-4")
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+(?!\w))?")


def number_latent(text: str) -> float | None:
    """The last number in the response (None when there is none): ``"-.5"`` is -0.5,
    ``"$2,500"`` is 2500 (a comma between digit groups of three is a thousands separator),
    ``"1.5e3"`` is 1500; the minus sign U+2212 is a minus."""
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    return float(found[-1].replace(",", "")) if found else None


def set_latent(text: str, sep: str = ",") -> frozenset:
    """Comma-separated items, stripped, empty items dropped."""
    return frozenset(x.strip() for x in text.split(sep) if x.strip())


def edge_latent(text: str, *, directed: bool = False) -> frozenset:
    """Edges written ``a-b`` (``a>b`` when directed) separated by commas or spaces."""
    edges = set()
    for item in re.split(r"[,\s]+", text.strip()):
        m = re.fullmatch(r"(\w+)[->](\w+)", item)
        if m:
            a, b = m.groups()
            edges.add((a, b) if directed else tuple(sorted((a, b))))
    return frozenset(edges)


def label_latent(text: str) -> str:
    """The first word, lower-cased (empty string for an empty response)."""
    words = text.strip().split()
    return words[0].lower() if words else ""
