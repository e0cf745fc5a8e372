"""Grammar-constrained decoding: token masks against XGrammar at every prefix (and regex masks
against llguidance), on-device generation that always validates, compile-time errors, the
table cache."""

import ctypes
import json
import platform
import re
import signal

import jsonschema
import llguidance as llg  # a second reference for regex masks (a [test] dependency)
import numpy as np
import pytest
import xgrammar as xgr  # the reference masks (a [test] dependency: a missing install fails loudly)

import jaxlm
from jaxlm.inference.grammar import GrammarError, compile_ebnf, compile_json_schema, compile_regex
from jaxlm.inference.grammar.tables import token_byte_strings

REGEXES = [
    r"[a-c]+\d{2}|x.y",
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]*( [A-Z][a-z]*){0,2}",
    r"\w+@\w+\.(com|org)",
    r"-?\d+(\.\d+)?([eE][+-]?\d+)?",
    r"[^\n]{1,5}\n",
    r"(ab|cd)*e?",
    r"[\u00e0-\u00ff]+ü",
    r"\s*\S+",
    r"(0x[0-9a-fA-F]{2} ?){1,3}",
    r"[αβγ]{2}|\u{1F600}",
]
OBJECT = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}}, "required": ["name", "age"]}
SCHEMAS = [
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "string"},
    {"type": "null"},
    {"enum": ["red", "green", 3, None, True]},
    {"const": "a\"b\\c\nd"},
    OBJECT,
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}},  # all optional
    {"type": "object", "properties": {"p": OBJECT, "tags": {"type": "array", "items": {"type": "string"}}},
     "required": ["p"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": OBJECT, "maxItems": 2},
    {"type": ["integer", "null"]},
    {"anyOf": [{"type": "number"}, {"type": "array", "items": {"type": "boolean"}}]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "[A-Z]{2}[0-9]{3}"}}, "required": ["id"]},
    {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "object", "properties": {
        "z": {"type": "array", "items": {"type": "number"}}}, "required": ["z"]}}, "required": ["y"]}},
     "required": ["x"]},
]
EBNF = [
    'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
    'root ::= "[" (item ("," item)*)? "]"\nitem ::= [a-z]+ # a word',
    'root ::= line+\nline ::= [a-z]+ "=" [0-9]+ "\\n"',
    'root ::= "\\"" ([^"\\\\] | "\\\\" ["\\\\n])* "\\""',
    'root ::= "a"{2,4} "b"{3}',
    'root ::= "héllo" | "日本" [0-9]?',
]
RECURSIVE_EBNF = {0}  # unrolled recursion: compared along strings within the depth (the cut: below)


def _valid_texts(kind, source):
    """Strings of each grammar's language (hand-written per family, unicode and escapes included)."""
    if kind == "regex":
        samples = {
            0: ["abc12", "xéy", "x\ny"], 1: ["555-0199"], 2: ["yes", "maybe"], 3: ["Ab Cd Ef", "Z"],
            4: ["me@host.org"], 5: ["-12.5e+3", "0"], 6: ["héllo\n"], 7: ["abcdab", "e", ""],
            8: ["àÿü"], 9: ["  x1", "\u3000é"], 10: ["0xA1 0xff", "0x00"], 11: ["αβ", "\U0001F600"],
        }
        return samples[REGEXES.index(source)]
    if kind == "ebnf":
        samples = {0: ["1+(2-30)", "(7)"], 1: ["[ab,c]", "[]"], 2: ["a=1\nbc=22\n"], 3: ['"x\\"y\\\\"'],
                   4: ["aaabbb"], 5: ["héllo", "日本7"]}
        return samples[EBNF.index(source)]
    schema = source
    values = {
        0: [-120, 0], 1: [1.5e-7, -0.0, 12], 2: [True], 3: ["héllo \"quoted\" \\ \u263a\n"], 4: [None],
        5: ["green", None], 6: ["a\"b\\c\nd"],
        7: [{"name": "Zoë", "age": 41, "score": -2.5, "ok": False}, {"name": "", "age": 0}],
        8: [{}, {"b": True}], 9: [{"p": {"name": "a", "age": 1}, "tags": ["x", "y"]}],
        10: [[1, 2, 3], [-4]], 11: [[], [{"name": "n", "age": 2, "ok": True}]], 12: [None, 7],
        13: [3.25, [True, False]], 14: [{"id": "AB123"}], 15: [{"x": {"y": {"z": [1.0, 2e5]}}}],
    }[SCHEMAS.index(schema)]
    out = []
    for v in values:
        out.append(json.dumps(v, ensure_ascii=False, separators=(", ", ": ")))
        out.append(json.dumps(v, ensure_ascii=False, indent=2))
    return out


