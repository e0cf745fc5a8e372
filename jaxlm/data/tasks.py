"""Synthetic tasks that generate themselves from a seed, each with a verifier.

A task maps ``(index, split)`` to an example deterministically (random access, so a
data pipeline can be resumed from a position) and scores completions:

    task = TASKS["arithmetic"](digits=2)
    ex = task.example(0, split="train")  # {"prompt": "37+48=", "completion": "85", ...}
    task.verify(ex, "85")                # 1.0

Held-out evaluation is honest: a problem belongs to ``eval`` or ``train`` by a hash
of its text (prompt and completion), so no eval problem is ever trained on.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import operator
import re
from collections import Counter
from typing import Any, Literal

import numpy as np

from jaxlm.registry import Registry

TASKS: Registry = Registry("task")
SPLITS = ("train", "eval")


def split_draws(eval_fraction: float) -> int:
    """Draws to try for an example of a split: enough that a split of share ``p`` finds none
    with probability ``(1 - p)^draws < 1e-12`` (p = 0.002 needs ~14,000)."""
    return max(1000, int(np.ceil(28 / min(eval_fraction, 1 - eval_fraction))))


def _split_of(prompt: str, eval_fraction: float) -> str:
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
    return "eval" if (h % 10_000) < eval_fraction * 10_000 else "train"


def _check_int_ranges(task, prefix: str, *ranges: tuple[str, int, int]) -> None:
    """Each ``(field, low, high)``: ``task.field`` must be an int (not a bool) in ``[low, high]``."""
    for name, low, high in ranges:
        v = getattr(task, name)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            raise ValueError(f"{prefix}.{name}={v!r} must be an int in [{low}, {high}]")


@dataclasses.dataclass(frozen=True)
class Task:
    """Base: subclasses implement `_draw(rng) -> example dict` and `verify`."""

    seed: int = 0
    """Seed of the generated examples."""
    eval_fraction: float = 0.1
    """Fraction of the distinct prompts held out for evaluation (by hash: never trained on)."""

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"{type(self).__name__}.seed={self.seed!r} must be an int >= 0")
        # the split hash has a resolution of 1e-4: a smaller fraction would leave a split empty
        if isinstance(self.eval_fraction, bool) or not isinstance(self.eval_fraction, (int, float, np.floating)) \
                or not 1e-4 <= self.eval_fraction <= 1 - 1e-4:
            raise ValueError(f"{type(self).__name__}.eval_fraction={self.eval_fraction!r} must be in "
                             "[0.0001, 0.9999]")

    def example(self, index: int, split: str = "train") -> dict[str, Any]:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: must be one of {SPLITS}")
        tries = split_draws(self.eval_fraction)
        for attempt in range(tries):
            rng = np.random.default_rng([self.seed, index, attempt, SPLITS.index(split)])
            ex = self._draw(rng)
            if self.split_of(ex) == split:
                return ex
        raise RuntimeError(f"{type(self).__name__}: no {split} example after {tries} draws (eval_fraction="
                           f"{self.eval_fraction}): the task has too few distinct problems for this split")

    def split_of(self, ex: dict[str, Any]) -> str:
        """The split an example belongs to: by a hash of its prompt and completion."""
        key = ex["prompt"] + "\x00" + ex["completion"] + "\x00" + ex.get("_split_key", "")
        return _split_of(key, self.eval_fraction)

    def _draw(self, rng: np.random.Generator) -> dict[str, Any]:
        raise NotImplementedError

    def verify(self, example: dict[str, Any], completion: str) -> float:
        """1.0 if ``completion`` solves ``example`` else 0.0."""
        raise NotImplementedError

    def chance_accuracy(self) -> float:
        """Exact-match accuracy of guessing uniformly among well-formed answers (a baseline)."""
        raise NotImplementedError

    def accepted_completions(self, prompt: str) -> list[str] | None:
        """Every completion `verify` accepts for ``prompt``, where the prompt alone determines
        them (None: not known from the prompt). Used to label a model's output against the
        right answer nearest to it when a task has several."""
        return None


@TASKS.register("arithmetic")
@dataclasses.dataclass(frozen=True)
class Arithmetic(Task):
    """``a op b =`` with ``digits``-digit operands; the answer is the integer result.

    ``carry_slip`` makes the *training demonstrations* come from a flawed teacher: with that
    probability a ``+`` problem's completion drops the carry out of the ones digit
    (57+68= -> "115", not "125"). The ``answer`` field, the eval split and `verify` stay
    correct, so a verifier-driven method (GRPO) can fix what imitation learned.
    """

    digits: int = 2
    """Digits of each operand (1-9)."""
    ops: tuple[str, ...] = ("+",)
    """Operators to draw from: + - *."""
    carry_slip: float = 0.0
    """Probability that a + demonstration with a ones carry drops it (a flawed teacher)."""

    _OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"arithmetic.digits={self.digits!r} must be an int in [1, 9]")
        bad = [o for o in self.ops if o not in self._OPS]
        if not self.ops or bad:
            raise ValueError(f"arithmetic.ops={self.ops!r} is invalid: each must be one of {sorted(self._OPS)}")
        if isinstance(self.carry_slip, bool) or not isinstance(self.carry_slip, (int, float)) or not (
            0 <= self.carry_slip <= 1
        ):
            raise ValueError(f"arithmetic.carry_slip={self.carry_slip!r} must be a number in [0, 1]")

    def example(self, index: int, split: str = "train") -> dict[str, Any]:
        ex = super().example(index, split)
        if split == "train" and self.carry_slip and ex["op"] == "+":
            a, b = ex["operands"]
            carry = (a % 10 + b % 10) >= 10
            if carry and np.random.default_rng([self.seed, index, 0x511B]).random() < self.carry_slip:
                ex = {**ex, "completion": str(ex["answer"] - 10)}
        return ex

    def _draw(self, rng):
        hi = 10**self.digits
        a, b = int(rng.integers(0, hi)), int(rng.integers(0, hi))
        op = self.ops[int(rng.integers(0, len(self.ops)))]
        answer = self._OPS[op](a, b)
        return {"prompt": f"{a}{op}{b}=", "completion": str(answer), "answer": answer, "op": op, "operands": (a, b)}

    def verify(self, example, completion):
        return float(completion.strip() == str(example["answer"]))

    def chance_accuracy(self):
        hi = 10**self.digits
        span = {"+": 2 * hi - 1, "-": 2 * hi - 1, "*": (hi - 1) ** 2 + 1}
        return 1.0 / max(span[o] for o in self.ops)


def safe_arithmetic(expr: str) -> int | None:
    """The value of an expression of integers, + - * and parentheses, or None (anything else;
    never `eval`)."""
    out = _safe_eval(expr)
    return None if out is None else out[0]


_ARITHMETIC_CHARS = re.compile(r"[0-9+\-*() ]+", re.ASCII)


def _safe_eval(expr: str) -> tuple[int, list[int]] | None:
    """Value and literals of an expression of integers, + - * and parentheses; else None.
    Parsed with `ast` and evaluated by hand: never `eval`."""
    if not _ARITHMETIC_CHARS.fullmatch(expr):  # decimal digits only: no 0x19, 2_5, 1e3
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a degenerate (deeply nested) output
        return None
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
    literals: list[int] = []

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return node.value
        raise ValueError("disallowed syntax")

    try:
        value = walk(tree.body)
    except (ValueError, RecursionError):
        return None
    return value, literals


@TASKS.register("countdown")
@dataclasses.dataclass(frozen=True)
class Countdown(Task):
    """Combine the given numbers (each at most once) with + - * to reach the target.

    Generated by drawing ``n_numbers`` numbers and a random expression over them; the
    expression is the reference completion, and any other solution also verifies.
    """

    n_numbers: int = 3
    """Numbers given per problem."""
    max_number: int = 20
    """Largest given number."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.n_numbers, int) or not 2 <= self.n_numbers <= 6:
            raise ValueError(f"countdown.n_numbers={self.n_numbers!r} must be an int in [2, 6]")
        if not isinstance(self.max_number, int) or self.max_number < 2:
            raise ValueError(f"countdown.max_number={self.max_number!r} must be an int >= 2")

    def _draw(self, rng):
        nums = [int(x) for x in rng.integers(1, self.max_number + 1, self.n_numbers)]
        order = [nums[i] for i in rng.permutation(self.n_numbers)]
        expr = str(order[0])
        for x in order[1:]:
            op = "+-*"[int(rng.integers(0, 3))]
            expr = f"({expr}){op}{x}" if op == "*" and any(c in expr for c in "+-") else f"{expr}{op}{x}"
        target, _ = _safe_eval(expr)
        prompt = "nums " + " ".join(map(str, nums)) + f" target {target}:"
        return {"prompt": prompt, "completion": expr, "numbers": nums, "target": target}

    def split_of(self, ex):
        """By the problem alone (the numbers as a multiset, and the target): any expression
        reaching the target verifies, so a held-out problem must not be trained under another
        expression, nor with its numbers listed in another order (hashing the prompt text put
        18% of held-out problems in training that way)."""
        key = "nums " + " ".join(map(str, sorted(ex["numbers"]))) + f" target {ex['target']}:"
        return _split_of(key, self.eval_fraction)

    def verify(self, example, completion):
        result = _safe_eval(completion.strip())
        if result is None:
            return 0.0
        value, literals = result
        fits = not (Counter(literals) - Counter(example["numbers"]))
        return float(fits and value == example["target"])

    def chance_accuracy(self):
        return float("nan")  # open-ended answers: no meaningful uniform baseline


