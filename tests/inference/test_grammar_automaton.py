"""The byte automaton and the token-table builder against definitions written here: the
DFA is trim (every state reachable and able to reach acceptance) and minimal (no two states
accept the same suffixes: the table-filling algorithm over all 256 bytes), it accepts what
Python's `re` accepts on ASCII patterns, and the token tables group tokens exactly by their
outcome vectors even when every outcome hash collides (the exact fallback)."""

import itertools
import json
import re

import numpy as np
import pytest

import jaxlm.inference.grammar.tables as T
from jaxlm.inference.grammar.automaton import to_dfa
from jaxlm.inference.grammar.json_schema import parse_json_schema
from jaxlm.inference.grammar.regex import parse_regex

PATTERNS = [
    r"(cat|dog|bird)s? [0-9]{1,2}\.",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    r"(ab|cb|db)*c",
    r"a{2,5}b?",
    r"(x|xy|xyz)(z|yz|)",
    r"[a-c]+(-[a-c]+)*",
]


def trim_and_minimal(delta: np.ndarray, accepting: np.ndarray) -> tuple[bool, bool, set]:
    S = len(accepting)
    succ = [{int(t) for t in delta[s] if t >= 0} for s in range(S)]
    reach, stack = {0}, [0]
    while stack:
        for t in succ[stack.pop()]:
            if t not in reach:
                reach.add(t)
                stack.append(t)
    coreach = {s for s in range(S) if accepting[s]}
    changed = True
    while changed:
        changed = False
        for s in range(S):
            if s not in coreach and succ[s] & coreach:
                coreach.add(s)
                changed = True
    trim = reach == set(range(S)) and coreach == set(range(S))
    # table filling with the rejecting sink as state S (distinguishable from every live state)
    D = delta.astype(np.int64)
    D = np.where(D < 0, S, D)
    D = np.vstack([D, np.full((1, 256), S)])
    acc = list(accepting) + [False]
    marked = {(a, b) for a in range(S + 1) for b in range(a + 1, S + 1) if acc[a] != acc[b] or b == S}
    changed = True
    while changed:
        changed = False
        for a, b in itertools.combinations(range(S + 1), 2):
            if (a, b) in marked:
                continue
            for c in range(256):
                x, y = sorted((int(D[a, c]), int(D[b, c])))
                if x != y and (x, y) in marked:
                    marked.add((a, b))
                    changed = True
                    break
    equivalent = {(a, b) for a, b in itertools.combinations(range(S), 2) if (a, b) not in marked}
    return trim, not equivalent, equivalent


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_is_trim_minimal_and_accepts_what_re_accepts(pattern):
    dfa = to_dfa(parse_regex(pattern))
    trim, minimal, equivalent = trim_and_minimal(dfa.delta, dfa.accepting)
    assert trim and minimal, equivalent
    rng = np.random.default_rng(0)
    alphabet = sorted(set(re.sub(r"[\\\[\](){}|*+?^$]", "", pattern)) | set("abcxyz0123456789.-eE+ "))
    strings = ["".join(rng.choice(alphabet, int(rng.integers(0, 9)))) for _ in range(3000)]
    # and strings the DFA accepts, from random walks
    for _ in range(300):
        s, out = 0, []
        while len(out) < 12 and not (dfa.accepting[s] and rng.random() < 0.3):
            nxt = np.flatnonzero(dfa.delta[s] >= 0)
            if not len(nxt):  # accepting, nothing may follow
                break
            b = int(rng.choice(nxt))
            out.append(b)
            s = int(dfa.delta[s, b])
        strings.append(bytes(out).decode("latin-1"))
    for text in strings:
        assert dfa.matches(text.encode("latin-1")) == bool(re.fullmatch(pattern, text)), text


@pytest.mark.parametrize("pattern, texts", [
    ("a{ 2}", ["a{ 2}", "aa"]), ("a{1_0}", ["a{1_0}", "a" * 10]), ("a{+3}", ["a{+3}", "aaa"]),  # literal text in re
    ("a{,3}", ["", "aaa", "aaaa"]), ("a{,}", ["", "aaaa"]), ("x{}", ["x{}", "x"]),
])
def test_repetition_counts_are_read_as_python_re_reads_them(pattern, texts):
    dfa = to_dfa(parse_regex(pattern))
    for text in texts:
        assert dfa.matches(text.encode()) == bool(re.fullmatch(pattern, text)), (pattern, text)