def _byte_tokenizer_setup():
    tok = jaxlm.ByteTokenizer()
    vocab = [b"", b"", b""] + [bytes([b]) for b in range(256)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])
    return tok, info


def _tiny_bpe():
    """A tiny byte-level BPE trained here: the `tokenizers` object and jaxlm's wrapper of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlm.data.tokenizers import HFTokenizer

    corpus = [json.dumps(v, ensure_ascii=False) for v in
              [{"name": "Zoë", "age": 41}, [1, 2.5, -3e4], {"ok": True, "tags": ["a", "b"]}, "héllo wörld 日本",
               "yes no maybe 555-0199 me@host.org 0xA1"]] * 20
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    return tk, HFTokenizer(tk, eos_id=tk.token_to_id("<eos>"), pad_id=tk.token_to_id("<pad>"))


def _bpe_tokenizer_setup():
    """The tiny BPE read by XGrammar through transformers' wrapper (its own decoding of the
    byte-level alphabet) and by jaxlm through `token_byte_strings`."""
    from transformers import PreTrainedTokenizerFast

    tk, ours = _tiny_bpe()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")
    decoded = list(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=ours.vocab_size).decoded_vocab)
    for special in (ours.pad_id, ours.eos_id):  # XGrammar would read "<pad>" as text; specials write nothing
        decoded[special] = b""
    info = xgr.TokenizerInfo(decoded, xgr.VocabType.RAW, vocab_size=ours.vocab_size, stop_token_ids=[ours.eos_id])
    return ours, info


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def setup(request):
    tok, info = _byte_tokenizer_setup() if request.param == "bytes" else _bpe_tokenizer_setup()
    return tok, xgr.GrammarCompiler(info, cache_enabled=False)


def _theirs_allowed(matcher, V):
    bm = xgr.allocate_token_bitmask(1, V)
    matcher.fill_next_token_bitmask(bm)
    words = bm.numpy()[0]
    ids = np.arange(V)
    return ((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)


def _compile_pair(kind, source, tok, comp, any_whitespace=True):
    if kind == "regex":
        return compile_regex(source, tok, cache_dir=None), comp.compile_regex(source)
    if kind == "ebnf":
        return compile_ebnf(source, tok, max_depth=4, cache_dir=None), comp.compile_grammar(source)
    text = json.dumps(source)
    return (compile_json_schema(source, tok, any_whitespace=any_whitespace, cache_dir=None),
            comp.compile_json_schema(text, any_whitespace=any_whitespace))


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")  # the raw three-byte form of U+D800..U+DFFF


def _writes_a_surrogate(table, ids, token) -> bool:
    """``token`` after ``ids`` puts a surrogate's raw bytes in the text: not UTF-8, refused by
    our tables, accepted by XGrammar 0.2.9 (its one known difference here)."""
    tail = b"".join(table[i] or b"" for i in ids[-3:])
    return bool(_SURROGATE.search(tail[-2:] + (table[token] or b"")))


def _compare_along(ours, theirs, ids, V, table):
    """Masks equal at every prefix of ``ids`` (which must stay inside both languages), except
    where XGrammar allows a surrogate's raw bytes (not UTF-8) that ours refuses."""
    matcher = xgr.GrammarMatcher(theirs)
    state = ours.tables.start
    for k in range(len(ids) + 1):
        mine, ref = ours.tables.allowed(state), _theirs_allowed(matcher, V)
        if not np.array_equal(mine, ref):
            diff = [int(t) for t in np.flatnonzero(mine != ref)
                    if mine[t] or not _writes_a_surrogate(table, list(ids[:k]), int(t))][:8]
            if diff:
                return f"prefix {ids[:k]}: tokens {diff} ours {mine[diff].tolist()}"
        if k == len(ids):
            return None
        state = ours.tables.step(state, ids[k])
        assert state >= 0 and matcher.accept_token(ids[k]), f"token {ids[k]} after {ids[:k]} not accepted"
    return None


def _distances(t):
    """Fewest tokens from each state to acceptance (BFS backwards over the tables)."""
    succ = t.next[:, t.category]  # [S, V]
    dist = np.where(t.accepting, 0, np.iinfo(np.int32).max).astype(np.int64)
    while True:
        via = np.where(succ >= 0, dist[np.where(succ >= 0, succ, 0)] + 1, np.iinfo(np.int32).max).min(axis=1)
        new = np.minimum(dist, via)
        if np.array_equal(new, dist):
            return dist
        dist = new


