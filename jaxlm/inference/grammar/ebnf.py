"""A small EBNF subset (XGrammar's / GBNF's notation) to grammar expressions.

    root   ::= item ("," item)*          # rules: name ::= expression; `root` is the start
    item   ::= "lit\\n" | [a-z0-9_]+ | ( sub )? | name{2,3}

Expressions: double-quoted strings (escapes as in the regex subset), character classes
``[...]`` (ranges, ``^`` negation, escapes), rule names, parentheses, alternation ``|``,
quantifiers ``* + ?`` and ``{n}``, ``{n,}``, ``{n,m}``; ``#`` starts a comment. A recursive
rule is unrolled: a rule may be entered at most ``max_depth`` times inside itself, and
derivations that would go deeper are cut (the bounded stack of the pushdown automaton).
Lookahead assertions, ``Regex(...)`` and other XGrammar extensions raise `GrammarError`.
"""

from __future__ import annotations

import re

from jaxlm.inference.grammar.automaton import (
    NOTHING,
    Alt,
    Chars,
    GrammarError,
    Repeat,
    Seq,
    map_children,
)
from jaxlm.inference.grammar.regex import MAX_REPEAT, _Parser

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


class _EBNF(_Parser):
    def skip(self):
        while self.i < len(self.p):
            c = self.p[self.i]
            if c == "#":
                j = self.p.find("\n", self.i)
                self.i = len(self.p) if j < 0 else j + 1
            elif c.isspace():
                self.i += 1
            else:
                break

    def error(self, what: str, at: int | None = None):
        at = self.i if at is None else at
        line = self.p.count("\n", 0, at) + 1
        col = at - (self.p.rfind("\n", 0, at) + 1) + 1
        raise GrammarError(f"EBNF line {line} column {col}: {what}")

    def rules(self) -> dict[str, object]:
        out: dict[str, object] = {}
        self.skip()
        while self.i < len(self.p):
            m = _NAME.match(self.p, self.i)
            if not m:
                self.error("expected a rule name")
            name = m.group()
            self.i = m.end()
            self.skip()
            if not self.p.startswith("::=", self.i):
                self.error(f"expected '::=' after rule name {name!r}")
            self.i += 3
            if name in out:
                self.error(f"rule {name!r} is defined twice")
            out[name] = self.expr()
            self.skip()
        return out

    def expr(self):
        items = [self.sequence_()]
        self.skip()
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence_())
            self.skip()
        return items[0] if len(items) == 1 else Alt(tuple(items))

    def at_rule_start(self) -> bool:
        """A name followed by ``::=``: the next rule begins."""
        m = _NAME.match(self.p, self.i)
        if not m:
            return False
        j = m.end()
        while j < len(self.p) and self.p[j].isspace():
            j += 1
        return self.p.startswith("::=", j)

    def sequence_(self):
        items = []
        while True:
            self.skip()
            c = self.peek()
            if c is None or c in "|)" or self.at_rule_start():
                break
            items.append(self.term())
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def term(self):
        atom = self.primary()
        while True:
            c = self.peek()
            if c is not None and c in "*+?":
                self.i += 1
                atom = Repeat(atom, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                q = self.braces()
                if q is None:
                    self.error("invalid repetition")
                atom = Repeat(atom, *q)
            else:
                return atom

    def braces(self):
        j = self.p.find("}", self.i)
        if j < 0:
            return None
        body = self.p[self.i + 1:j].replace(" ", "")
        m = re.fullmatch(r"(\d+)(,(\d*))?", body)
        if not m:
            self.error(f"invalid repetition {{{body}}}")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if (hi is not None and hi < lo) or max(lo, hi or 0) > MAX_REPEAT:
            self.error(f"invalid repetition {{{body}}}")
        self.i = j + 1
        return lo, hi

    def primary(self):
        c = self.peek()
        at = self.i
        if c == '"':
            self.i += 1
            cps = []
            while True:
                c = self.peek()
                if c is None or c == "\n":
                    self.error("unterminated string", at)
                if c == '"':
                    self.i += 1
                    break
                if c == "\\":
                    cp = self.escape(in_class=True)
                    if isinstance(cp, Chars):
                        self.error("class escapes are not allowed in strings")
                    cps.append(cp)
                else:
                    cps.append(ord(c))
                    self.i += 1
            return Seq(tuple(Chars(((cp, cp),)) for cp in cps))
        if c == "[":
            return Chars(self.bracket())
        if c == "(":
            self.i += 1
            if self.peek() == "=":
                self.error("lookahead assertions '(=...)' are not supported")
            e = self.expr()
            self.skip()
            if self.peek() != ")":
                self.error("missing ')'", at)
            self.i += 1
            return e
        m = _NAME.match(self.p, self.i)
        if m:
            self.i = m.end()
            if self.peek() == "(":
                self.error(f"{m.group()}(...) is not supported", at)
            return ("ref", m.group(), at)
        self.error(f"unexpected {c!r}" if c else "unexpected end of grammar")


def _check_references(rules: dict) -> None:
    """Every rule a body names is defined, in every rule (reached from ``root`` or not, as
    XGrammar checks): a misspelt name in an unused rule is an error, not ignored."""
    def walk(e, rule):
        if isinstance(e, tuple) and e and e[0] == "ref":
            if e[1] not in rules:
                raise GrammarError(f"EBNF: rule {e[1]!r} is used but not defined (in rule {rule!r})")
            return e
        return map_children(e, lambda child: walk(child, rule))

    for name, body in rules.items():
        walk(body, name)


def _expand(rules: dict, max_depth: int):
    entered: dict[str, int] = {}

    def walk(e):
        if isinstance(e, tuple) and e and e[0] == "ref":
            _, name, _at = e
            if name not in rules:
                raise GrammarError(f"EBNF: rule {name!r} is used but not defined")
            if entered.get(name, 0) > max_depth:
                return NOTHING
            entered[name] = entered.get(name, 0) + 1
            try:
                return walk(rules[name])
            finally:
                entered[name] -= 1
        return map_children(e, walk)

    return walk(("ref", "root", 0))


def parse_ebnf(grammar: str, *, max_depth: int = 4):
    """The grammar expression of ``grammar`` from its ``root`` rule (module docstring)."""
    if not isinstance(grammar, str):
        raise GrammarError(f"EBNF grammar must be a str, got {type(grammar).__name__}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise GrammarError(f"max_depth={max_depth!r} is invalid: must be an int >= 0")
    rules = _EBNF(grammar).rules()
    if "root" not in rules:
        raise GrammarError("EBNF: no 'root' rule (the start of the grammar)")
    _check_references(rules)
    return _expand(rules, max_depth)