@pytest.mark.parametrize("pattern", [r"\x+f", r"\u+0041", r"\x0_1", r"\u{ 41}"])
def test_malformed_hex_escapes_are_errors(pattern):
    from jaxlm.inference.grammar.automaton import GrammarError

    with pytest.raises(GrammarError, match="invalid hexadecimal escape"):
        parse_regex(pattern)


@pytest.mark.parametrize("pattern", [r"x{2}{3}", r"a**", r"a+*", r"a?{2}", r"a???"])
def test_a_quantifier_after_a_quantifier_is_an_error_as_in_python_re(pattern):
    from jaxlm.inference.grammar.automaton import GrammarError

    with pytest.raises(re.error, match="multiple repeat"):
        re.compile(pattern)
    with pytest.raises(GrammarError, match="multiple repeat"):
        parse_regex(pattern)


@pytest.mark.parametrize("pattern, texts", [(r"a*?b", ["b", "aab"]), (r"a{2}{", ["aa{"]), (r"a{2}x{,2}", ["aax", "aa"])])
def test_lazy_quantifiers_and_literal_braces_still_parse(pattern, texts):
    dfa = to_dfa(parse_regex(pattern))
    for text in texts:
        assert dfa.matches(text.encode()) == bool(re.fullmatch(pattern, text)), (pattern, text)


def test_an_integer_enum_beyond_float_range_compiles():
    dfa = to_dfa(parse_json_schema({"type": "integer", "enum": [10**400, 3]}, any_whitespace=False))
    assert dfa.matches(str(10**400).encode()) and dfa.matches(b"3") and not dfa.matches(b"4")


def test_json_schema_dfa_is_trim_and_minimal():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a"]}
    dfa = to_dfa(parse_json_schema(schema, any_whitespace=False, max_depth=2))
    trim, minimal, equivalent = trim_and_minimal(dfa.delta, dfa.accepting)
    assert trim and minimal, equivalent


def _vocabulary(rng, n):
    return [None, None, b""] + [bytes([b]) for b in range(256)] + [
        rng.choice(np.frombuffer(b'abc{}":,0129 -.eE', np.uint8), int(rng.integers(1, 7))).tobytes()
        for _ in range(n)]


def test_token_tables_equal_a_token_by_token_walk_with_and_without_hash_collisions(monkeypatch):
    """Reference: each token's outcome from each state by walking its bytes through the DFA;
    tables must give exactly that, with categories that group equal outcome vectors only.
    Then again with degenerate hashes: the exact check must catch every merge of unequal
    outcomes."""
    rng = np.random.default_rng(1)
    vocab = _vocabulary(rng, 1500)
    dfa = to_dfa(parse_json_schema({"type": "object", "properties": {"k": {"type": "string"},
                                                                     "n": {"type": "number"}}},
                                   any_whitespace=False, max_depth=2))
    S = dfa.num_states
    want = np.full((S, len(vocab)), -1, np.int64)
    for t, b in enumerate(vocab):
        if t == 2 or not b:
            continue
        for s in range(S):
            want[s, t] = dfa.run(b, s)
    stop_col = np.where(dfa.accepting, S, -1)
    results = []
    # hashes: the real one; one key for all; the pair count as the key (only the pair-by-pair
    # check tells tokens with as many alive pairs apart); frequent collisions
    for mix in (None, lambda x: x * np.uint64(0), np.ones_like, lambda x: x & np.uint64(1)):
        if mix is not None:
            monkeypatch.setattr(T, "_mix64", mix)
        tables = T.build_tables(dfa, vocab, [2], chunk=400)
        got = tables.next[:S, tables.category].astype(np.int64)
        np.testing.assert_array_equal(got[:, 2], stop_col)
        got[:, 2] = -1
        np.testing.assert_array_equal(got, want)
        # categories are exactly the classes of equal outcome columns
        cols = {}
        for t in range(len(vocab)):
            cols.setdefault(tables.next[:, tables.category[t]].tobytes(), set()).add(int(tables.category[t]))
        assert all(len(c) == 1 for c in cols.values())
        assert len(cols) == tables.num_categories
        results.append((tables.next[:, tables.category], tables.bitmask))
    for other in results[1:]:
        np.testing.assert_array_equal(other[0], results[0][0])
        np.testing.assert_array_equal(other[1], results[0][1])