def _random_walk(ours, rng, V, steps=30, stop_bias=0.3, finish_bias=0.0):
    """Token ids chosen uniformly among the allowed ones from our tables (a stop token with
    probability ``stop_bias`` where one is allowed; with probability ``finish_bias`` a token
    that brings the output closest to complete)."""
    t = ours.tables
    dist = _distances(t) if finish_bias else None
    state, ids = t.start, []
    for _ in range(steps):
        allowed = np.flatnonzero(t.allowed(state))
        stops = [s for s in t.stop_tokens if s in set(allowed)]
        if stops and rng.random() < stop_bias:
            break
        choices = [a for a in allowed if a not in t.stop_tokens]
        if not choices:
            break
        if dist is not None and rng.random() < finish_bias:
            d = np.array([dist[t.step(state, a)] for a in choices])
            choices = [a for a, x in zip(choices, d) if x == d.min()]
        ids.append(int(rng.choice(choices)))
        state = t.step(state, ids[-1])
    return ids


GRAMMARS = ([("regex", r) for r in REGEXES] + [("json", s) for s in SCHEMAS] + [("ebnf", e) for e in EBNF])


@pytest.mark.parametrize("kind, source", GRAMMARS, ids=[f"{k}{i}" for i, (k, _) in enumerate(GRAMMARS)])
def test_masks_equal_xgrammar_at_every_prefix(kind, source, setup):
    """Bit-for-bit the allowed-token set of XGrammar's matcher, along valid strings of the
    language and along random walks through our tables (which XGrammar must accept too)."""
    tok, comp = setup
    V = tok.vocab_size
    table = token_byte_strings(tok)
    for ws in ((True, False) if kind == "json" else (True,)):
        ours, theirs = _compile_pair(kind, source, tok, comp, any_whitespace=ws)
        texts = _valid_texts(kind, source)
        if kind == "json" and not ws:
            texts = [t for t in texts if "\n  " not in t]  # the indented variants need whitespace
        for text in texts:
            assert ours.matches(text), text
            problem = _compare_along(ours, theirs, tok.encode(text), V, table)
            assert problem is None, f"{kind} {source!r} (any_whitespace={ws}) on {text!r}: {problem}"
        if kind == "ebnf" and EBNF.index(source) in RECURSIVE_EBNF:
            continue  # a walk can nest deeper than the unrolled depth; the cut is tested below
        rng = np.random.default_rng(0)
        for _ in range(4):
            ids = _random_walk(ours, rng, V)
            problem = _compare_along(ours, theirs, ids, V, table)
            assert problem is None, f"{kind} {source!r} (any_whitespace={ws}), random walk: {problem}"


# ECMAScript's WhiteSpace and LineTerminator code points (ECMA-262 §12.2, §12.3): what \s means
# in jaxlm's dialect (and XGrammar's); written out for llguidance, whose \s is Unicode White_Space
JS_SPACE = "\\t\\n\\x0b\\x0c\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"


def _llguidance_dialect(pattern: str) -> str:
    """The same language in llguidance's (Rust) regex syntax: its \\d and \\w are Unicode
    classes, its \\s is Unicode White_Space and its ``.`` stops at a newline, while jaxlm
    (like XGrammar) reads \\d, \\w as ASCII, \\s as JavaScript's set and ``.`` as any code point."""
    out, i = [], 0
    classes = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]",
               "s": f"[{JS_SPACE}]", "S": f"[^{JS_SPACE}]"}
    in_brackets = False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1]
            out.append(classes[nxt] if nxt in classes and not in_brackets else pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_brackets:
            in_brackets = True
        elif c == "]" and in_brackets:
            in_brackets = False
        out.append("(?s:.)" if c == "." and not in_brackets else c)
        i += 1
    return "".join(out)


class _ByteVocab:
    """jaxlm's byte tokenizer as llguidance reads a tokenizer: specials marked by a 0xFF byte."""

    def __init__(self, tok):
        self.eos_token_id, self.bos_token_id = tok.eos_id, None
        self.special_token_ids = [0, 1, 2]
        self.tokens = [b"\xff[pad]", b"\xff[bos]", b"\xff[eos]"] + [bytes([b]) for b in range(256)]

    def __call__(self, data: bytes) -> list[int]:
        return [b + 3 for b in data]


@pytest.fixture(scope="module")
def llguidance_setup():
    """The byte tokenizer only: on a BPE vocabulary llguidance allows just the canonical
    tokenization of each string (after "y", the token "es" but not "e" when "yes" tokenizes
    as y|es), while jaxlm, like XGrammar, allows every tokenization of an allowed string."""
    tok = jaxlm.ByteTokenizer()
    assert tok.vocab_size == 259 and tok.eos_id == 2 and tok.encode("a") == [ord("a") + 3]
    return tok, llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tok)), slices=[])


