"""Execution-based Best-of-N selection of programs (SplitTester, from the Rule2DRC paper;
seed abstract: "a tester agent for program selection that uses execution feedback to
generate discriminative test cases and separate previously indistinguishable candidate
scripts"), with the random and majority-output baselines.

All candidates run in the sandbox (`jaxlm.sandbox.call_function`) on the same inputs; a
candidate's behaviour is its outputs (or failures) on them, and candidates with identical
behaviour form a group.

* `select_majority`: the largest behaviour group on the given inputs (AlphaCode-style
  clustering; the first member of the first largest group).
* `split_tester`: rounds of (1) the tester proposes inputs, (2) every candidate runs on
  them, (3) the inputs on which the current groups disagree most (the entropy of the output
  distribution over candidates) are kept as discriminative tests, (4) the tester states the
  expected output of each kept test. The group agreeing with the most expected outputs is
  selected (ties: the larger group, then the earlier). A `Tester` supplies steps (1) and
  (4): in the paper an LLM agent, here any object with ``propose`` and ``expected``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol, Sequence

import numpy as np

from jaxlm.sandbox import Limits, call_function

FAILED = "<failed>"


class Tester(Protocol):
    def propose(self, n: int, rng: np.random.Generator) -> list: ...

    def expected(self, inputs: list) -> list[str | None]:
        """Each input's expected output as `jaxlm.sandbox.canonical_repr` writes it (None: no
        opinion)."""
        ...


def behaviour_table(candidates: Sequence[str], function: str, inputs: list, *, call_timeout_s: float = 1.0,
                    limits: Limits = Limits()) -> np.ndarray:
    """``[N, M]`` object array: candidate ``n``'s output on input ``m`` as
    `jaxlm.sandbox.canonical_repr` writes it (equal sets and dicts give one text), or `FAILED`
    (error, timeout, memory, a stopped process). Identical programs run once."""
    table = np.empty((len(candidates), len(inputs)), object)
    runs: dict[str, list[str]] = {}
    for i, program in enumerate(candidates):
        if program not in runs:
            results, _ = call_function(program, function, list(inputs), call_timeout_s=call_timeout_s, limits=limits)
            runs[program] = [r.value if r.ok else FAILED for r in results]
        table[i] = runs[program]
    return table


def partition(table: np.ndarray) -> list[list[int]]:
    """Candidates grouped by identical rows, groups in order of their first member."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(table):
        groups.setdefault(tuple(row), []).append(i)
    return list(groups.values())


def select_random(n: int, rng: np.random.Generator) -> int:
    if n < 1:
        raise ValueError("no candidates to select from")
    return int(rng.integers(n))


def select_majority(table: np.ndarray) -> int:
    """The first member of the (first) largest behaviour group."""
    if table.shape[0] < 1:
        raise ValueError("no candidates to select from")
    groups = partition(table)
    return max(groups, key=len)[0]


def split_entropy(column: Sequence[str]) -> float:
    """Entropy of the output distribution over candidates on one input (0: all agree)."""
    _, counts = np.unique(np.asarray(column, dtype=str), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclasses.dataclass(frozen=True)
class Selection:
    """The selected candidate, its group, the discriminative tests (input, expected output)
    the choice rests on, and each group's agreement count."""

    index: int
    group: tuple[int, ...]
    tests: tuple[tuple[Any, str | None], ...]
    agreement: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]


def split_tester(candidates: Sequence[str], function: str, tester: Tester, *, rounds: int = 3,
                 proposals: int = 16, tests_per_round: int = 3, seed: int = 0, call_timeout_s: float = 1.0,
                 limits: Limits = Limits()) -> Selection:
    """Select one of ``candidates`` by discriminative tests (module docstring)."""
    if not candidates:
        raise ValueError("no candidates to select from")
    for name, v in (("rounds", rounds), ("proposals", proposals), ("tests_per_round", tests_per_round)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    all_inputs: list = []
    table = np.empty((len(candidates), 0), object)
    tests: list[tuple[Any, str | None]] = []
    test_columns: list[int] = []
    for _ in range(rounds):
        fresh = []
        for x in tester.propose(proposals, rng):  # new inputs only, each once (testers repeat themselves)
            key = json.dumps(x)
            if key not in seen:
                seen.add(key)
                fresh.append(x)
        if not fresh:
            continue
        block = behaviour_table(candidates, function, fresh, call_timeout_s=call_timeout_s, limits=limits)
        offset = len(all_inputs)
        all_inputs += fresh
        table = np.concatenate([table, block], axis=1)
        entropy = np.array([split_entropy(block[:, j]) for j in range(block.shape[1])])
        ranked = [j for j in np.argsort(-entropy, kind="stable") if entropy[j] > 0][:tests_per_round]
        if not ranked:
            continue  # this round's inputs separate nothing
        chosen = [fresh[j] for j in ranked]
        for j, want in zip(ranked, tester.expected(chosen)):
            tests.append((fresh[j], want))
            test_columns.append(offset + j)
    groups = partition(table) if table.shape[1] else [list(range(len(candidates)))]
    agreement = []
    for g in groups:
        rep = table[g[0]]
        agreement.append(sum(1 for (x, want), col in zip(tests, test_columns)
                             if want is not None and rep[col] == want))
    best = max(range(len(groups)), key=lambda k: (agreement[k], len(groups[k]), -k))
    return Selection(groups[best][0], tuple(groups[best]), tuple(tests), tuple(agreement),
                     tuple(tuple(g) for g in groups))


class OracleTester:
    """A simulated tester for miniatures: proposes inputs from a type-directed fuzzer and
    states the reference program's output with probability ``accuracy``, otherwise a wrong
    output (a mistake's, where one differs) or no opinion. An LLM tester implements the
    same two methods."""

    def __init__(self, reference: str, function: str, propose_fn, *, accuracy: float = 0.85,
                 wrong_programs: Sequence[str] = (), seed: int = 0, limits: Limits = Limits()):
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"accuracy={accuracy} must be in [0, 1]")
        self.reference, self.function, self.propose_fn = reference, function, propose_fn
        self.accuracy, self.wrong_programs = accuracy, list(wrong_programs)
        self.rng = np.random.default_rng(seed)
        self.limits = limits

    def propose(self, n: int, rng: np.random.Generator) -> list:
        return self.propose_fn(n, rng)

    def expected(self, inputs: list) -> list[str | None]:
        programs = [self.reference] + self.wrong_programs
        table = behaviour_table(programs, self.function, inputs, limits=self.limits)
        out = []
        for j in range(len(inputs)):
            truth = table[0, j]
            if self.rng.uniform() < self.accuracy:
                out.append(truth)
                continue
            wrong = [v for v in table[1:, j] if v != truth and v != FAILED]
            out.append(wrong[int(self.rng.integers(len(wrong)))] if wrong else None)
        return out


def passes_hidden_tests(program: str, function: str, reference: str, inputs: list, *,
                        limits: Limits = Limits()) -> bool:
    """Whether ``program`` matches ``reference`` on every hidden input (a failure fails)."""
    table = behaviour_table([program, reference], function, inputs, limits=limits)
    return bool(all(table[0, j] == table[1, j] and table[0, j] != FAILED for j in range(len(inputs))))
