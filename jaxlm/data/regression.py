"""A synthetic long-tailed regression task: text in, a number out (for CCC-GRPO, method card
B.2, "Injecting Distributional Awareness into MLLMs via RL for Deep Imbalanced Regression").

The target ``y = bin_width * b + u`` is written in a letter code: the prompt is one letter
naming the bin ``b`` (a seeded permutation of ``a..``), one naming ``u`` (of ``k..``), an
irrelevant capital, then ``=``; e.g. ``"dqK="`` -> ``"37"`` (the capital gives every target
many prompts, in both splits). ``y`` is a deterministic function of the text, so a tiny
byte-level model can learn it, but not equally well everywhere: training draws the bin with
an exponentially decaying frequency (the rarest bin ``imbalance`` times rarer than the
most frequent, as the long-tail literature's "imbalance factor"), so rare bins are seen
rarely. The held-out split draws bins uniformly (a balanced test set, as in DIR benchmarks,
Yang et al. 2021), and `bucket` labels an example many / medium / few-shot by its bin's
training frequency relative to the most frequent bin.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from jaxlm.data.tasks import SPLITS, TASKS, Task, _split_of, split_draws

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?", re.ASCII)  # ASCII digits: not "٣٧"
_BIN_LETTERS = "abcdefghij"
_UNIT_LETTERS = "klmnopqrstuvwxyz"
_NOISE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@functools.lru_cache(maxsize=64)
def _frequencies(n_bins: int, imbalance: float) -> np.ndarray:
    w = imbalance ** (-np.arange(n_bins) / (n_bins - 1))
    return w / w.sum()


@functools.lru_cache(maxsize=64)
def _codes(seed: int, n_bins: int, bin_width: int) -> tuple[str, str]:
    """The seeded letter codes of the bins and of the units."""
    rng = np.random.default_rng([seed, 104729])
    bins = "".join(rng.permutation(list(_BIN_LETTERS[:n_bins])))
    units = "".join(rng.permutation(list(_UNIT_LETTERS[:bin_width])))
    return bins, units


def parse_number(completion: str) -> float | None:
    """The completion as a number when it is one (surrounding whitespace allowed), else None."""
    text = completion.strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if np.isfinite(value) else None


@TASKS.register("long_tailed_regression")
@dataclasses.dataclass(frozen=True)
class LongTailedRegression(Task):
    """Targets in ``[0, n_bins * bin_width)``; training frequency of bin ``b`` is
    ``∝ imbalance^(-b / (n_bins - 1))``. ``many_above`` / ``few_below``: a bin whose training
    frequency relative to bin 0 is ``>= many_above`` is many-shot, ``< few_below`` few-shot,
    otherwise medium. ``balanced_eval``: held-out bins uniform (else long-tailed too).
    ``noise_letters``: irrelevant capital letters after the code, so that every target has
    many distinct prompts and appears in both splits."""

    n_bins: int = 10
    bin_width: int = 10
    imbalance: float = 100.0
    many_above: float = 0.2
    few_below: float = 0.05
    balanced_eval: bool = True
    noise_letters: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_bins, int) or not 2 <= self.n_bins <= len(_BIN_LETTERS):
            raise ValueError(
                f"long_tailed_regression.n_bins={self.n_bins!r} must be an int in [2, {len(_BIN_LETTERS)}]"
            )
        if not isinstance(self.bin_width, int) or not 1 <= self.bin_width <= len(_UNIT_LETTERS):
            raise ValueError(
                f"long_tailed_regression.bin_width={self.bin_width!r} must be an int in [1, {len(_UNIT_LETTERS)}]"
            )
        if not self.imbalance >= 1:
            raise ValueError(f"long_tailed_regression.imbalance={self.imbalance!r} must be >= 1")
        if not 0 < self.few_below <= self.many_above <= 1:
            raise ValueError(
                f"long_tailed_regression.few_below={self.few_below!r} and many_above={self.many_above!r} "
                f"must satisfy 0 < few_below <= many_above <= 1"
            )
        if not isinstance(self.noise_letters, int) or not 0 <= self.noise_letters <= 8:
            raise ValueError(
                f"long_tailed_regression.noise_letters={self.noise_letters!r} must be an int in [0, 8]"
            )

    # -- the distribution -------------------------------------------------------------
    def bin_frequencies(self) -> np.ndarray:
        """Training probability of each bin ``[n_bins]`` (sums to 1)."""
        return _frequencies(self.n_bins, float(self.imbalance)).copy()

    def _codes(self) -> tuple[str, str]:
        return _codes(self.seed, self.n_bins, self.bin_width)

    @property
    def value_range(self) -> tuple[float, float]:
        """Smallest and largest target."""
        return 0.0, float(self.n_bins * self.bin_width - 1)

    @property
    def error_scale(self) -> float:
        """The target range: ``|error| / error_scale`` is at most 1 for in-range predictions."""
        lo, hi = self.value_range
        return hi - lo

    def _bin_probabilities(self, split: str) -> np.ndarray:
        if split == "eval" and self.balanced_eval:
            return np.full(self.n_bins, 1.0 / self.n_bins)
        return _frequencies(self.n_bins, float(self.imbalance))

    def _draw_split(self, rng, split: str, b: int | None = None) -> dict:
        bins, units = self._codes()
        if b is None:
            b = int(rng.choice(self.n_bins, p=self._bin_probabilities(split)))
        u = int(rng.integers(0, self.bin_width))
        y = b * self.bin_width + u
        noise = "".join(_NOISE_LETTERS[i] for i in rng.integers(0, len(_NOISE_LETTERS), self.noise_letters))
        return {"prompt": f"{bins[b]}{units[u]}{noise}=", "completion": str(y), "target": float(y), "bin": b}

    def example(self, index: int, split: str = "train") -> dict:
        """The bin from the split's distribution, the unit uniform. A prompt belongs to train
        or eval by the hash of its text, as for every task: held-out prompts are never
        trained on. A held-out example's bin is drawn once and only its unit and letters are
        redrawn until the prompt hashes to eval, so the held-out bins follow their
        distribution exactly (redrawing the bin too weighted each bin by its share of
        eval-hashed prompts: 0.65x-1.35x of uniform at the defaults); a bin with no held-out
        prompt at all falls back to redrawing the bin."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: must be one of {SPLITS}")
        tries = split_draws(self.eval_fraction)
        fixed_bin = None
        if split == "eval":
            rng = np.random.default_rng([self.seed, index, SPLITS.index(split), tries])
            fixed_bin = int(rng.choice(self.n_bins, p=self._bin_probabilities(split)))
        for attempt in range(2 * tries if split == "eval" else tries):
            rng = np.random.default_rng([self.seed, index, attempt, SPLITS.index(split)])
            ex = self._draw_split(rng, split, fixed_bin if attempt < tries else None)
            if _split_of(ex["prompt"] + "\x00" + ex["completion"] + "\x00", self.eval_fraction) == split:
                return ex
        raise RuntimeError(f"{type(self).__name__}: no {split} example after {tries} draws (eval_fraction="
                           f"{self.eval_fraction})")

    # -- scoring ----------------------------------------------------------------------
    def bucket(self, example: dict) -> str:
        """``"many"``, ``"medium"`` or ``"few"`` by the training frequency of the target's bin
        relative to the most frequent bin."""
        p = _frequencies(self.n_bins, float(self.imbalance))
        rel = p[int(example["bin"])] / p[0]
        return "many" if rel >= self.many_above else "few" if rel < self.few_below else "medium"

    @staticmethod
    def parse(completion: str) -> float | None:
        return parse_number(completion)

    def abs_error(self, example: dict, completion: str) -> float:
        """``|prediction - target|`` (``nan`` if the completion is not a number)."""
        pred = self.parse(completion)
        return float("nan") if pred is None else abs(pred - float(example["target"]))

    def verify(self, example, completion):
        """Exact match: 1.0 if the completion is the target, else 0.0."""
        pred = self.parse(completion)
        return float(pred is not None and pred == float(example["target"]))

    def chance_accuracy(self):
        return 1.0 / (self.n_bins * self.bin_width)