def _llguidance_allowed(matcher, V):
    words = np.frombuffer(matcher.compute_bitmask(), np.uint32)
    ids = np.arange(V)
    return ((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_masks_equal_llguidance_at_every_prefix(pattern, llguidance_setup):
    """A second, independent implementation: llguidance's matcher on the same language (the
    pattern rewritten into its dialect) allows exactly our tokens along the valid strings and
    along random walks through our tables."""
    tok, lltok = llguidance_setup
    V = tok.vocab_size
    ours = compile_regex(pattern, tok, cache_dir=None)
    grammar = llg.LLMatcher.grammar_from_regex(_llguidance_dialect(pattern))
    rng = np.random.default_rng(0)
    walks = [tok.encode(t) for t in _valid_texts("regex", pattern)] + [_random_walk(ours, rng, V) for _ in range(4)]
    for ids in walks:
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        state = ours.tables.start
        for k in range(len(ids) + 1):
            mine, ref = ours.tables.allowed(state), _llguidance_allowed(matcher, V)
            diff = np.flatnonzero(mine != ref)[:8]
            assert not diff.size, f"{pattern!r} after {tok.decode(ids[:k])!r}: tokens {diff.tolist()} ours {mine[diff]}"
            if k < len(ids):
                state = ours.tables.step(state, ids[k])
                assert matcher.consume_token(ids[k]), (pattern, ids[:k + 1])


def test_json_outputs_of_walks_validate():
    """Every complete string our tables allow for a schema parses and validates."""
    tok = jaxlm.ByteTokenizer()
    rng = np.random.default_rng(1)
    for schema in SCHEMAS:
        g = compile_json_schema(schema, tok, cache_dir=None)
        complete = 0
        for _ in range(40):
            ids = _random_walk(g, rng, tok.vocab_size, steps=400, stop_bias=0.5, finish_bias=0.3)
            state = g.tables.start
            for t in ids:
                state = g.tables.step(state, t)
            if g.tables.accepting[state]:
                jsonschema.validate(json.loads(tok.decode(ids)), schema)
                complete += 1
        assert complete > 0, schema


def test_recursion_is_cut_at_the_unrolled_depth():
    tok = jaxlm.ByteTokenizer()
    g = compile_ebnf(EBNF[0], tok, max_depth=2, cache_dir=None)
    assert g.matches("((1))") and not g.matches("(((1)))")
    state = g.tables.start
    for t in tok.encode("(("):
        state = g.tables.step(state, t)
    assert not g.tables.allowed(state)[tok.encode("(")[0]]  # one level deeper is masked
    assert g.tables.allowed(state)[tok.encode("7")[0]]
    anything = compile_json_schema({}, tok, max_depth=2, cache_dir=None)
    assert anything.matches('[{"a": 1}]') and anything.matches("[[1]]") and not anything.matches("[[[1]]]")


def test_token_byte_strings_of_a_byte_level_bpe_equal_what_decoding_gives():
    tok, _ = _bpe_tokenizer_setup()
    strings = token_byte_strings(tok)
    assert strings[tok.eos_id] is None and strings[tok.pad_id] is None
    text = 'héllo {"name": "Zoë"} 日本'
    ids = tok.encode(text)
    assert b"".join(strings[i] for i in ids).decode("utf-8") == text
    assert sum(1 for s in strings if s is not None and len(s) > 1) > 50  # merges really are multi-byte


def test_token_byte_strings_of_a_sentencepiece_style_vocabulary():
    """``▁`` stands for a space and ``<0xNN>`` tokens are single bytes (byte fallback), as in
    Llama-style tokenizer.json files; the tables then follow the byte string the ids spell."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxlm.data.tokenizers import HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁helowrd":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("▁hel", "l"), ("▁hell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok = HFTokenizer(tk, bos_id=1, eos_id=2)
    strings = token_byte_strings(tok)
    assert strings[:3] == [None, None, None] and strings[3 + 0xC3] == b"\xc3" and strings[vocab["▁hello"]] == b" hello"
    ids = tok.encode("hello world é日")
    assert b"".join(strings[i] for i in ids) == " hello world é日".encode()  # Metaspace prefixes a space
    g = compile_regex(r" hello( [a-zé日]+)+", tok, cache_dir=None)
    state = g.tables.start
    for i in ids:
        state = g.tables.step(state, i)
        assert state >= 0
    assert g.tables.accepting[state] and g.tables.allowed(state)[tok.eos_id]


@pytest.fixture(scope="module")
def random_model():
    return jaxlm.build_model(jaxlm.ModelConfig.tiny(init_std=0.5, max_seq_len=160), tokenizer=jaxlm.ByteTokenizer(),
                             seed=0)


def test_generation_from_an_adversarial_model_always_validates(random_model):
    """Random weights at temperature 2: unconstrained output is never JSON; constrained,
    every finished row parses and validates, and rows that ran out of tokens are prefixes."""
    tok = random_model.tokenizer
    schemas = [OBJECT, SCHEMAS[9], SCHEMAS[11], SCHEMAS[13]]
    grammars = [compile_json_schema(s, tok, cache_dir=None) for s in schemas]
    rows = [grammars[i % len(grammars)] for i in range(8)]
    out = jaxlm.generate(random_model, ["Answer in JSON:"] * 8, max_new_tokens=120, temperature=2.0, rng=0,
                         grammar=rows)
    plain = jaxlm.generate(random_model, ["Answer in JSON:"] * 8, max_new_tokens=40, temperature=2.0, rng=0)
    finished = 0
    for i, (ids, n) in enumerate(zip(out.completions(), np.asarray(out.lengths))):
        g = rows[i]
        state = g.tables.start
        for t in ids:
            state = g.tables.step(state, t)
            assert state >= 0, (i, ids)
        if ids and ids[-1] == tok.eos_id or g.tables.accepting[state]:
            text = tok.decode(ids)
            jsonschema.validate(json.loads(text), schemas[i % len(schemas)])
            finished += 1
    assert finished >= 4

    def valid(text, schema):
        try:
            jsonschema.validate(json.loads(text), schema)
            return True
        except (ValueError, jsonschema.ValidationError):
            return False

    assert not any(valid(text, schemas[i % len(schemas)]) for i, text in enumerate(plain.texts))


def test_greedy_constrained_equals_the_masked_argmax_of_full_forwards(random_model):
    """Reference: a cache-free forward per step, the grammar's mask from the host tables,
    argmax; and a stop token only where the grammar accepts."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    tok = random_model.tokenizer
    g = compile_regex(r"(cat|dog|bird)s? [0-9]{1,2}\.", tok, cache_dir=None)
    prompts = ["Pet: ", "x"]
    out = jaxlm.generate(random_model, prompts, max_new_tokens=12, temperature=0, grammar=g)
    graphdef, weights = nnx.split(random_model)
    # one compiled full forward at a fixed length: causal, so the padding after the sequence
    # does not change the logits at its last position
    full_forward = jax.jit(lambda w, ids: nnx.merge(graphdef, w)(ids).logits[0])
    for b, prompt in enumerate(prompts):
        seq = tok.encode(prompt, add_bos=True)
        state, expected = g.tables.start, []
        for _ in range(12):
            padded = np.zeros((1, 32), np.int32)
            padded[0, :len(seq)] = seq
            logits = np.asarray(full_forward(weights, jnp.asarray(padded))[len(seq) - 1])
            masked = np.where(g.tables.allowed(state), logits, -np.inf)
            t = int(masked.argmax())
            expected.append(t)
            seq.append(t)
            state = g.tables.step(state, t)
            if t == tok.eos_id or g.tables.finished == state:
                break
            if set(np.flatnonzero(g.tables.allowed(state))) <= set(g.tables.stop_tokens):
                break  # complete: the row stops without a stop token
        assert out.completions()[b] == expected
        assert g.matches(tok.decode(expected))


def test_per_row_grammars_and_free_rows(random_model):
    tok = random_model.tokenizer
    yes_no = compile_regex(r"(yes|no)", tok, cache_dir=None)
    digits = compile_regex(r"[0-9]{3}", tok, cache_dir=None, stop_tokens=())
    out = jaxlm.generate(random_model, ["a", "b", "c"], max_new_tokens=8, temperature=1.0, rng=2,
                         grammar=[yes_no, digits, None])
    a, b, c = out.texts
    assert a in ("yes", "no")
    assert len(b) == 3 and b.isdigit() and int(out.lengths[1]) == 3  # complete: the row stops, no EOS needed
    assert int(out.lengths[2]) == 8
    with pytest.raises(ValueError, match="grammar= has 2 entries for 3 prompts"):
        jaxlm.generate(random_model, ["a", "b", "c"], max_new_tokens=2, grammar=[yes_no, None])


def test_a_model_vocabulary_padded_past_the_tokenizers_never_samples_the_padding():
    tok = jaxlm.ByteTokenizer()
    model = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=320, init_std=0.5, max_seq_len=64), tokenizer=tok,
                              seed=1)
    g = compile_regex(r"[a-z]{4}", tok, cache_dir=None)
    out = jaxlm.generate(model, ["x"] * 4, max_new_tokens=6, temperature=3.0, rng=0, grammar=g)
    assert all(len(t) == 4 and t.isalpha() for t in out.texts)
    small = jaxlm.build_model(jaxlm.ModelConfig.tiny(vocab_size=200, max_seq_len=64), seed=1)
    with pytest.raises(GrammarError, match="vocabulary of 259 tokens; the model has vocab_size=200"):
        jaxlm.generate(small, [[5, 6]], max_new_tokens=2, grammar=g)