@TASKS.register("sorting")
@dataclasses.dataclass(frozen=True)
class Sorting(Task):
    """Sort ``length`` integers in ``[0, max_value]`` (ascending by default).

    With ``order="either"`` each example's answer is sorted ascending or descending at random
    and either is accepted: the prompt does not say which, so the answer is bimodal. Decoding
    every position at once from its own marginal mixes the two orders, while one committed
    position decides the rest: a task on which a masked diffusion LM's decoding steps matter.
    """

    length: int = 5
    """Integers per list."""
    max_value: int = 99
    """Largest integer."""
    separator: str = " "
    """Between the integers of the prompt's list and of the answer ("" for single digits: one
    byte per item, e.g. ``sort 8305:`` -> ``0358``)."""
    order: Literal["ascending", "descending", "either"] = "ascending"
    """The answer's order; ``"either"`` draws ascending or descending per example (one more
    draw after the values, so the lists are those of the fixed orders) and accepts both."""

    ORDERS = ("ascending", "descending", "either")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.length, int) or not 2 <= self.length <= 32:
            raise ValueError(f"sorting.length={self.length!r} must be an int in [2, 32]")
        _check_int_ranges(self, "sorting", ("max_value", 0, 10**9))
        if not isinstance(self.separator, str) or any(c.isdigit() for c in self.separator):
            raise ValueError(f"sorting.separator={self.separator!r} must be a str without digits (it would read as "
                             "part of a number)")
        if self.separator == "" and self.max_value > 9:
            raise ValueError(f"sorting.separator='' needs single digits (max_value <= 9), got max_value={self.max_value}")
        if self.order not in self.ORDERS:
            raise ValueError(f"sorting.order={self.order!r} must be one of {self.ORDERS}")

    def _answers(self, xs) -> dict[str, str]:
        """The accepted answers by order."""
        up = sorted(xs)
        answers = {"ascending": self.separator.join(map(str, up)),
                   "descending": self.separator.join(map(str, up[::-1]))}
        return answers if self.order == "either" else {self.order: answers[self.order]}

    def _draw(self, rng):
        xs = [int(x) for x in rng.integers(0, self.max_value + 1, self.length)]
        order = self.order if self.order != "either" else ("ascending", "descending")[int(rng.integers(0, 2))]
        return {"prompt": "sort " + self.separator.join(map(str, xs)) + ":",
                "completion": self._answers(xs)[order],
                "values": xs}

    def split_of(self, ex):
        """With ``order="either"`` by the prompt alone (the ascending answer stands in for the
        drawn one), so a held-out list is never trained in the other order; the split is then
        the ascending task's."""
        if self.order == "either":
            ex = {**ex, "completion": self.separator.join(map(str, sorted(ex["values"])))}
        return super().split_of(ex)

    def verify(self, example, completion):
        return float(completion.strip() in self._answers(example["values"]).values())

    def accepted_completions(self, prompt):
        body = prompt.removeprefix("sort ").removesuffix(":")
        items = body.split(self.separator) if self.separator else list(body)
        if not prompt.startswith("sort ") or not prompt.endswith(":") or not all(x.isdigit() for x in items):
            raise ValueError(f"{prompt!r} is not a sorting prompt ('sort ' + the list + ':')")
        return list(self._answers([int(x) for x in items]).values())

    def chance_accuracy(self):
        """Guessing uniformly among the orderings of the given values: a list with value counts
        ``c`` has ``n! / prod c!`` of them, drawn with probability ``n! / prod c! / m^n``
        (``m = max_value + 1``), so every multiset contributes ``k / m^n`` (``k`` accepted
        orderings): ``C(m + n - 1, n) / m^n``; with ``order="either"`` two are accepted unless
        every value is equal (``m`` multisets)."""
        m, n = self.max_value + 1, self.length
        multisets = math.comb(m + n - 1, n)
        accepted = 2 * multisets - m if self.order == "either" else multisets
        return accepted / m**n


