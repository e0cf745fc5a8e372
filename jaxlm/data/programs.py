"""Synthetic program-synthesis tasks with hidden tests, for execution-based selection.

Each `ProgramSpec` states a function to write (its name, a one-line description), a
reference solution, and the typical mistakes candidates make (each a complete program that
agrees with the reference on most typical inputs and fails on some edge cases, as sampled
LLM programs do). `candidate_pool` draws N candidates per task from the reference and the
mistakes with fixed probabilities (a common mistake can outnumber the correct program), and
`fuzz_inputs` draws inputs from a generic, type-directed distribution (integers with zero
and negatives, lists that may be empty or hold repeats, strings of mixed case) that knows
nothing about a task's bugs. Hidden tests are the reference's outputs on typical inputs
plus fixed edge cases. Every input is the list of the function's positional arguments.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    name: str
    description: str
    function: str
    arg_type: str  # "int" | "int_list" | "text" | "int_pair"
    reference: str
    mistakes: tuple[str, ...]
    edge_inputs: tuple


SPECS: tuple[ProgramSpec, ...] = (
    ProgramSpec(
        "digit_sum", "Sum of the decimal digits of an integer (ignore the sign).", "f", "int",
        "def f(n):\n    return sum(int(c) for c in str(abs(n)))\n",
        ("def f(n):\n    return sum(int(c) for c in str(n) if c.isdigit()) if n >= 0 else -sum(int(c) for c in str(-n))\n",
         "def f(n):\n    s = 0\n    while n > 0:\n        s += n % 10\n        n //= 10\n    return s\n"),
        (-45, 0, -7, 1009),
    ),
    ProgramSpec(
        "list_max", "The largest element of a list, or None for an empty list.", "f", "int_list",
        "def f(xs):\n    return max(xs) if xs else None\n",
        ("def f(xs):\n    return max(xs)\n",
         "def f(xs):\n    best = 0\n    for x in xs:\n        best = max(best, x)\n    return best if xs else None\n"),
        ([], [-3, -8], [5], [-1, -1]),
    ),
    ProgramSpec(
        "count_vowels", "Number of vowels (a, e, i, o, u; either case) in a string.", "f", "text",
        "def f(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        ("def f(s):\n    return sum(c in 'aeiou' for c in s)\n",
         "def f(s):\n    return sum(c in 'aeiouy' for c in s.lower())\n"),
        ("AEIOU", "", "Yay", "bcd"),
    ),
    ProgramSpec(
        "second_largest", "The second largest distinct value of a list, or None if there is none.", "f",
        "int_list",
        "def f(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) >= 2 else None\n",
        ("def f(xs):\n    v = sorted(xs)\n    return v[-2] if len(v) >= 2 else None\n",
         "def f(xs):\n    v = sorted(set(xs))\n    return v[-2] if len(v) > 2 else None\n"),
        ([3, 3, 1], [2, 2], [], [1, 5], [7, 7, 7, 2]),
    ),
    ProgramSpec(
        "clamp_sum", "The sum of a pair of integers, clamped to [-10, 10].", "f", "int_pair",
        "def f(a, b):\n    return max(-10, min(10, a + b))\n",
        ("def f(a, b):\n    return min(10, a + b)\n",
         "def f(a, b):\n    s = a + b\n    return 10 if s > 10 else s\n"),
        ([-9, -9], [20, 5], [-30, 1], [0, 0]),
    ),
    ProgramSpec(
        "run_length", "The length of the longest run of equal adjacent elements (0 for an empty list).", "f",
        "int_list",
        "def f(xs):\n    best = run = 0\n    for i, x in enumerate(xs):\n        run = run + 1 if i and xs[i - 1] == x else 1\n"
        "        best = max(best, run)\n    return best\n",
        ("def f(xs):\n    best = run = 1\n    for i in range(1, len(xs)):\n        run = run + 1 if xs[i - 1] == xs[i] else 1\n"
         "        best = max(best, run)\n    return best\n",
         "def f(xs):\n    return max((xs.count(x) for x in xs), default=0)\n"),
        ([], [4], [1, 1, 2, 1, 1], [3, 3, 3]),
    ),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}


def typical_input(arg_type: str, rng: np.random.Generator):
    """An input as a task's users would mostly send it: positive numbers, longer lists of
    distinct-ish values, lower-case words (where the mistakes rarely show)."""
    if arg_type == "int":
        return [int(rng.integers(10, 100_000))]
    if arg_type == "int_list":
        return [[int(x) for x in rng.choice(50, size=int(rng.integers(4, 9)), replace=False)]]
    if arg_type == "text":
        return ["".join(rng.choice(list("bcdfghjklmnpqrstvwxz aeio"), size=int(rng.integers(5, 15))))]
    if arg_type == "int_pair":
        return [int(x) for x in rng.integers(-4, 5, size=2)]
    raise ValueError(f"arg_type={arg_type!r} is unknown")


def fuzz_inputs(arg_type: str, n: int, rng: np.random.Generator) -> list:
    """``n`` inputs from a generic type-directed fuzzer (no task knowledge): small and large
    magnitudes, zero and negatives, empty and singleton lists, repeats, mixed case."""
    out = []
    for _ in range(n):
        if arg_type == "int":
            out.append([int(rng.choice([0, 1, -1, *rng.integers(-1000, 1000, size=3)]))])
        elif arg_type == "int_list":
            k = int(rng.choice([0, 1, 2, 3, 5]))
            out.append([[int(x) for x in rng.integers(-5, 6, size=k)]])
        elif arg_type == "text":
            k = int(rng.integers(0, 8))
            out.append(["".join(rng.choice(list(string.ascii_letters[:26] + "AEIOUY "), size=k))])
        elif arg_type == "int_pair":
            out.append([int(x) for x in rng.integers(-30, 31, size=2)])
        else:
            raise ValueError(f"arg_type={arg_type!r} is unknown")
    return out


def hidden_tests(spec: ProgramSpec, *, n_typical: int = 20, seed: int = 0) -> list:
    """The inputs a candidate must pass: typical inputs and the spec's edge cases."""
    rng = np.random.default_rng(seed)
    edge = [list(x) if spec.arg_type == "int_pair" else [list(x) if isinstance(x, tuple) else x]
            for x in spec.edge_inputs]
    return [typical_input(spec.arg_type, rng) for _ in range(n_typical)] + edge


def candidate_pool(spec: ProgramSpec, n: int, rng: np.random.Generator, *, p_correct: float = 0.3
                   ) -> tuple[list[str], list[bool]]:
    """``n`` candidates: the reference with probability ``p_correct``, else a mistake (the
    first, most common, twice as likely as each other). Returns (programs, is_reference)."""
    if not 0.0 <= p_correct <= 1.0:
        raise ValueError(f"p_correct={p_correct} must be in [0, 1]")
    m = len(spec.mistakes)
    weights = np.array([2.0] + [1.0] * (m - 1))
    probs = np.r_[p_correct, (1 - p_correct) * weights / weights.sum()]
    picks = rng.choice(m + 1, size=n, p=probs)
    return [spec.reference if k == 0 else spec.mistakes[k - 1] for k in picks], [bool(k == 0) for k in picks]
