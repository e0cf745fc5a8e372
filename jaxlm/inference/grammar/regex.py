"""Regular expressions to grammar expressions (the whole output must match).

Supported: literals; escapes ``\\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH \\u{H...}`` and escaped
punctuation; classes ``\\d \\D \\w \\W \\s \\S`` (``\\s`` is JavaScript's whitespace set, as in
XGrammar); ``.`` (any code point, newline included, as in XGrammar); bracket classes with
ranges and negation; groups ``( )`` and ``(?: )``; alternation ``|``; quantifiers ``* + ?
{n} {n,} {n,m}`` (a trailing ``?``, lazy, matches the same strings); ``^`` at the start and
``$`` at the end (the match is always whole). Backreferences, lookaround, named groups and
other anchors raise `GrammarError` naming the construct and its position.
"""

from __future__ import annotations

import re

from jaxlm.inference.grammar.automaton import (
    MAX_CODE_POINT,
    Alt,
    Chars,
    GrammarError,
    Repeat,
    Seq,
    complement,
    normalize_ranges,
)

DIGIT = ((0x30, 0x39),)
WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
SPACE = normalize_ranges([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                          (0xFEFF, 0xFEFF)])
CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a", "e": "\x1b"}
MAX_REPEAT = 1000


class _Parser:
    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0

    def error(self, what: str, at: int | None = None):
        at = self.i if at is None else at
        raise GrammarError(f"regex {self.p!r}: {what} at position {at}")

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.p[j] if j < len(self.p) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        expr = self.alternation()
        if self.peek() == "$" and self.i == len(self.p) - 1:
            self.i += 1
        if self.i != len(self.p):
            self.error(f"unexpected {self.p[self.i]!r}")
        return expr

    def alternation(self):
        items = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence())
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            if self.peek() == "$" and self.i == len(self.p) - 1:
                break
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantified(self):
        atom = self.atom()
        c = self.peek()
        if c is None or c not in "*+?{":
            return atom
        if c == "{":
            q = self.braces()
            if q is None:  # not a count: a literal "{", read by the next atom
                return atom
            lo, hi = q
        else:
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":
            self.i += 1  # lazy: the same language
        elif self.peek() == "+":
            self.error("possessive quantifiers are not supported")
        if self.peek() is not None and (self.peek() in "*+?" or (self.peek() == "{" and self._count_follows())):
            self.error("multiple repeat (a quantifier after a quantifier, as Python's re refuses it)")
        return Repeat(atom, lo, hi)

    def _count_follows(self) -> bool:
        """Whether a repetition count ``{...}`` starts here (nothing is consumed)."""
        at = self.i
        try:
            return self.braces() is not None
        finally:
            self.i = at

    def braces(self):
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1:j]
        # digits only, as Python's re reads a repetition ({n}, {m,n}, {m,}, {,n}); anything else
        # ("{ 2}", "{1_0}", "{+3}") is literal text there, not a count int() would accept
        if re.fullmatch(r"[0-9]+", body):
            lo = hi = int(body)
        elif re.fullmatch(r"[0-9]*,[0-9]*", body):
            first, second = body.split(",")
            lo, hi = int(first or 0), int(second) if second else None
        else:
            return None
        if lo < 0 or (hi is not None and hi < lo):
            self.error(f"invalid repetition {{{body}}}")
        if max(lo, hi or 0) > MAX_REPEAT:
            self.error(f"repetition {{{body}}} exceeds {MAX_REPEAT}")
        self.i = j + 1
        return lo, hi

    def atom(self):
        c = self.peek()
        if c == "(":
            at = self.i
            self.i += 1
            if self.peek() == "?":
                if self.peek(1) == ":":
                    self.i += 2
                else:
                    kind = {"=": "lookahead", "!": "negative lookahead", "<": "lookbehind or named group",
                            "P": "named group"}.get(self.peek(1), "group flag")
                    self.error(f"{kind} '(?{self.peek(1) or ''}' is not supported", at)
            expr = self.alternation()
            if self.peek() != ")":
                self.error("missing ')'", at)
            self.i += 1
            return expr
        if c == "[":
            return Chars(self.bracket())
        if c == ".":
            self.i += 1
            return Chars(((0, MAX_CODE_POINT),))
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?":
            self.error(f"nothing to repeat before {c!r}")
        if c in "^$":
            self.error(f"anchor {c!r} inside the pattern is not supported (the whole output is matched)")
        self.i += 1
        return Chars(((ord(c), ord(c)),))

    def hex_digits(self, n: int | None) -> int:
        if n is None:  # \u{...}
            j = self.p.find("}", self.i)
            if self.peek() != "{" or j < 0:
                self.error("invalid \\u{...} escape")
            text, self.i = self.p[self.i + 1:j], j + 1
        else:
            text, self.i = self.p[self.i:self.i + n], self.i + n
        if not re.fullmatch(r"[0-9A-Fa-f]+", text):  # int(text, 16) also takes "+f", "0_1", " f"
            self.error(f"invalid hexadecimal escape {text!r}")
        value = int(text, 16)
        if value > MAX_CODE_POINT or (n is not None and len(text) != n):
            self.error(f"invalid hexadecimal escape {text!r}")
        return value

    def escape(self, in_class: bool):
        """``\\x`` at ``self.i``: a code point (int) or a class (`Chars`)."""
        at = self.i
        self.i += 1
        c = self.peek()
        if c is None:
            self.error("dangling backslash", at)
        self.i += 1
        if c.lower() in CLASSES:
            ranges = CLASSES[c.lower()]
            return Chars(complement(ranges) if c.isupper() else ranges)
        if c in SIMPLE_ESCAPES:
            cp = ord(SIMPLE_ESCAPES[c])
        elif c == "x":
            cp = self.hex_digits(2)
        elif c == "u":
            cp = self.hex_digits(None if self.peek() == "{" else 4)
        elif c.isdigit():
            self.error(f"backreference \\{c} is not supported", at)
        elif c in "bBAzZG" and not in_class:
            self.error(f"anchor \\{c} is not supported", at)
        elif c == "b":
            cp = 0x08
        elif c.isalnum():
            self.error(f"unknown escape \\{c}", at)
        else:
            cp = ord(c)
        return Chars(((cp, cp),)) if not in_class else cp

    def bracket(self) -> tuple[tuple[int, int], ...]:
        at = self.i
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                self.error("missing ']'", at)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_atom()
            if isinstance(lo, Chars):
                ranges.extend(lo.ranges)
                continue
            if self.peek() == "-" and self.peek(1) not in (None, "]"):
                self.i += 1
                hi = self.class_atom()
                if isinstance(hi, Chars):
                    self.error("a class escape cannot end a range")
                if hi < lo:
                    self.error(f"range {chr(lo)!r}-{chr(hi)!r} is reversed")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        ranges = normalize_ranges(ranges)
        return complement(ranges) if negate else ranges

    def class_atom(self):
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[" and self.peek(1) == ":":
            self.error("POSIX classes [:name:] are not supported")
        self.i += 1
        return ord(c)


def parse_regex(pattern: str):
    """The grammar expression of ``pattern`` (module docstring for the syntax)."""
    if not isinstance(pattern, str):
        raise GrammarError(f"regex must be a str, got {type(pattern).__name__}")
    return _Parser(pattern).parse()