@TASKS.register("prefix_sums")
@dataclasses.dataclass(frozen=True)
class PrefixSums(Task):
    """Running sums mod ``modulus`` of ``length`` digits (modulus 10: ``sums 3856:`` -> ``3162``,
    i.e. 3, 3+8, 3+8+5, ... mod 10; modulus 2: running parities of bits).

    Each answer digit is the previous answer digit plus one prompt digit, but from the prompt
    alone it is the sum of a whole prefix. A small model learns the one-step rule, not long sums,
    so committing several answer positions from one forward (a masked diffusion LM at few steps)
    gets the later ones wrong, while the errors stay one-token substitutions: a task on which
    decoding steps matter and a draft can be repaired in place."""

    length: int = 8
    """Digits in the prompt and in the answer."""
    modulus: int = 10
    """Digits are in ``[0, modulus)`` and the sums are taken mod ``modulus`` (2-10)."""

    def __post_init__(self):
        super().__post_init__()
        _check_int_ranges(self, "prefix_sums", ("length", 1, 32), ("modulus", 2, 10))

    def answer(self, digits) -> str:
        return "".join(str(int(s) % self.modulus) for s in np.cumsum(digits))

    def _draw(self, rng):
        xs = [int(x) for x in rng.integers(0, self.modulus, self.length)]
        return {"prompt": "sums " + "".join(map(str, xs)) + ":", "completion": self.answer(xs), "values": xs}

    def verify(self, example, completion):
        return float(completion.strip() == self.answer(example["values"]))

    def chance_accuracy(self):
        return float(self.modulus) ** -self.length


