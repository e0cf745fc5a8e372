"""A synthetic two-class polarity task: the label of a short word sequence is the class of
its cue words (all drawn from one list, positive or negative) amid neutral filler.

    task = Polarity()
    ex = task.example(0)  # {"prompt": "box good red =", "completion": "pos", "label": 0, ...}
    task.verify(ex, "pos")  # 1.0

A miniature of the emotion-circuit setting (Wang et al. 2025, "Do LLMs 'Feel'?", arXiv
2510.11328): each example also carries ``variants``, the same filler skeleton (the
paper's "scenario") rendered once per class, so class directions can be extracted with
per-group centring (`jaxlm.interp.directions.mean_difference_directions`). The two
labels begin with different characters, so the first completion token decides the class.

Importing this module registers the task as ``TASKS["polarity"]``.
"""

from __future__ import annotations

import dataclasses

from jaxlm.data.tasks import TASKS, Task

POSITIVE = ("good", "great", "happy", "love", "nice", "joy", "fun", "kind", "calm", "warm", "bright", "sweet")
NEGATIVE = ("bad", "sad", "hate", "awful", "poor", "cruel", "grim", "sick", "cold", "dark", "sour", "ugly")
NEUTRAL = ("the", "cat", "box", "red", "walk", "table", "seven", "green", "run", "sky", "door", "book",
           "tree", "road", "chair", "blue")


@TASKS.register("polarity")
@dataclasses.dataclass(frozen=True)
class Polarity(Task):
    """``min_cues..max_cues`` cue words of one class and ``min_filler..max_filler`` neutral
    words, shuffled, then ``" ="``; the completion is ``labels[class]`` (class 0 = positive)."""

    min_cues: int = 1
    max_cues: int = 2
    min_filler: int = 1
    max_filler: int = 3
    labels: tuple[str, str] = ("pos", "neg")

    def __post_init__(self):
        super().__post_init__()
        for lo, hi, low, cap in (("min_cues", "max_cues", 1, 4), ("min_filler", "max_filler", 0, 8)):
            a, b = getattr(self, lo), getattr(self, hi)
            if not (type(a) is int and type(b) is int and low <= a <= b <= cap):
                raise ValueError(f"polarity.{lo}={a!r}, {hi}={b!r} are invalid: need ints with {low} <= {lo} <= {hi} <= {cap}")
        labels = tuple(self.labels)
        if len(labels) != 2 or not all(isinstance(s, str) and s.strip() for s in labels) or labels[0][0] == labels[1][0]:
            raise ValueError(
                f"polarity.labels={self.labels!r} is invalid: need two non-empty strings with different first characters"
            )

    def _draw(self, rng):
        n_cues = int(rng.integers(self.min_cues, self.max_cues + 1))
        n_filler = int(rng.integers(self.min_filler, self.max_filler + 1))
        filler = [NEUTRAL[i] for i in rng.choice(len(NEUTRAL), n_filler, replace=False)]
        slots = rng.permutation([None] * n_cues + filler).tolist()
        cues = [[words[i] for i in rng.choice(len(words), n_cues, replace=False)] for words in (POSITIVE, NEGATIVE)]
        label = int(rng.integers(0, 2))
        variants = [self._render(slots, c) for c in cues]
        return {"prompt": variants[label], "completion": self.labels[label], "label": label, "variants": variants}

    @staticmethod
    def _render(slots, cues) -> str:
        it = iter(cues)
        return " ".join(w if w is not None else next(it) for w in slots) + " ="

    def verify(self, example, completion):
        return float(completion.strip() == self.labels[example["label"]].strip())  # a label may carry spaces

    def chance_accuracy(self):
        return 0.5
