"""A grounded question-answering task with a shortcut, for grounded RL (CofactGVR).

`GridQA`: a text "image" of ``n_cells`` cells, each an object with a colour and a shape
(shapes distinct), and a question about the colour of one shape. The answer names its
evidence first, then the colour::

    prompt:     "0rS 1gT 2bC 3rH 4yX 5gO ?T="
    completion: "<evidence>1</evidence>g"

The shortcut: in the *training* problems the asked object is given colour ``colors[0]`` with
probability ``shortcut`` (else it keeps its uniform draw, which is ``colors[0]`` one time in
``len(colors)``; a biased problem that would be a held-out one keeps its unbiased colour, so
the realised share is below ``shortcut + (1 - shortcut) / len(colors)``: about 0.92 at
``shortcut=1``), so answering ``colors[0]`` without looking is often right; held-out
problems are drawn without the bias. The demonstrations
come from a flawed teacher whose evidence is a wrong cell with probability
``evidence_noise`` (its answer is always right), so imitation alone does not learn to
ground. `verify` scores the answer (after ``</evidence>``); `evidence_correct` reads the
predicted cell. The markers are fields (``evidence_open="[", evidence_close="]"`` gives
``[1]g``).

`GridLookup` is the pretraining that lets a small model read such grids at all: the same
grids, and a completion of single-hop queries in random order, "which cell holds shape S"
(``?S=1``) and "what colour is cell 1" (``#1=g``)::

    prompt:     "0rS 1gT 2bC 3rH 4yX 5gO "
    completion: "#3=r ?T=1 #0=r ?S=0 ..."

With ``query_form="evidence"`` the cells are written in GridQA's evidence markers
(``?T=<evidence>1</evidence>``, ``#<evidence>3</evidence>r``), so that a GridQA completion
is a shape query followed by a colour read, each in the form pretraining used.

It never asks a shape's colour directly, so in GridQA the answer is reached through the
evidence (question -> cell -> colour) or not at all: the evidence is the mediator of the
answer, as in CofactGVR's causal grounding graph. A grid that any held-out GridQA question
uses is itself held out, so pretraining never sees an evaluation grid.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxlm.data.tasks import TASKS, Task

@TASKS.register("grid_qa")
@dataclasses.dataclass(frozen=True)
class GridQA(Task):
    """Colour of the asked shape, with its cell as evidence (see the module docstring)."""

    n_cells: int = 6
    """Cells in the grid (2-10; at most len(shapes))."""
    colors: str = "rgby"
    """Colour letters; ``colors[0]`` is the shortcut's answer."""
    shapes: str = "STCHXO"
    """Shape letters (distinct; one per cell)."""
    shortcut: float = 0.6
    """Training problems: probability that the asked object has colour ``colors[0]``."""
    evidence_noise: float = 0.5
    """Training demonstrations: probability that the evidence names a wrong cell."""
    evidence_open: str = "<evidence>"
    """The marker before the evidence cell (e.g. "[" for a compact ``[1]g``)."""
    evidence_close: str = "</evidence>"
    """The marker after the evidence cell."""

    def __post_init__(self):
        super().__post_init__()
        o, c = self.evidence_open, self.evidence_close
        if not isinstance(o, str) or not isinstance(c, str) or not o or not c or o == c:
            raise ValueError(f"grid_qa.evidence_open={o!r} and grid_qa.evidence_close={c!r} must be two different "
                             "non-empty strings")
        if any(ch.isdigit() for ch in o + c):
            raise ValueError(f"grid_qa.evidence_open={o!r} / evidence_close={c!r} must not hold digits (the "
                             "evidence is a cell number)")
        if isinstance(self.n_cells, bool) or not isinstance(self.n_cells, int) or not 2 <= self.n_cells <= 10:
            raise ValueError(f"grid_qa.n_cells={self.n_cells!r} must be an int in [2, 10]")
        if len(set(self.shapes)) != len(self.shapes) or len(self.shapes) < self.n_cells:
            raise ValueError(f"grid_qa.shapes={self.shapes!r} must be at least n_cells={self.n_cells} distinct letters")
        if len(set(self.colors)) != len(self.colors) or len(self.colors) < 2 or set(self.colors) & set(self.shapes):
            raise ValueError(f"grid_qa.colors={self.colors!r} must be 2+ distinct letters, none of them a shape")
        if not all(c.isalpha() for c in self.colors + self.shapes):
            raise ValueError("grid_qa.colors and grid_qa.shapes must be letters")
        for name in ("shortcut", "evidence_noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"grid_qa.{name}={v!r} must be a number in [0, 1]")

    def _grid(self, rng, biased: bool):
        shapes = [self.shapes[i] for i in rng.permutation(len(self.shapes))[: self.n_cells]]
        colors = [self.colors[int(rng.integers(0, len(self.colors)))] for _ in range(self.n_cells)]
        target = int(rng.integers(0, self.n_cells))
        if biased and rng.random() < self.shortcut:
            colors[target] = self.colors[0]
        return shapes, colors, target

    def _example_from(self, shapes, colors, target):
        cells = " ".join(f"{i}{c}{s}" for i, (c, s) in enumerate(zip(colors, shapes)))
        return {"prompt": f"{cells} ?{shapes[target]}=", "completion": f"{self.evidence_open}{target}{self.evidence_close}{colors[target]}",
                "answer": colors[target], "evidence": target, "colors": colors, "shapes": shapes}

    def _draw(self, rng):
        return self._example_from(*self._grid(rng, biased=False))

    def example(self, index: int, split: str = "train") -> dict:
        ex = super().example(index, split)  # the unbiased problem decides the split (by hash)
        if split != "train":
            return ex
        rng = np.random.default_rng([self.seed, index, 0x6A1D])
        shapes, colors, target = ex["shapes"], list(ex["colors"]), ex["evidence"]
        if rng.random() < self.shortcut:
            colors[target] = self.colors[0]
        biased = self._example_from(shapes, colors, target)
        if self.split_of(biased) == "train":  # a biased problem must not be a held-out one
            ex = biased
        if rng.random() < self.evidence_noise:
            wrong = int(rng.integers(0, self.n_cells - 1))
            wrong += wrong >= target
            ex = {**ex, "completion": f"{self.evidence_open}{wrong}{self.evidence_close}{ex['answer']}"}
        return ex

    def split_of(self, ex: dict) -> str:
        """By the prompt, the evidence cell and the answer (the markers do not change a
        problem's split)."""
        canonical = f"<evidence>{ex['evidence']}</evidence>{ex['answer']}"
        return Task.split_of(self, {**ex, "completion": canonical})

    @property
    def evidence_tags(self) -> tuple[str, str]:
        """``(open, close)``: the markers around the evidence (read by the counterfactual bonus)."""
        return self.evidence_open, self.evidence_close

    def parse(self, completion: str) -> tuple[str | None, str]:
        """``(evidence text or None, answer text)`` of a completion."""
        pattern = re.escape(self.evidence_open) + "(.*?)" + re.escape(self.evidence_close) + "(.*)"
        m = re.search(pattern, completion, re.S)
        return (m.group(1), m.group(2).strip()) if m else (None, completion.strip())

    def verify(self, example, completion):
        evidence, answer = self.parse(completion)
        return float(evidence is not None and answer == example["answer"])

    def evidence_correct(self, example, completion) -> bool:
        return self.parse(completion)[0] == str(example["evidence"])

    def chance_accuracy(self):
        return 1.0 / len(self.colors)


@TASKS.register("grid_lookup")
@dataclasses.dataclass(frozen=True)
class GridLookup(GridQA):
    """GridQA's grids with single-hop lookups to learn (see the module docstring)."""

    query_form: str = "plain"
    """"plain": ``?S=1`` and ``#1=g``; "evidence": the cell written as GridQA writes its evidence,
    ``?S=<evidence>1</evidence>`` and ``#<evidence>1</evidence>g`` (with the configured markers),
    so that GridQA's completion is a shape query followed by a colour read."""

    def __post_init__(self):
        super().__post_init__()
        if self.query_form not in ("plain", "evidence"):
            raise ValueError(f"grid_lookup.query_form={self.query_form!r} must be 'plain' or 'evidence'")

    def _queries(self, shapes, colors) -> list[str]:
        if self.query_form == "plain":
            return [f"?{s}={i}" for i, s in enumerate(shapes)] + [f"#{i}={c}" for i, c in enumerate(colors)]
        open_, close = self.evidence_tags
        return ([f"?{shape}={open_}{i}{close}" for i, shape in enumerate(shapes)]
                + [f"#{open_}{i}{close}{colour}" for i, colour in enumerate(colors)])

    def first_query(self, ex: dict) -> tuple[str, str, str]:
        """``(prompt + the first query up to its answer, the answer, its kind)`` of example
        ``ex``: kind ``shape_to_cell`` (the cell of a shape: a search by content) or
        ``cell_to_colour`` (the colour of a cell: a read at a known place)."""
        query = ex["completion"].split(" ")[0]
        if query.startswith("?"):
            head = query.split("=", 1)[0] + "=" + (self.evidence_open if self.query_form == "evidence" else "")
            return ex["prompt"] + head, query[len(head)], "shape_to_cell"
        return ex["prompt"] + query[:-1], query[-1], "cell_to_colour"

    def _draw(self, rng):
        shapes, colors, _ = self._grid(rng, biased=False)
        queries = self._queries(shapes, colors)
        order = rng.permutation(len(queries))
        return {"prompt": " ".join(f"{i}{c}{s}" for i, (c, s) in enumerate(zip(colors, shapes))) + " ",
                "completion": " ".join(queries[j] for j in order), "colors": colors, "shapes": shapes}

    def example(self, index: int, split: str = "train") -> dict:
        return Task.example(self, index, split)

    def split_of(self, ex: dict) -> str:
        """Held out if any GridQA question on this grid is (the unbiased problems decide)."""
        problems = (self._example_from(ex["shapes"], ex["colors"], t) for t in range(self.n_cells))
        return "eval" if any(GridQA.split_of(self, p) == "eval" for p in problems) else "train"

    def verify(self, example, completion):
        return float(completion.strip() == example["completion"])

    def chance_accuracy(self):
        return 0.0