@TASKS.register("sum_trace")
@dataclasses.dataclass(frozen=True)
class SumTrace(Task):
    """Add ``count`` numbers of ``digits`` digits, showing the running sums in any order:
    ``sum 23 45 67:`` -> ``45+23=68,68+67=135;135``. Each demonstration adds the numbers in a
    uniformly random order (``count!`` traces per prompt), so different reasoning traces reach
    the same answer: the text after the last ``;`` is the answer, and `verify` checks only it
    (the task's latent is the number, not the trace)."""

    count: int = 3
    """Numbers to add (2-6)."""
    digits: int = 2
    """Digits of each number (1-4)."""

    def __post_init__(self):
        super().__post_init__()
        _check_int_ranges(self, "sum_trace", ("count", 2, 6), ("digits", 1, 4))

    @staticmethod
    def trace(order) -> str:
        """The demonstration that adds ``order`` left to right."""
        steps, total = [], order[0]
        for x in order[1:]:
            steps.append(f"{total}+{x}={total + x}")
            total += x
        return ",".join(steps) + f";{total}"

    def _draw(self, rng):
        hi = 10**self.digits
        xs = [int(x) for x in rng.integers(0, hi, self.count)]
        order = [xs[i] for i in rng.permutation(self.count)]
        return {"prompt": "sum " + " ".join(map(str, xs)) + ":", "completion": self.trace(order),
                "values": xs, "answer": sum(xs)}

    def split_of(self, ex):
        return _split_of(ex["prompt"], self.eval_fraction)  # a prompt's every trace is in one split

    @staticmethod
    def final_answer(completion: str) -> str:
        """The text after the last ``;`` (stripped), or "" without one."""
        return completion.rsplit(";", 1)[1].strip() if ";" in completion else ""

    def verify(self, example, completion):
        return float(self.final_answer(completion) == str(example["answer"]))

    def accepted_completions(self, prompt):
        """The well-formed traces (every order); `verify` also accepts any text that ends in
        ``;<sum>``."""
        xs = [int(x) for x in prompt[len("sum "):-1].split(" ")]
        return sorted({self.trace(p) for p in itertools.permutations(xs)})

    def chance_accuracy(self):
        return 1.0 / (self.count * (10**self.digits - 1) + 1)