def test_group_outcomes_checks_the_pairs_not_the_hash(monkeypatch):
    token = np.array([0, 0, 1, 1, 2, 2, 3])
    start = np.array([0, 4, 0, 4, 0, 5, 1])
    state = np.array([3, 2, 3, 2, 3, 2, 0])
    rep, group = T._group_outcomes(5, token, start, state)  # token 4: no pair alive
    assert group[0] == group[1] and len({group[0], group[2], group[3], group[4]}) == 4
    assert sorted(rep[group].tolist()) == [0, 0, 2, 3, 4]
    monkeypatch.setattr(T, "_mix64", lambda x: x * np.uint64(0))
    assert T._group_outcomes(5, token, start, state) is None  # tokens 0 and 2 share a key, not pairs
    same = T._group_outcomes(2, np.array([0, 1]), np.array([7, 7]), np.array([1, 1]))
    assert same is not None and same[1].tolist() == [0, 0]
    # as many pairs each, one token's differ: only the pair-by-pair check can see it
    token, start, state = np.array([0, 0, 1, 1, 2, 2]), np.array([0, 4, 0, 4, 0, 5]), np.array([3, 2, 3, 2, 3, 2])
    assert T._group_outcomes(3, token, start, state) is None
    state = np.array([3, 2, 3, 2, 3, 1])
    assert T._group_outcomes(3, token, np.array([0, 4, 0, 4, 0, 4]), state) is None


def test_string_length_counts_a_surrogate_pair_as_one_character():
    """minLength / maxLength count code points after decoding (jsonschema): an escaped
    surrogate pair is one character; lone surrogate escapes are left out of length-bounded
    strings rather than counted either way."""
    import json

    import jsonschema

    texts = ['"\\ud83d\\ude00"', '"ab"', '"\\u00e9x"', '"\\n"', '"\\uD7FFa"', '"\\u0041\\ud83d\\ude00"']
    for lo, hi in ((0, 1), (2, 2), (1, 2)):
        schema = {"type": "string", "minLength": lo, "maxLength": hi}
        dfa = to_dfa(parse_json_schema(schema, any_whitespace=False))
        for text in texts:
            assert dfa.matches(text.encode()) == jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), \
                (schema, text)
        assert not dfa.matches(b'"\\ud83d"')  # a lone surrogate escape


@pytest.mark.parametrize("value, text", [(1.0, b"1"), (100.0, b"100"), (-0.0, b"-0"), ({"a": [1.0]}, b'{"a":[1]}'),
                                         ("\x7f", b'"\\u007f"'), ("\ud83d", b'"\\ud83d"'), (2.5, b"2.5"),
                                         (1e22, b"1e+22"), ("é", '"é"'.encode())])
def test_const_values_are_written_as_xgrammar_writes_them(value, text):
    """Whole-number floats as integers, DEL escaped (XGrammar's texts); a lone surrogate
    escaped (raw, it is not UTF-8); one string only."""
    dfa = to_dfa(parse_json_schema({"const": value}, any_whitespace=False))
    assert dfa.matches(text)
    assert not dfa.matches(text + b" ") and not dfa.matches(json.dumps(value).encode() + b"0")


@pytest.mark.parametrize("schema", ['{"const": 1e400}', '{"enum": [1, -1E999]}', '{"const": NaN}'])
def test_non_finite_constants_are_errors_not_infinity_literals(schema):
    from jaxlm.inference.grammar.automaton import GrammarError

    with pytest.raises(GrammarError, match="is not a JSON number"):
        parse_json_schema(schema)


def test_an_array_whose_items_are_false_is_only_the_empty_array():
    for schema in ({"type": "array", "items": False}, {"type": "array", "maxItems": 0, "items": False}):
        dfa = to_dfa(parse_json_schema(schema, any_whitespace=False))
        assert dfa.matches(b"[]") and not dfa.matches(b"[1]")
