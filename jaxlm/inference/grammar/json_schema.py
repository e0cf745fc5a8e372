"""JSON Schema (a documented subset) to grammar expressions.

The language is XGrammar's for the same schema (``GrammarCompiler.compile_json_schema``,
strict mode), so the two give the same token masks:

* ``type``: ``object``, ``array``, ``string``, ``number``, ``integer``, ``boolean``, ``null``, or a
  list of them; ``enum`` and ``const`` (values written as compact JSON); ``anyOf``;
* objects: ``properties`` in schema order, ``required`` (others optional),
  ``additionalProperties`` absent or false (no other keys); an object schema with neither
  ``properties`` nor ``additionalProperties`` takes any object (its values as ``{}``'s);
* arrays: ``items``, ``minItems``, ``maxItems``;
* strings: ``minLength`` / ``maxLength`` counted in characters, an escape being one
  (XGrammar differs here: its bounded strings take any character but ``"``, ``\\``, CR and
  LF, raw control characters included, which JSON forbids, and no escapes), ``pattern``
  (the regex subset of `jaxlm.inference.grammar.regex`, between the quotes);
* numbers: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``; integers ``0|-?[1-9][0-9]*``;
* ``{}`` / a missing ``items``: any JSON value, its arrays and objects nested at most
  ``max_depth`` deep counted from the root (the one place the language is cut to a bounded
  stack: XGrammar's is unbounded);
* annotations (``title``, ``description``, ``default``, ``examples``, ``$schema``, ``$id``,
  ``$comment``) are ignored.

Whitespace: ``any_whitespace=True`` (XGrammar's default) allows ``[ \\n\\r\\t]*`` around
structural characters; False writes exactly ``", "`` and ``": "`` between items and none
inside brackets. Any other keyword raises `GrammarError` naming it and where it is.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jaxlm.inference.grammar.automaton import (
    EMPTY,
    NOTHING,
    Alt,
    Chars,
    GrammarError,
    Repeat,
    Seq,
    alt,
    chars,
    complement,
    literal,
    map_children,
    optional,
    seq,
    star,
    to_dfa,
)
from jaxlm.inference.grammar.regex import parse_regex

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment"})
KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "pattern"},
    "number": {"type"},
    "integer": {"type"},
    "boolean": {"type"},
    "null": {"type"},
}
TYPES = tuple(KEYWORDS)

DIGITS = chars((0x30, 0x39))
INTEGER = alt(literal("0"), seq(optional(literal("-")), chars((0x31, 0x39)), star(DIGITS)))
NUMBER = seq(
    optional(literal("-")),
    alt(literal("0"), seq(chars((0x31, 0x39)), star(DIGITS))),
    optional(seq(literal("."), Repeat(DIGITS, 1, None))),
    optional(seq(chars((0x45, 0x45), (0x65, 0x65)), optional(chars((0x2B, 0x2B), (0x2D, 0x2D))),
                 Repeat(DIGITS, 1, None))),
)
HEX = chars((0x30, 0x39), (0x41, 0x46), (0x61, 0x66))
ESCAPE = seq(literal("\\"), alt(chars(*((ord(c), ord(c)) for c in "\"\\/bfnrt")), seq(literal("u"), HEX, HEX, HEX, HEX)))
STRING_CHAR = chars((0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF))  # not control, '"' or '\'
STRING = seq(literal('"'), star(alt(STRING_CHAR, ESCAPE)), literal('"'))
# one character of a length-bounded string, as JSON Schema counts them (code points after
# decoding): a raw character, an escape of a non-surrogate, or a surrogate pair's two escapes
_NOT_D = chars((0x30, 0x39), (0x41, 0x43), (0x45, 0x46), (0x61, 0x63), (0x65, 0x66))
_D = chars((0x44, 0x44), (0x64, 0x64))
_U = literal("\\u")
_BMP_ESCAPE = seq(_U, alt(seq(_NOT_D, HEX), seq(_D, chars((0x30, 0x37)))), HEX, HEX)
_PAIR_ESCAPE = seq(_U, _D, chars((0x38, 0x39), (0x41, 0x42), (0x61, 0x62)), HEX, HEX,
                   _U, _D, chars((0x43, 0x46), (0x63, 0x66)), HEX, HEX)
COUNTED_CHAR = alt(STRING_CHAR, seq(literal("\\"), chars(*((ord(c), ord(c)) for c in "\"\\/bfnrt"))),
                   _BMP_ESCAPE, _PAIR_ESCAPE)
BOOLEAN = alt(literal("true"), literal("false"))
NULL = literal("null")


_ESCAPED = re.compile("[\x7f\ud800-\udfff]")  # written as \\uXXXX: DEL (as XGrammar), lone surrogates (not UTF-8)


def json_text(value: Any, where: str = "#") -> str:
    """``value`` as compact JSON text, written as XGrammar writes ``enum`` / ``const`` values:
    a whole-number float as an integer (``1.0`` -> ``1``, ``-0.0`` -> ``-0``), DEL and lone
    surrogates escaped; a non-finite number (not JSON) is a `GrammarError`."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise GrammarError(f"JSON schema {where}: {value!r} is not a JSON number (a literal past float range, "
                               "or NaN / Infinity)")
        if value.is_integer() and abs(value) < 2**53:
            return "-0" if value == 0 and math.copysign(1.0, value) < 0 else str(int(value))
        return json.dumps(value)
    if isinstance(value, str):
        return _ESCAPED.sub(lambda m: "\\u%04x" % ord(m.group()), json.dumps(value, ensure_ascii=False))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(json_text(v, where) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json_text(str(k), where) + ":" + json_text(v, where) for k, v in value.items()) + "}"
    raise GrammarError(f"JSON schema {where}: {value!r} ({type(value).__name__}) is not a JSON value")