@TASKS.register("pointer_walk")
@dataclasses.dataclass(frozen=True)
class PointerWalk(Task):
    """Follow a pointer table: the prompt lists ``x y`` pairs of a random cyclic permutation ``f`` of
    the digits ``0 .. symbols-1`` in shuffled order and a start ``s``; the answer is ``f(s), f(f(s)),
    ...`` for ``hops`` steps (``walk 12 20 01 from 0:`` -> ``120`` with ``hops=3``).

    With the previous answer digit in view, the next one is a single lookup in the table (an
    induction-head copy), but from the prompt alone the ``i``-th digit needs ``i`` lookups: so
    committing several answer positions from one forward (a masked diffusion LM at few steps)
    gets later digits wrong, while each error is a one-token substitution that a draft-level
    look at its neighbour can repair. With ``one_cycle`` ``f`` is one cycle through all the
    symbols, so every walk is equally long before it repeats, but an answer of ``symbols`` hops
    then holds each symbol once and a missing digit can be read off the others without a lookup;
    otherwise ``f`` is a uniformly random function."""

    symbols: int = 8
    """Digits in the table (2-10)."""
    hops: int = 8
    """Answer digits: how many times ``f`` is applied."""
    one_cycle: bool = True
    """``f`` is a cyclic permutation (True) or a uniformly random function (False)."""

    def __post_init__(self):
        super().__post_init__()
        _check_int_ranges(self, "pointer_walk", ("symbols", 2, 10), ("hops", 1, 32))
        if not isinstance(self.one_cycle, bool):
            raise ValueError(f"pointer_walk.one_cycle={self.one_cycle!r} must be a bool")

    def answer(self, table, start: int) -> str:
        """The walk from ``start``; ``table[x]`` is ``f(x)``."""
        out, x = [], start
        for _ in range(self.hops):
            x = table[x]
            out.append(str(x))
        return "".join(out)

    def _draw(self, rng):
        if self.one_cycle:
            cycle = [int(v) for v in rng.permutation(self.symbols)]
            table = [0] * self.symbols
            for i in range(self.symbols):
                table[cycle[i]] = cycle[(i + 1) % self.symbols]
        else:
            table = [int(v) for v in rng.integers(0, self.symbols, self.symbols)]
        listed = [int(k) for k in rng.permutation(self.symbols)]
        start = int(rng.integers(self.symbols))
        prompt = "walk " + " ".join(f"{k}{table[k]}" for k in listed) + f" from {start}:"
        return {"prompt": prompt, "completion": self.answer(table, start), "table": table, "start": start}

    def verify(self, example, completion):
        return float(completion.strip() == self.answer(example["table"], example["start"]))

    def chance_accuracy(self):
        return float(self.symbols) ** -self.hops


