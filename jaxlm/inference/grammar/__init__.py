"""Grammar-constrained decoding with the grammar compiled ahead of time into token tables
(Gram2Token, ICML 2026): at decode time masking and the state update are table lookups
inside the compiled decoding loop, with no host round trip per token.

    from jaxlm.inference.grammar import compile_json_schema
    g = compile_json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                             "required": ["name"]}, tokenizer)
    jaxlm.generate(model, prompts, max_new_tokens=64, grammar=g)

Front ends: `compile_regex`, `compile_json_schema`, `compile_ebnf`. Each lowers the grammar
to a byte automaton (`automaton`), then to token tables for the tokenizer (`tables`); see
those modules for the construction and `jaxlm.inference.grammar.decoding` for the mask and
state update in the sampler, and `mask_backend` for the Pallas mask kernel.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

from jaxlm.inference.grammar.automaton import ByteDFA, GrammarError, to_dfa
from jaxlm.inference.grammar.decoding import MASK_BACKEND
from jaxlm.inference.grammar.ebnf import parse_ebnf
from jaxlm.inference.grammar.json_schema import parse_json_schema
from jaxlm.inference.grammar.regex import parse_regex
from jaxlm.inference.grammar.tables import (
    BITMASK_LIMIT,
    TokenTables,
    cached_tables,
    default_cache_dir,
    token_byte_strings,
)

__all__ = ["CompiledGrammar", "GrammarError", "compile_regex", "compile_json_schema", "compile_ebnf",
           "token_byte_strings", "mask_backend", "set_mask_backend"]

#: ``with mask_backend("interpret"): jaxlm.generate(..., grammar=g)``: the mask as the Pallas
#: kernel (``kernel``, or ``interpret`` on CPU), or the jnp path (``reference``, ``auto``)
mask_backend = MASK_BACKEND.use
set_mask_backend = MASK_BACKEND.set


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for one tokenizer: its byte automaton, its token tables, and what
    it was compiled from (``kind``, ``source``). ``compile_seconds`` includes the table build
    (or the cache read)."""

    kind: str
    source: str
    dfa: ByteDFA
    tables: TokenTables
    compile_seconds: float

    @property
    def vocab_size(self) -> int:
        return self.tables.vocab_size

    def matches(self, text: str | bytes) -> bool:
        """Whether a whole output is in the grammar's language."""
        return self.dfa.matches(text.encode("utf-8") if isinstance(text, str) else text)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "states": self.tables.num_states, "categories": self.tables.num_categories,
                "vocab_size": self.vocab_size, "bytes": sum(self.tables.nbytes().values()),
                "bitmask": self.tables.bitmask is not None, "compile_seconds": self.compile_seconds}


def _compile(kind: str, source: str, expr, tokenizer, *, token_bytes, stop_tokens, cache_dir, max_states,
             bitmask_limit) -> CompiledGrammar:
    start = time.perf_counter()
    if token_bytes is None:
        if tokenizer is None:
            raise GrammarError("pass a tokenizer (or token_bytes=) to compile a grammar for")
        token_bytes = token_byte_strings(tokenizer)
    if stop_tokens is None:  # as `generate`'s default: every end id the checkpoint lists, else EOS
        ids = getattr(tokenizer, "stop_ids", None)
        eos = getattr(tokenizer, "eos_id", None)
        stop_tokens = tuple(int(i) for i in ids) if ids is not None else (() if eos is None else (int(eos),))
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    dfa = to_dfa(expr, max_states=max_states)
    tables = cached_tables(dfa, list(token_bytes), list(stop_tokens), cache_dir=cache_dir,
                           bitmask_limit=bitmask_limit)
    return CompiledGrammar(kind=kind, source=source, dfa=dfa, tables=tables,
                           compile_seconds=time.perf_counter() - start)


_COMMON = """
    tokenizer: a `ByteTokenizer` or `HFTokenizer` (or pass ``token_bytes``, each id's bytes or
    None). ``stop_tokens``: allowed only where the grammar accepts (default: the tokenizer's
    ``stop_ids``, EOS and any other end id its checkpoint lists, as `generate` stops at).
    ``cache_dir``: where tables are cached by (grammar, tokenizer) hash; "default" is
    ``$JAXLM_CACHE_DIR/grammar`` (``~/.cache/jaxlm/grammar``), None disables it.
    ``max_states`` bounds the automaton; ``bitmask_limit`` the materialised bitmask's bytes."""


def compile_regex(pattern: str, tokenizer=None, *, token_bytes: Sequence[bytes | None] | None = None,
                  stop_tokens: Sequence[int] | None = None, cache_dir: str | os.PathLike | None = "default",
                  max_states: int = 200_000, bitmask_limit: int = BITMASK_LIMIT) -> CompiledGrammar:
    return _compile("regex", pattern, parse_regex(pattern), tokenizer, token_bytes=token_bytes,
                    stop_tokens=stop_tokens, cache_dir=cache_dir, max_states=max_states, bitmask_limit=bitmask_limit)


def compile_json_schema(schema: dict | str, tokenizer=None, *, any_whitespace: bool = True, max_depth: int = 4,
                        token_bytes: Sequence[bytes | None] | None = None, stop_tokens: Sequence[int] | None = None,
                        cache_dir: str | os.PathLike | None = "default", max_states: int = 200_000,
                        bitmask_limit: int = BITMASK_LIMIT) -> CompiledGrammar:
    import json

    source = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=False)
    expr = parse_json_schema(schema, any_whitespace=any_whitespace, max_depth=max_depth)
    return _compile("json_schema", source, expr, tokenizer, token_bytes=token_bytes, stop_tokens=stop_tokens,
                    cache_dir=cache_dir, max_states=max_states, bitmask_limit=bitmask_limit)


def compile_ebnf(grammar: str, tokenizer=None, *, max_depth: int = 4,
                 token_bytes: Sequence[bytes | None] | None = None, stop_tokens: Sequence[int] | None = None,
                 cache_dir: str | os.PathLike | None = "default", max_states: int = 200_000,
                 bitmask_limit: int = BITMASK_LIMIT) -> CompiledGrammar:
    return _compile("ebnf", grammar, parse_ebnf(grammar, max_depth=max_depth), tokenizer, token_bytes=token_bytes,
                    stop_tokens=stop_tokens, cache_dir=cache_dir, max_states=max_states, bitmask_limit=bitmask_limit)


compile_regex.__doc__ = ("A regular expression (`jaxlm.inference.grammar.regex` for the subset) compiled to "
                         "token tables." + _COMMON)
compile_json_schema.__doc__ = ("A JSON Schema (`jaxlm.inference.grammar.json_schema` for the subset; "
                               "``any_whitespace`` and ``max_depth`` as there) compiled to token tables." + _COMMON)
compile_ebnf.__doc__ = ("An EBNF grammar (`jaxlm.inference.grammar.ebnf` for the subset; recursion unrolled "
                        "``max_depth`` deep) compiled to token tables." + _COMMON)