@pytest.mark.parametrize("make, match", [
    (lambda t: compile_regex(r"(a)\1", t), "backreference"),
    (lambda t: compile_regex(r"a(?=b)", t), "lookahead"),
    (lambda t: compile_regex(r"a\bb", t), "anchor"),
    (lambda t: compile_regex(r"[^\s\S]", t), "can never be completed"),
    (lambda t: compile_regex(r"a{3,2}", t), "invalid repetition"),
    (lambda t: compile_json_schema({"type": "string", "format": "date"}, t), "'format' is not supported"),
    (lambda t: compile_json_schema({"type": "integer", "minimum": 0}, t), "'minimum' is not supported"),
    (lambda t: compile_json_schema({"type": "object", "additionalProperties": True}, t), "additionalProperties"),
    (lambda t: compile_json_schema({"oneOf": [{"type": "null"}]}, t), "'oneOf' without 'type'"),
    (lambda t: compile_json_schema({"type": "tuple"}, t), "type 'tuple'"),
    (lambda t: compile_json_schema({"type": "string", "minLength": 3, "maxLength": 2}, t), "can never be completed"),
    # a pattern whose matches all need escapes (a newline): named, not "no string matches it"
    (lambda t: compile_json_schema({"type": "string", "pattern": "a\\nb"}, t),
     "'pattern' .* matches only strings holding a quote"),
    (lambda t: compile_json_schema({"type": "object", "properties": {}, "required": ["a"]}, t), "'a' is not in"),
    (lambda t: compile_ebnf('root ::= "a" missing', t), "'missing' is used but not defined"),
    (lambda t: compile_ebnf('start ::= "a"', t), "no 'root' rule"),
    (lambda t: compile_ebnf('root ::= "a" (="b")', t), "lookahead"),
    (lambda t: compile_ebnf('root ::= "a\nb"', t), "line 1 column 10: unterminated string"),
    (lambda t: compile_ebnf('root ::= "a" root', t, max_depth=3), "can never be completed"),
    # an unused rule is checked too (XGrammar: 'Rule "missing" is not defined')
    (lambda t: compile_ebnf('root ::= "a"\nunused ::= "b" missing', t), "'missing' is used but not defined"),
])
def test_compile_time_errors_name_the_construct(make, match):
    with pytest.raises(GrammarError, match=match):
        make(jaxlm.ByteTokenizer())