@TASKS.register("choice")
@dataclasses.dataclass(frozen=True)
class Choice(Task):
    """Copy any one of the ``words`` random words listed in the prompt (``pick abc bca cab:`` ->
    ``bca``); every listed word is correct and training answers pick one uniformly. The answer
    distribution is multimodal, so committing several positions from one forward (a masked
    diffusion LM at few steps) can mix letters of different words: a task on which decoding
    steps matter."""

    words: int = 3
    """Words listed in the prompt."""
    length: int = 6
    """Letters per word."""
    letters: str = "abcdefgh"
    """The alphabet of the words."""

    def __post_init__(self):
        super().__post_init__()
        _check_int_ranges(self, "choice", ("words", 2, 16), ("length", 1, 32))
        if (not isinstance(self.letters, str) or len(set(self.letters)) != len(self.letters) or len(self.letters) < 2
                or any(not c.isalpha() for c in self.letters)):
            raise ValueError(f"choice.letters={self.letters!r} must be at least 2 distinct letters")
        if len(self.letters) ** self.length < 4 * self.words:
            raise ValueError(f"choice.letters={self.letters!r} with length={self.length} has too few words for "
                             f"words={self.words}")

    def _draw(self, rng):
        alphabet = list(self.letters)
        words: list[str] = []
        while len(words) < self.words:
            w = "".join(rng.choice(alphabet, self.length))
            if w not in words:
                words.append(w)
        return {"prompt": "pick " + " ".join(words) + ":", "completion": words[int(rng.integers(self.words))],
                "words": words}

    def split_of(self, ex):
        return _split_of(ex["prompt"], self.eval_fraction)  # a prompt's every answer is in one split

    def verify(self, example, completion):
        return float(completion.strip() in example["words"])

    def chance_accuracy(self):
        return self.words / len(self.letters) ** self.length


_NAMES = ("Ada", "Bo", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Milo", "Nia",
          "Omar", "Pia", "Quin", "Rosa", "Sven", "Tara", "Uma", "Vik", "Wren", "Yara", "Zoë", "José")
_CITIES = ("Paris", "Lima", "Oslo", "Kyoto", "Cairo", "Quito", "Riga", "Perth", "Dakar", "Bern", "Hanoi", "Porto",
           "São Paulo", "Zürich")
_EXTRACTION_TEMPLATES = (
    "{name} is {age} and lives in {city}.",
    "In {city} lives {name}, aged {age}.",
    "{name} ({age}) moved to {city}.",
    "Age {age}: {name} from {city}.",
)


