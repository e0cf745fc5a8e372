"""Domain mixtures: draw frequencies follow the weights, each example is its domain's own
(held-out split kept), verification dispatches by domain, and bad weights or names fail
naming the domains."""

import numpy as np
import pytest

from jaxlm.data.conditioned import ConditionedDigits
from jaxlm.data.files import Files
from jaxlm.data.graphs import GraphLabels
from jaxlm.data.mixture import Mixture, mixture_of
from jaxlm.data.tasks import Arithmetic, MarkovText, Sorting

DOMAINS = {"math": Arithmetic(digits=2), "general": MarkovText(), "sort": Sorting()}


def test_domain_frequencies_follow_the_weights():
    m = mixture_of(DOMAINS, {"math": 0.2, "general": 0.5, "sort": 0.3}, seed=3)
    n = 20000
    counts = np.bincount([m.domain_of(i) for i in range(n)], minlength=3)
    expected = np.array(m.weights) * n
    # each count within 4 binomial standard deviations of its expectation
    assert np.all(np.abs(counts - expected) < 4 * np.sqrt(expected * (1 - np.array(m.weights))))


def test_a_zero_weight_domain_is_never_drawn():
    """Weights may sum to 1 within 1e-6: the draw's CDF is normalised, so a draw above the
    weights' sum (seed 0, index 602366 for these weights) is not sent to the last domain when
    its weight is 0."""
    m = Mixture(components=(Arithmetic(), MarkovText()), names=("math", "off"), weights=(0.9999991, 0.0))
    u = np.random.default_rng([m.seed, 602366, 0x313]).random()
    assert u >= 0.9999991 and m.domain_of(602366) == 0 and m.example(602366)["domain"] == "math"


def test_examples_are_their_domains_own_and_splits_are_kept():
    m = mixture_of(DOMAINS, {"math": 0.5, "sort": 0.5})
    assert m.names == ("math", "sort")  # zero/absent weights leave a domain out
    for split in ("train", "eval"):
        for i in range(40):
            ex = m.example(i, split)
            own = DOMAINS[ex["domain"]].example(i, split)
            assert {k: v for k, v in ex.items() if k != "domain"} == own
            assert m.verify(ex, own["completion"]) == 1.0
            assert m.verify(ex, own["completion"] + "9") == 0.0
    assert not mixture_of(DOMAINS, {"general": 1.0}).generative_eval  # MarkovText has no generative eval


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights=(0.5, 0.4)), r"sum to 0\.9, not 1 \(domains \('arithmetic', 'markov'\)\)"),
    (dict(weights=(0.5,)), "2 components, 2 names and 1 weights"),
    (dict(names=("a", "a")), "repeats a name"),
    (dict(weights=(1.5, -0.5)), r"\[\('markov', -0\.5\)\] must be finite numbers >= 0"),
    (dict(components=(Arithmetic(), Files()), names=("a", "f")), "domain 'f' is a Files, not a synthetic task"),
    (dict(components=(Arithmetic(), GraphLabels())), "domain 'markov' is a GraphLabels, which encodes its own arrays"),
    (dict(components=(ConditionedDigits(), Arithmetic())), "domain 'arithmetic' is a ConditionedDigits, which encodes"),
    # the held-out share is each domain's own: a mixture's was silently ignored (even 7.0)
    (dict(eval_fraction=0.5), r"Mixture.eval_fraction=0.5 is not used: .* set eval_fraction on the components"),
    (dict(eval_fraction=7.0), r"Mixture.eval_fraction=7.0 is not used"),
])
def test_bad_mixtures_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mixture(**kwargs)


def test_weights_naming_an_unknown_domain_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown domain\(s\) \['code'\]; known: \['general', 'math', 'sort'\]"):
        mixture_of(DOMAINS, {"math": 0.5, "code": 0.5})
