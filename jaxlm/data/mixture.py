"""Domain mixtures: a data source drawing each example from one of several synthetic tasks
with given weights (PRISM-style mid-training mixtures, `trainers.stages`).

``Mixture(components=(Arithmetic(), MarkovText()), names=("math", "general"), weights=(0.3, 0.7))``
is random access like every task: example ``i`` comes from the domain drawn for ``i`` (a
seeded draw), as that domain's example ``i``, tagged with its ``domain``; the held-out split
of each domain stays held out. `mixture_of` builds one from named domains and weights by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from jaxlm.data.facts import FactWorld
from jaxlm.data.polarity import Polarity
from jaxlm.data.tasks import Arithmetic, Countdown, MarkovText, Sorting, Task

Component = Arithmetic | Countdown | Sorting | MarkovText | FactWorld | Polarity


@dataclasses.dataclass(frozen=True)
class Mixture(Task):
    """Examples drawn from ``components`` with probabilities ``weights`` (summing to 1)."""

    components: tuple[Component, ...] = (Arithmetic(), MarkovText())
    """The domains' tasks."""
    names: tuple[str, ...] = ("arithmetic", "markov")
    """One unique name per component (the ``domain`` of its examples)."""
    weights: tuple[float, ...] = (0.5, 0.5)
    """Sampling probability of each component; they sum to 1."""

    def __post_init__(self):
        default = next(f.default for f in dataclasses.fields(Task) if f.name == "eval_fraction")
        if self.eval_fraction != default:
            raise ValueError(f"Mixture.eval_fraction={self.eval_fraction!r} is not used: each domain holds out its "
                             "own share of its prompts; set eval_fraction on the components")
        n = len(self.components)
        if not n:
            raise ValueError("Mixture.components is empty: name at least one domain")
        if len(self.names) != n or len(self.weights) != n:
            raise ValueError(f"Mixture has {n} components, {len(self.names)} names and {len(self.weights)} weights: "
                             "give one name and one weight per component")
        if len(set(self.names)) != n:
            raise ValueError(f"Mixture.names={self.names!r} repeats a name")
        for name, c in zip(self.names, self.components):
            if not isinstance(c, Task) or isinstance(c, Mixture):
                raise ValueError(f"Mixture domain {name!r} is a {type(c).__name__}, not a synthetic task")
            if hasattr(c, "encode_arrays"):  # its own arrays (graph masks, conditions) cannot be mixed
                raise ValueError(f"Mixture domain {name!r} is a {type(c).__name__}, which encodes its own "
                                 "arrays (encode_arrays) and cannot be mixed with text tasks; mix text tasks "
                                 f"({', '.join(t.__name__ for t in Component.__args__)})")
        bad = [(nm, w) for nm, w in zip(self.names, self.weights)
               if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0]
        if bad:
            raise ValueError(f"Mixture.weights: {bad} must be finite numbers >= 0")
        total = float(sum(self.weights))
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"Mixture.weights={self.weights!r} sum to {total:.6g}, not 1 "
                             f"(domains {self.names!r})")

    @property
    def generative_eval(self) -> bool:
        return all(getattr(c, "generative_eval", True) for c in self.components)

    def domain_of(self, index: int) -> int:
        """The component example ``index`` is drawn from."""
        u = np.random.default_rng([self.seed, index, 0x313]).random()
        cdf = np.cumsum(np.asarray(self.weights, np.float64))
        # normalised, so the last entry is exactly 1 > u: a weight-0 domain (flat step) is never drawn
        return int(np.searchsorted(cdf / cdf[-1], u, side="right"))

    def example(self, index: int, split: str = "train") -> dict[str, Any]:
        d = self.domain_of(index)
        return {**self.components[d].example(index, split), "domain": self.names[d]}

    def verify(self, example: dict[str, Any], completion: str) -> float:
        return self.components[self.names.index(example["domain"])].verify(example, completion)

    def chance_accuracy(self) -> float:
        return float(sum(w * c.chance_accuracy() for w, c in zip(self.weights, self.components)))


def mixture_of(domains: Mapping[str, Task], weights: Mapping[str, float], *, seed: int = 0) -> Mixture:
    """The mixture of the named ``domains`` with ``weights`` by name (domains with weight 0 or
    absent are left out); a weight naming no domain is an error listing the known ones."""
    unknown = sorted(set(weights) - set(domains))
    if unknown:
        raise ValueError(f"mixture weights name unknown domain(s) {unknown}; known: {sorted(domains)}")
    names = tuple(n for n in domains if weights.get(n, 0.0))
    return Mixture(components=tuple(domains[n] for n in names), names=names,
                   weights=tuple(float(weights[n]) for n in names), seed=seed)