@TASKS.register("extraction")
@dataclasses.dataclass(frozen=True)
class Extraction(Task):
    """Text in, JSON out: a sentence about a person becomes
    ``{"name": ..., "age": ..., "city": ...}`` (keys in that order, ``", "`` / ``": "``
    separators). `verify` parses the completion and compares the object; `schema` is the
    JSON Schema the answers follow (for grammar-constrained decoding)."""

    def _draw(self, rng):
        name = _NAMES[int(rng.integers(0, len(_NAMES)))]
        city = _CITIES[int(rng.integers(0, len(_CITIES)))]
        age = int(rng.integers(1, 100))
        template = _EXTRACTION_TEMPLATES[int(rng.integers(0, len(_EXTRACTION_TEMPLATES)))]
        answer = {"name": name, "age": age, "city": city}
        return {"prompt": template.format(name=name, age=age, city=city) + " JSON: ",
                "completion": json.dumps(answer, ensure_ascii=False), "answer": answer}

    @staticmethod
    def schema() -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "city": {"type": "string"}},
                "required": ["name", "age", "city"]}

    def verify(self, example, completion):
        try:
            got = json.loads(completion)
        except (ValueError, RecursionError):
            return 0.0
        want = example["answer"]  # exact JSON types: 1.0 and true are not the integer 1
        return float(isinstance(got, dict) and got.keys() == want.keys()
                     and all(type(got[k]) is type(want[k]) and got[k] == want[k] for k in want))

    def chance_accuracy(self):
        return 1.0 / (len(_NAMES) * len(_CITIES) * 99)


def make_task(name: str, **kwargs) -> Task:
    """``make_task("arithmetic", digits=3)`` with errors naming the bad field."""
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {unknown}; options: {sorted(fields)}")
    return cls(**kwargs)


@functools.lru_cache(maxsize=32)
def _markov_chain(seed: int, n_words: int, fanout: int, zipf: float = 1.0):
    """MarkovText's words, successor table and successor weights (built once per setting,
    not once per example)."""
    rng = np.random.default_rng([seed, 7919])
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = tuple("".join(rng.choice(letters, int(rng.integers(2, 6)))) for _ in range(n_words))
    succ = np.stack([rng.choice(n_words, fanout, replace=False) for _ in range(n_words)])
    weights = 1.0 / np.arange(1, fanout + 1) ** zipf
    succ.flags.writeable = False
    p = weights / weights.sum()
    p.flags.writeable = False
    return words, succ, p


@TASKS.register("markov_text")
@dataclasses.dataclass(frozen=True)
class MarkovText(Task):
    """A synthetic corpus for small-LM pretraining: sentences from a first-order Markov chain
    over ``n_words`` made-up words, each word with ``fanout`` likely successors (Zipf weights
    ``1 / rank ** zipf``). Every token is trained (empty prompt); there is no answer to verify."""

    n_words: int = 48
    fanout: int = 4
    min_words: int = 6
    max_words: int = 12
    zipf: float = 1.0
    """Exponent of the successor weights: larger makes each word's next word more predictable."""
    generative_eval = False

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.zipf, bool) or not isinstance(self.zipf, (int, float)) or not self.zipf >= 0:
            raise ValueError(f"MarkovText.zipf={self.zipf!r} must be a number >= 0")
        _check_int_ranges(self, "MarkovText", ("n_words", 1, 100_000), ("min_words", 1, 10_000))
        _check_int_ranges(self, "MarkovText", ("fanout", 1, self.n_words), ("max_words", self.min_words, 10_000))

    def _chain(self):
        return _markov_chain(self.seed, self.n_words, self.fanout, float(self.zipf))

    def vocabulary(self) -> tuple[str, ...]:
        """The distinct words of the chain, in first-seen order (a word-level tokenizer's vocabulary)."""
        return tuple(dict.fromkeys(self._chain()[0]))

    def _draw(self, rng):
        words, succ, p = self._chain()
        w = int(rng.integers(0, self.n_words))
        out = [words[w]]
        for _ in range(int(rng.integers(self.min_words, self.max_words + 1)) - 1):
            w = int(succ[w][rng.choice(self.fanout, p=p)])
            out.append(words[w])
        return {"prompt": "", "completion": " ".join(out) + "."}

    def verify(self, example, completion):
        return float(completion.strip() == example["completion"])

    def chance_accuracy(self):
        return float("nan")