def _has_type(value: Any, t: str) -> bool:
    """Whether a JSON value is an instance of JSON-schema type ``t``."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    integer = number and (isinstance(value, int) or value.is_integer())  # float() of 10**400 overflows
    return {"integer": integer, "number": number, "string": isinstance(value, str),
            "boolean": isinstance(value, bool), "null": value is None, "array": isinstance(value, list),
            "object": isinstance(value, dict)}.get(t, False)


def _within_string(expr):
    """``expr`` with every character class cut to the characters a JSON string holds raw
    (no control character, ``"`` or ``\\``): a pattern's ``.`` or ``[^x]`` written between the
    quotes must not end the string or break it."""
    if isinstance(expr, Chars):
        return Chars(complement(complement(expr.ranges) + complement(STRING_CHAR.ranges)))
    return map_children(expr, _within_string)


class _Builder:
    def __init__(self, any_whitespace: bool, max_depth: int):
        ws = star(chars((0x20, 0x20), (0x0A, 0x0A), (0x0D, 0x0D), (0x09, 0x09))) if any_whitespace else EMPTY
        self.ws = ws
        self.item_sep = seq(ws, literal(","), ws) if any_whitespace else literal(", ")
        self.key_sep = seq(ws, literal(":"), ws) if any_whitespace else literal(": ")
        self.max_depth = max_depth

    def bracketed(self, open_: str, first, rest, close: str, allow_empty: bool, min_rest: int = 0,
                  max_rest: int | None = None):
        body = seq(literal(open_), self.ws, first, Repeat(seq(self.item_sep, rest), min_rest, max_rest), self.ws,
                   literal(close))
        return alt(body, seq(literal(open_), self.ws, literal(close))) if allow_empty else body

    def any_value(self, depth: int):
        scalars = [NUMBER, STRING, BOOLEAN, NULL]
        if depth >= self.max_depth:
            return alt(*scalars)
        inner = self.any_value(depth + 1)
        member = seq(STRING, self.key_sep, inner)
        return alt(*scalars, self.bracketed("[", inner, inner, "]", True),
                   self.bracketed("{", member, member, "}", True))

    def schema(self, s: Any, where: str, depth: int):
        if s is True or s == {}:
            return self.any_value(depth)
        if s is False:
            raise GrammarError(f"JSON schema {where}: false matches nothing")
        if not isinstance(s, dict):
            raise GrammarError(f"JSON schema {where}: a schema must be an object or a boolean, got {s!r}")
        keys = set(s) - ANNOTATIONS
        if "enum" in s or "const" in s:
            kw = "enum" if "enum" in s else "const"
            extra = keys - {kw, "type"}
            if extra:
                raise GrammarError(f"JSON schema {where}: {sorted(extra)[0]!r} beside {kw!r} is not supported")
            values = s["enum"] if kw == "enum" else [s["const"]]
            if kw == "enum" and (not isinstance(values, list) or not values):
                raise GrammarError(f"JSON schema {where}: 'enum' must be a non-empty list")
            if "type" in s:  # a value must satisfy both keywords
                types = s["type"] if isinstance(s["type"], list) else [s["type"]]
                values = [v for v in values if any(_has_type(v, t) for t in types)]
                if not values:
                    raise GrammarError(f"JSON schema {where}: no {kw!r} value has type {s['type']!r}")
            return alt(*(literal(json_text(v, f"{where}.{kw}")) for v in values))
        if "anyOf" in s:
            extra = keys - {"anyOf"}
            if extra:
                raise GrammarError(f"JSON schema {where}: {sorted(extra)[0]!r} beside 'anyOf' is not supported")
            cases = s["anyOf"]
            if not isinstance(cases, list) or not cases:
                raise GrammarError(f"JSON schema {where}: 'anyOf' must be a non-empty list")
            return alt(*(self.schema(c, f"{where}.anyOf[{i}]", depth) for i, c in enumerate(cases)))
        if "type" not in s:
            unknown = sorted(keys)
            if unknown:
                raise GrammarError(f"JSON schema {where}: keyword {unknown[0]!r} without 'type' is not supported")
            return self.any_value(depth)
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not types:
            raise GrammarError(f"JSON schema {where}: 'type' is an empty list")
        for t in types:
            if t not in TYPES:
                raise GrammarError(f"JSON schema {where}: type {t!r} is not one of {TYPES}")
        allowed = set().union(*(KEYWORDS[t] for t in types))
        for k in sorted(keys):
            if k not in allowed:
                raise GrammarError(f"JSON schema {where}: keyword {k!r} is not supported for type "
                                   f"{'/'.join(types)} (supported: {sorted(allowed - {'type'})})")
        return alt(*(self.typed(t, s, where, depth) for t in types)) if len(types) > 1 else \
            self.typed(types[0], s, where, depth)

    def typed(self, t: str, s: dict, where: str, depth: int):
        if t == "integer":
            return INTEGER
        if t == "number":
            return NUMBER
        if t == "boolean":
            return BOOLEAN
        if t == "null":
            return NULL
        if t == "string":
            return self.string(s, where)
        if t == "array":
            return self.array(s, where, depth)
        return self.object(s, where, depth)

    def string(self, s: dict, where: str):
        if "pattern" in s:
            if "minLength" in s or "maxLength" in s:
                raise GrammarError(f"JSON schema {where}: 'pattern' with 'minLength'/'maxLength' is not supported")
            if not isinstance(s["pattern"], str):
                raise GrammarError(f"JSON schema {where}: 'pattern' must be a string")
            inner = _within_string(parse_regex(s["pattern"]))
            try:  # a pattern whose every match needs a JSON escape can write nothing raw
                to_dfa(inner)
            except GrammarError as e:
                if "never be completed" in str(e):
                    raise GrammarError(
                        f"JSON schema {where}: 'pattern' {s['pattern']!r} matches only strings holding a quote, a "
                        "backslash or a control character, which a JSON string writes escaped and a pattern here "
                        "cannot (patterns constrain the raw characters)") from None
            return seq(literal('"'), inner, literal('"'))
        if "minLength" in s or "maxLength" in s:
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            for name, v in (("minLength", lo), ("maxLength", hi)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise GrammarError(f"JSON schema {where}: {name!r} must be an integer >= 0, got {v!r}")
            if hi is not None and hi < lo:
                return NOTHING
            # lone surrogate escapes are left out: whether one counts alone or in a pair is not
            # something a character count can leave ambiguous
            return seq(literal('"'), Repeat(COUNTED_CHAR, lo, hi), literal('"'))
        return STRING

    def array(self, s: dict, where: str, depth: int):
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        for name, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise GrammarError(f"JSON schema {where}: {name!r} must be an integer >= 0, got {v!r}")
        if hi is not None and hi < lo:
            return NOTHING
        if hi == 0 or (s.get("items", True) is False and lo == 0):  # no item allowed: only []
            return seq(literal("["), self.ws, literal("]"))
        item = self.schema(s.get("items", True), f"{where}.items", depth + 1)
        return self.bracketed("[", item, item, "]", lo == 0, max(lo - 1, 0), None if hi is None else hi - 1)

    def any_object(self, depth: int):
        """Any JSON object, its values nested within ``max_depth`` (as ``{}``'s objects)."""
        if depth >= self.max_depth:
            return seq(literal("{"), self.ws, literal("}"))
        member = seq(STRING, self.key_sep, self.any_value(depth + 1))
        return self.bracketed("{", member, member, "}", True)

    def object(self, s: dict, where: str, depth: int):
        if "properties" not in s and "additionalProperties" not in s and not s.get("required"):
            return self.any_object(depth)  # {"type": "object"}: any object, as in JSON Schema and XGrammar
        if s.get("additionalProperties", False) is not False:
            raise GrammarError(f"JSON schema {where}: 'additionalProperties' other than false is not supported")
        props = s.get("properties", {})
        required = s.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list):
            raise GrammarError(f"JSON schema {where}: 'properties' must be an object and 'required' a list")
        missing = [r for r in required if r not in props]
        if missing:
            raise GrammarError(f"JSON schema {where}: required property {missing[0]!r} is not in 'properties'")
        items = [(seq(literal(json_text(k, where)), self.key_sep,
                      self.schema(v, f"{where}.properties.{k}", depth + 1)), k in required)
                 for k, v in props.items()]
        if not items:
            return seq(literal("{"), self.ws, literal("}"))

        def tail(i: int):  # after something has been written: ", p_i" for the rest
            if i == len(items):
                return EMPTY
            p, req = items[i]
            member = seq(self.item_sep, p)
            return seq(member if req else optional(member), tail(i + 1))

        def head(i: int):  # nothing written yet
            if i == len(items):
                return None
            p, req = items[i]
            here = seq(p, tail(i + 1))
            if req:
                return here
            later = head(i + 1)
            return here if later is None else Alt((here, later))

        body = seq(literal("{"), self.ws, head(0), self.ws, literal("}"))
        if any(req for _, req in items):
            return body
        return alt(body, seq(literal("{"), self.ws, literal("}")))


def parse_json_schema(schema: Any, *, any_whitespace: bool = True, max_depth: int = 4) -> Seq | Alt:
    """The grammar expression of ``schema`` (a dict or a JSON string; module docstring)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"JSON schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise GrammarError(f"max_depth={max_depth!r} is invalid: must be an int >= 1")
    return _Builder(any_whitespace, max_depth).schema(schema, "#", 0)