def test_grammar_stops_where_generate_stops_and_needs_compiling(random_model):
    """Without stop_tokens a grammar allows every end id `generate` stops at by default (an
    extra end id such as Llama 3's <|eot_id|> was blocked everywhere), and a raw pattern or
    schema passed as grammar= is named (it failed with "'str' object has no attribute")."""

    class TwoEnds(jaxlm.ByteTokenizer):
        stop_ids = (2, 1)  # EOS, then another end id its checkpoint lists

    tok = TwoEnds()
    tables = compile_regex("[0-9]+", tok, cache_dir=None).tables
    assert set(tables.stop_tokens) == {1, 2} == set(jaxlm.inference.sampler.default_stop_tokens(tok))
    for raw in ("[0-9]+", {"type": "integer"}):
        with pytest.raises(TypeError, match=rf"grammar\[0\] is a {type(raw).__name__}, not a compiled grammar"):
            jaxlm.generate(random_model, ["x"], max_new_tokens=2, grammar=raw)


def test_surrogates_have_no_utf8_form_in_any_grammar():
    """U+D800..U+DFFF are not UTF-8: their raw three-byte forms were accepted by ``.``, negated
    classes and JSON strings (a maxLength-2 string came out as 6 replacement characters, which
    jsonschema rejects); the code points around them still are."""
    tok = jaxlm.ByteTokenizer()
    raw = "\ud800".encode("utf-8", "surrogatepass")  # b"\xed\xa0\x80"
    for g in (compile_regex(".", tok, cache_dir=None), compile_regex("[^a]", tok, cache_dir=None)):
        assert not g.matches(raw) and not g.matches("\udfff".encode("utf-8", "surrogatepass"))
        for ok in ("\ud7ff", "\ue000", "\U0010ffff", "é"):
            assert g.matches(ok), ok
    s = compile_json_schema({"type": "string", "maxLength": 2}, tok, cache_dir=None)
    assert not s.matches(b'"' + raw + b'"') and s.matches('"\ud7ff\ue000"')
    assert s.matches('"\\ud83d\\ude00"')  # an escaped surrogate pair is one character, still allowed


