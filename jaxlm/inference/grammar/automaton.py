"""Byte-level automata for grammar-constrained decoding.

A grammar front end (regular expression, JSON Schema, EBNF) produces an `Expr` over Unicode
code points. `to_dfa` lowers it to a deterministic automaton over UTF-8 bytes:

1. code point sets become alternatives of byte-range sequences (the standard UTF-8 range
   split; every code point in ``[0, 0x10FFFF]`` is encoded, as XGrammar does);
2. a Thompson NFA over byte ranges;
3. subset construction over byte classes (bytes no range boundary separates);
4. pruning to the states reachable from the start that can still reach acceptance (so every
   transition the automaton allows can be completed), then Moore minimisation.

A recursive grammar (EBNF, nested JSON) is unrolled to a bounded depth by its front end
before it gets here: the stack configurations up to that depth are the finite set of
augmented states (Gram2Token's construction), and the automaton is the pushdown
automaton restricted to them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

MAX_CODE_POINT = 0x10FFFF


class GrammarError(ValueError):
    """A grammar is malformed, uses a construct outside the supported subset, or can never
    be completed."""


# --- expressions over code points ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Chars:
    """One code point from a union of inclusive ranges."""

    ranges: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Seq:
    items: tuple


@dataclasses.dataclass(frozen=True)
class Alt:
    items: tuple


@dataclasses.dataclass(frozen=True)
class Repeat:
    item: object
    min: int
    max: int | None  # None: unbounded


EMPTY = Seq(())
NOTHING = Alt(())  # matches no string


def map_children(expr, f):
    """``expr`` with ``f`` applied to each direct child (a `Seq`'s or `Alt`'s items, a
    `Repeat`'s item); any other node is returned unchanged."""
    if isinstance(expr, Seq):
        return Seq(tuple(f(x) for x in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(f(x) for x in expr.items))
    if isinstance(expr, Repeat):
        return Repeat(f(expr.item), expr.min, expr.max)
    return expr


def normalize_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, clipped to ``[0, MAX_CODE_POINT]``."""
    out: list[list[int]] = []
    for lo, hi in sorted((max(0, a), min(MAX_CODE_POINT, b)) for a, b in ranges):
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def complement(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out, prev = [], 0
    for lo, hi in normalize_ranges(ranges):
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= MAX_CODE_POINT:
        out.append((prev, MAX_CODE_POINT))
    return tuple(out)


def chars(*ranges: tuple[int, int]) -> Chars:
    return Chars(normalize_ranges(ranges))


def literal(text: str) -> Seq:
    return Seq(tuple(Chars(((ord(c), ord(c)),)) for c in text))


def seq(*items) -> Seq:
    return Seq(tuple(items))


def alt(*items) -> Alt:
    return Alt(tuple(items))


def optional(item) -> Repeat:
    return Repeat(item, 0, 1)


def star(item) -> Repeat:
    return Repeat(item, 0, None)


# --- UTF-8 ----------------------------------------------------------------------------------


def _encode(cp: int) -> list[int]:
    """UTF-8 bytes of a code point (a surrogate's raw three-byte form, never produced: see
    `utf8_sequences`)."""
    if cp < 0x80:
        return [cp]
    if cp < 0x800:
        return [0xC0 | cp >> 6, 0x80 | cp & 0x3F]
    if cp < 0x10000:
        return [0xE0 | cp >> 12, 0x80 | (cp >> 6) & 0x3F, 0x80 | cp & 0x3F]
    return [0xF0 | cp >> 18, 0x80 | (cp >> 12) & 0x3F, 0x80 | (cp >> 6) & 0x3F, 0x80 | cp & 0x3F]


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Byte-range sequences whose concatenations are exactly the UTF-8 encodings of the code
    points ``lo..hi``, less the surrogates U+D800..U+DFFF, which have no UTF-8 encoding (their
    raw three-byte forms, which XGrammar 0.2.9 accepts, are not UTF-8: a JSON string holding one
    does not decode, and counts as several characters once replaced)."""
    if lo <= 0xDFFF and hi >= 0xD800:
        return (utf8_sequences(lo, 0xD7FF) if lo < 0xD800 else []) + (utf8_sequences(0xE000, hi) if hi > 0xDFFF else [])
    for bound in (0x7F, 0x7FF, 0xFFFF):
        if lo <= bound < hi:
            return utf8_sequences(lo, bound) + utf8_sequences(bound + 1, hi)
    n = len(_encode(lo))
    if n > 1:
        for i in range(1, n):
            m = (1 << (6 * i)) - 1
            if lo & ~m != hi & ~m:
                if lo & m:
                    return utf8_sequences(lo, lo | m) + utf8_sequences((lo | m) + 1, hi)
                if hi & m != m:
                    return utf8_sequences(lo, (hi & ~m) - 1) + utf8_sequences(hi & ~m, hi)
    a, b = _encode(lo), _encode(hi)
    return [list(zip(a, b))]


# --- NFA ------------------------------------------------------------------------------------


class _NFA:
    def __init__(self):
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def state(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, expr, limit: int) -> tuple[int, int]:
        if len(self.eps) > limit:
            raise GrammarError(f"the grammar needs more than {limit} automaton states; bound its repetitions or "
                               "nesting depth")
        if isinstance(expr, Chars):
            s, e = self.state(), self.state()
            for lo, hi in expr.ranges:
                for ranges in utf8_sequences(lo, hi):
                    cur = s
                    for j, (a, b) in enumerate(ranges):
                        nxt = e if j == len(ranges) - 1 else self.state()
                        self.edges[cur].append((a, b, nxt))
                        cur = nxt
            return s, e
        if isinstance(expr, Seq):
            s = e = self.state()
            for item in expr.items:
                a, b = self.build(item, limit)
                self.eps[e].append(a)
                e = b
            return s, e
        if isinstance(expr, Alt):
            s, e = self.state(), self.state()
            for item in expr.items:
                a, b = self.build(item, limit)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if isinstance(expr, Repeat):
            s = e = self.state()
            for _ in range(expr.min):
                a, b = self.build(expr.item, limit)
                self.eps[e].append(a)
                e = b
            if expr.max is None:
                a, b = self.build(expr.item, limit)
                self.eps[e].append(a)
                self.eps[b].append(a)
                end = self.state()
                self.eps[e].append(end)
                self.eps[b].append(end)
                return s, end
            end = self.state()
            for _ in range(expr.max - expr.min):
                a, b = self.build(expr.item, limit)
                self.eps[e].append(a)
                self.eps[e].append(end)
                e = b
            self.eps[e].append(end)
            return s, end
        raise TypeError(f"not a grammar expression: {expr!r}")


# --- DFA ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ByteDFA:
    """``delta [S, 256]`` (next state, -1 rejects), ``accepting [S]``; state 0 is the start.
    Every state is reachable from the start and can reach an accepting state."""

    delta: np.ndarray
    accepting: np.ndarray

    @property
    def num_states(self) -> int:
        return self.delta.shape[0]

    def run(self, data: bytes, state: int = 0) -> int:
        """The state after ``data`` (-1 once rejected)."""
        for b in data:
            if state < 0:
                return -1
            state = int(self.delta[state, b])
        return state

    def matches(self, data: bytes) -> bool:
        s = self.run(data)
        return s >= 0 and bool(self.accepting[s])


def _determinize(nfa: _NFA, start: int, final: int, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Subset construction over byte classes (maximal byte ranges no NFA edge splits):
    ``(delta [S, classes], accepting [S], byte_class [256])``."""
    bounds = {0, 256}
    for edges in nfa.edges:
        for a, b, _ in edges:
            bounds.update((a, b + 1))
    cuts = sorted(bounds)
    byte_class = np.zeros(256, np.int64)
    for c, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        byte_class[a:b] = c
    n_classes = len(cuts) - 1
    edges_by_class = [[(int(byte_class[a]), int(byte_class[b]), t) for a, b, t in edges] for edges in nfa.edges]

    state_closure: dict[int, frozenset] = {}

    def one(s: int) -> frozenset:  # the epsilon closure of one NFA state (depth-first, once)
        if s not in state_closure:
            out, stack = {s}, list(nfa.eps[s])
            while stack:
                t = stack.pop()
                if t not in out:
                    out.add(t)
                    stack.extend(nfa.eps[t])
            state_closure[s] = frozenset(out)
        return state_closure[s]

    set_closure: dict[frozenset, frozenset] = {}

    def closure(states) -> frozenset:
        key = frozenset(states)
        if key not in set_closure:
            set_closure[key] = frozenset().union(*(one(s) for s in key))
        return set_closure[key]

    first = closure((start,))
    ids = {first: 0}
    order = [first]
    rows = []
    i = 0
    while i < len(order):
        members = order[i]
        targets: dict[int, set] = {}
        for s in members:
            for ca, cb, t in edges_by_class[s]:
                for c in range(ca, cb + 1):
                    targets.setdefault(c, set()).add(t)
        row = np.full(n_classes, -1, np.int64)
        for c, ts in targets.items():
            key = closure(ts)
            if key not in ids:
                if len(order) >= limit:
                    raise GrammarError(f"the grammar needs more than {limit} automaton states; bound its "
                                       "repetitions or nesting depth")
                ids[key] = len(order)
                order.append(key)
            row[c] = ids[key]
        rows.append(row)
        i += 1
    accepting = np.array([final in m for m in order])
    return np.stack(rows), accepting, byte_class


def _prune(delta: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep states reachable from 0 that can reach acceptance; transitions elsewhere reject.
    ``delta [S, symbols]``: any alphabet (here the byte classes)."""
    S = delta.shape[0]
    src, sym = np.nonzero(delta >= 0)
    edges = np.unique(src * S + delta[src, sym])  # distinct (from, to) pairs
    succ: list[list[int]] = [[] for _ in range(S)]
    pred: list[list[int]] = [[] for _ in range(S)]
    for a, b in zip((edges // S).tolist(), (edges % S).tolist()):
        succ[a].append(b)
        pred[b].append(a)

    def closure(seeds, step) -> np.ndarray:  # every state reachable from seeds along step
        seen = np.zeros(S, bool)
        seen[seeds] = True
        stack = list(seeds)
        while stack:
            for t in step[stack.pop()]:
                if not seen[t]:
                    seen[t] = True
                    stack.append(t)
        return seen

    live = closure(np.flatnonzero(accepting).tolist(), pred)
    if not live[0]:
        raise GrammarError("the grammar can never be completed: no string matches it")
    keep = np.flatnonzero(live & closure([0], [[t for t in out if live[t]] for out in succ]))
    remap = np.full(S, -1, np.int64)
    remap[keep] = np.arange(len(keep))
    d = delta[keep]
    return np.where(d >= 0, remap[np.where(d >= 0, d, 0)], -1), accepting[keep]


def _minimize(delta: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Moore partition refinement over ``delta [S, symbols]``; state 0 stays the start."""
    S = delta.shape[0]
    _, first_col = np.unique(delta.T, axis=0, return_index=True)
    columns = delta[:, np.sort(first_col)]  # one column per class of bytes no state tells apart
    part = accepting.astype(np.int64)
    n = len(np.unique(part))
    while True:
        succ = np.where(columns >= 0, part[np.where(columns >= 0, columns, 0)], -1)
        sig = np.concatenate([part[:, None], succ], axis=1)
        # block ids: rank of each distinct signature row (sorted lexicographically)
        order = np.lexsort(sig.T[::-1])
        ranked = sig[order]
        ids = np.concatenate([[0], np.cumsum(np.any(ranked[1:] != ranked[:-1], axis=1))])
        new = np.empty(S, np.int64)
        new[order] = ids
        m = int(ids[-1]) + 1
        part = new
        if m == n:
            break
        n = m
    # renumber blocks in order of first appearance so the start's block is 0; each block's
    # representative is its first state
    _, first_state = np.unique(part, return_index=True)
    rep = np.sort(first_state)
    renumber = np.empty(len(rep), np.int64)
    renumber[part[rep]] = np.arange(len(rep))
    block = renumber[part]
    d = delta[rep]
    d = np.where(d >= 0, block[np.where(d >= 0, d, 0)], -1)
    return d.astype(np.int32), accepting[rep]


def to_dfa(expr, *, max_states: int = 200_000) -> ByteDFA:
    """The minimal byte DFA of ``expr`` (pruned to completable states)."""
    nfa = _NFA()
    start, final = nfa.build(expr, max_states * 8)
    # prune and minimise over the byte classes (tens of columns, not 256), then expand
    delta, accepting, byte_class = _determinize(nfa, start, final, max_states)
    delta, accepting = _prune(delta, accepting)
    delta, accepting = _minimize(delta, accepting)
    return ByteDFA(delta=np.ascontiguousarray(delta[:, byte_class]), accepting=accepting)