def test_a_stop_token_the_grammar_reads_as_text_is_refused(random_model):
    """generate's stop token " " inside a grammar of space-separated words: rows stopped at
    the first space, reported finished, their text outside the grammar (16 of 16). A stop
    token the grammar allows only where it is complete is fine."""
    tok = jaxlm.ByteTokenizer()
    words = compile_regex("[a-z]{1,3}( [a-z]{1,3}){3}", tok, cache_dir=None)
    space = tok.encode(" ")[0]
    with pytest.raises(ValueError, match=rf"stop_tokens holds {space}, which grammar\[1\] allows as text"):
        jaxlm.generate(random_model, ["x", "y"], max_new_tokens=4, grammar=[None, words], stop_tokens=[space])
    line = compile_regex("[a-z]+\n?", tok, cache_dir=None)  # "\n" only where the text is complete
    newline = tok.encode("\n")[0]
    out = jaxlm.generate(random_model, ["x"], max_new_tokens=4, grammar=line, stop_tokens=[newline, tok.eos_id])
    assert out.texts[0].rstrip("\n").isalpha()


def test_tables_are_cached_by_grammar_and_tokenizer(tmp_path):
    tok = jaxlm.ByteTokenizer()
    first = compile_json_schema(OBJECT, tok, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    again = compile_json_schema(OBJECT, tok, cache_dir=tmp_path)
    for name in ("category", "next", "accepting", "bitmask"):
        np.testing.assert_array_equal(getattr(first.tables, name), getattr(again.tables, name))
    compile_json_schema(OBJECT, tok, cache_dir=tmp_path, stop_tokens=())  # other settings: another entry
    assert len(list(tmp_path.glob("*.npz"))) == 2
    files[0].write_bytes(b"damaged")
    rebuilt = compile_json_schema(OBJECT, tok, cache_dir=tmp_path)
    np.testing.assert_array_equal(rebuilt.tables.next, first.tables.next)


def test_bitmask_and_category_paths_give_the_same_mask():
    import jax.numpy as jnp

    from jaxlm.inference.grammar.decoding import allowed_tokens, merge_tables

    tok = jaxlm.ByteTokenizer()
    g = compile_json_schema(OBJECT, tok, cache_dir=None)
    with_bits, starts = merge_tables([g, None], tok.vocab_size, bitmask_limit=1 << 30)
    without, _ = merge_tables([g, None], tok.vocab_size, bitmask_limit=0)
    assert with_bits.bitmask is not None and without.bitmask is None
    states = jnp.arange(g.tables.num_states, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(with_bits, states)),
                                  np.asarray(allowed_tokens(without, states)))
    np.testing.assert_array_equal(np.asarray(allowed_tokens(without, states)),
                                  np.stack([g.tables.allowed(s) for s in range(g.tables.num_states)]))
    assert np.asarray(allowed_tokens(without, jnp.asarray(starts[1:]))).all()  # the free row


@pytest.mark.skipif(platform.system() != "Linux", reason="reads the handler with glibc's sigaction and dladdr")
def test_crash_handling_is_not_left_to_libtvm_ffi():
    """xgrammar's runtime installs a SIGSEGV handler that can deadlock (a fault in the unwinder
    hangs the process); the suite puts the default handling back after collecting this module."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    libc = ctypes.CDLL(None)
    action = ctypes.create_string_buffer(256)  # struct sigaction; its handler is the first field
    assert libc.sigaction(signal.SIGSEGV, None, action) == 0
    handler = ctypes.c_void_p.from_buffer(action).value
    if handler in (None, 0):  # SIG_DFL
        return
    info = DlInfo()
    assert libc.dladdr(ctypes.c_void_p(handler), ctypes.byref(info)) != 0
    assert b"tvm_ffi" not in (info.fname or b""), info.fname


@pytest.mark.slow  # trains a tiny model for 1000 steps (about 4 minutes on 2 cores); the exactness tests above run by default
def test_schema_constrained_extraction_is_always_valid_and_no_less_accurate(tmp_path):
    """The claim in miniature, as `bench/grammar.py --miniature` measures it (in its own
    process with XLA's default optimisation: this suite compiles at level 0): a small
    trained model's sampled JSON is not always schema-valid; constrained by the schema it
    always is (greedy too), and its accuracy is not lower."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "grammar.py"
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    proc = subprocess.run([sys.executable, str(bench), "--no-grid", "--miniature", "--run", str(tmp_path / "run"),
                           "--json", str(tmp_path / "result.json")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    result = json.loads((tmp_path / "result.json").read_text())["miniature"]
    assert result["sampled unconstrained"]["valid"] < 1.0
    for decoding in ("greedy", "sampled"):
        free, constrained = result[f"{decoding} unconstrained"], result[f"{decoding} constrained"]
        assert constrained["valid"] == 1.0
        assert constrained["accuracy"] >= free["accuracy"]


@pytest.mark.parametrize("V", [1, 31, 32, 33, 259, 1000])
def test_pack_bits_layout(V):
    """Token ``j`` sits at bit ``j % 32`` of int32 word ``j // 32`` (XGrammar's layout), word by
    word from the definition; padding bits are 0."""
    from jaxlm.inference.grammar.tables import pack_bits

    allowed = np.random.default_rng(V).random((3, V)) < 0.4
    got = pack_bits(allowed)
    assert got.dtype == np.int32 and got.shape == (3, -(-V // 32))
    for r in range(3):
        for w in range(got.shape[1]):
            word = sum(1 << b for b in range(32) if 32 * w + b < V and allowed[r, 32 * w + b])
            assert int(got[r, w]) & 0xFFFFFFFF == word


@pytest.mark.parametrize("pattern, text", [
    ("a.b", '"a"b"'), ("a.b", '"a\nb"'), ("a.b", '"a\x01b"'), ("[^x]{1,3}", '"""'), ("[^x]{1,3}", '"\\"'),
    ("a.b", '"a\u00e9b"'), ("[^x]{1,3}", '"ab"'),
])
def test_a_string_pattern_stays_inside_the_json_string(pattern, text):
    """A pattern's `.` or negated class written between the quotes never admits a raw quote,
    backslash or control character: the language is XGrammar's and every string parses."""
    from xgrammar.testing import _is_grammar_accept_string

    from jaxlm.inference.grammar.automaton import to_dfa
    from jaxlm.inference.grammar.json_schema import parse_json_schema

    schema = {"type": "string", "pattern": pattern}
    ours = to_dfa(parse_json_schema(schema)).matches(text.encode())
    assert ours == _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)
    if ours:
        jsonschema.validate(json.loads(text), schema)


def test_enum_beside_type_keeps_the_values_of_that_type():
    from jaxlm.inference.grammar.automaton import to_dfa
    from jaxlm.inference.grammar.json_schema import parse_json_schema

    dfa = to_dfa(parse_json_schema({"type": "string", "enum": ["a", 1, None]}))
    assert [dfa.matches(t.encode()) for t in ('"a"', "1", "null")] == [True, False, False]
    assert to_dfa(parse_json_schema({"type": ["integer", "null"], "enum": [1.0, 2.5, None, "x"]})).matches(b"null")
    with pytest.raises(GrammarError, match="no 'enum' value has type 'boolean'"):
        parse_json_schema({"type": "boolean", "enum": ["a", 1]})


def test_tokens_into_loops_the_vocabulary_cannot_leave_are_cut():
    """A state with tokens but no token path to acceptance is dead at the token level: ``a*b``
    over the tokens {a} cannot be written at all; ``a+b|c`` over {a, c} allows only c (an "a"
    would loop until the token limit)."""
    with pytest.raises(GrammarError, match="cannot write any string of the grammar"):
        compile_regex("a*b", token_bytes=[None, b"a"], stop_tokens=(0,), cache_dir=None)
    g = compile_regex("a+b|c", token_bytes=[None, b"a", b"c"], stop_tokens=(0,), cache_dir=None)
    assert np.flatnonzero(g.tables.allowed(g.tables.start)).tolist() == [2]


def test_a_grammar_whose_only_string_is_empty_generates_nothing(random_model):
    """The start state is complete and no token is allowed: the row is done before any draw
    (it used to sample from an all-masked row, id 0, until the token limit)."""
    tok = random_model.tokenizer
    g = compile_regex("a{0}", tok, stop_tokens=(), cache_dir=None)
    out = jaxlm.generate(random_model, ["hi"], max_new_tokens=4, grammar=g, stop_tokens=(), rng=0)
    assert out.completions() == [[]]


def test_an_object_schema_without_properties_takes_any_object():
    """``{"type": "object"}`` (no properties, no additionalProperties) is any object in JSON
    Schema and in XGrammar, nested free objects too; within the depth cut the language is
    jsonschema's."""
    tok = jaxlm.ByteTokenizer()
    schema = {"type": "object", "properties": {"meta": {"type": "object"}}, "required": ["meta"]}
    g = compile_json_schema(schema, tok, cache_dir=None)
    texts = ['{"meta": {}}', '{"meta": {"source": "web", "n": [1, 2.5], "ok": true, "x": null}}',
             '{"meta": {"a": {"b": "c"}}}', '{"meta": []}', '{"meta": {"a": 1,}}', '{}', '{"meta": 1}']
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        assert g.matches(text) == valid, text
    assert compile_json_schema({"type": "object"}, tok, cache_dir=None).matches('{"k": [1, {"m": "n"}]}')
