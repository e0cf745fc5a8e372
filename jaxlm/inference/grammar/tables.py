"""Token-level tables of a byte automaton (Gram2Token's offline stage).

For every automaton state ``s`` and token ``t`` (its byte string) the outcome
``o(s, t)`` is the state after feeding ``t``'s bytes, or a rejection. Tokens whose outcome
vectors over all states are equal form one **category**; the tables are

* ``category [V] int32``: each token's category;
* ``next [S, C] int32``: the state after a category's token (-1: not allowed);
* ``accepting [S] bool``: a stop token (EOS) is allowed exactly here;
* ``bitmask [S, ceil(V / 32)] int32`` (optional): the allowed tokens per state as bits,
  token ``j`` at bit ``j % 32`` of word ``j // 32`` (XGrammar's and vLLM's layout).

Stop tokens form their own category (allowed in accepting states, leading to a finished
state); special tokens without bytes are never allowed. States from which the vocabulary
cannot continue (its tokens lack the bytes needed) are cut at the token level too. Since the automaton keeps only states
that can still reach acceptance and every token is checked byte by byte, a token is allowed
exactly when the output stays a prefix of some string in the grammar's language.

The bitmask is materialised when it is at most ``bitmask_limit`` bytes (default 16 MiB):
decoding then reads ``V / 32`` words per row instead of gathering ``C`` validity bits through
``category``; both give the same mask. Tables are cached on disk by a hash of the grammar's
automaton and the tokenizer's byte strings (`compile_tables(..., cache_dir=)`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order

from jaxlm.inference.grammar.automaton import ByteDFA, GrammarError

BITMASK_LIMIT = 16 << 20


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100..."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def token_byte_strings(tokenizer) -> list[bytes | None]:
    """Each token id's UTF-8 bytes (None: a special token that never appears in text).

    `ByteTokenizer`: one byte per id past the specials. `HFTokenizer`: byte-level BPE (GPT-2
    alphabet) or SentencePiece-style (``▁`` for a space, ``<0xNN>`` byte fallback); added
    special tokens are None."""
    if hasattr(tokenizer, "offset") and getattr(tokenizer, "vocab_size", None) == 256 + tokenizer.offset:
        return [None] * tokenizer.offset + [bytes([b]) for b in range(256)]
    inner = getattr(tokenizer, "_tok", None)
    if inner is None:
        raise GrammarError(f"cannot read token byte strings from {type(tokenizer).__name__}: pass a ByteTokenizer, "
                           "an HFTokenizer or token_bytes=")
    spec = json.loads(inner.to_str())
    decoder = json.dumps(spec.get("decoder") or {})
    byte_level = '"ByteLevel"' in decoder
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    specials = {t.content for t in inner.get_added_tokens_decoder().values() if t.special}
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        piece = inner.id_to_token(i)
        if piece is None or piece in specials:
            out.append(None)
            continue
        if byte_level:
            try:
                out.append(bytes(inverse[c] for c in piece))
            except KeyError:
                out.append(piece.encode("utf-8"))  # an added non-special token written as text
            continue
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
            continue
        out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


@dataclasses.dataclass(frozen=True)
class TokenTables:
    """The compiled grammar for one tokenizer (module docstring). ``finished`` is the state a
    stop token leads to (accepting, nothing else allowed)."""

    category: np.ndarray  # [V] int32
    next: np.ndarray  # [S, C] int32
    accepting: np.ndarray  # [S] bool
    bitmask: np.ndarray | None  # [S, ceil(V/32)] int32
    stop_tokens: tuple[int, ...]
    start: int = 0

    @property
    def num_states(self) -> int:
        return self.next.shape[0]

    @property
    def num_categories(self) -> int:
        return self.next.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.category.shape[0]

    @property
    def finished(self) -> int:
        return self.num_states - 1

    def nbytes(self) -> dict[str, int]:
        out = {"category": self.category.nbytes, "next": self.next.nbytes, "accepting": self.accepting.nbytes}
        if self.bitmask is not None:
            out["bitmask"] = self.bitmask.nbytes
        return out

    def allowed(self, state: int) -> np.ndarray:
        """``[V]`` bool: the tokens allowed in ``state``."""
        return self.next[state][self.category] >= 0

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` (-1 if it is not allowed)."""
        return int(self.next[state, self.category[token]])

    def packed(self, state: int) -> np.ndarray:
        """``allowed(state)`` as int32 words (bit ``j % 32`` of word ``j // 32``)."""
        return pack_bits(self.allowed(state)[None])[0]


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """``[N, V]`` bool -> ``[N, ceil(V / 32)]`` int32, token ``j`` at bit ``j % 32`` of word
    ``j // 32``."""
    N, V = allowed.shape
    W = -(-V // 32)
    padded = np.zeros((N, W * 32), bool)
    padded[:, :V] = allowed
    # little-endian bit order within bytes and bytes within words: bit j % 32 of word j // 32
    packed = np.packbits(padded, axis=1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32).view(np.int32).reshape(N, W)


def _alive_pairs(class_delta: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (token, state) pairs still alive after each class sequence ``classes [R, n]``, with
    ``class_delta [S, n_classes]`` the DFA on byte classes: ``(token, start state, end state)``
    arrays, sorted by token and then start state. Only pairs alive after the first byte are
    built (most die there), and each byte drops the pairs it rejects."""
    R = classes.shape[0]
    by_class, from_state = np.nonzero(class_delta.T >= 0)  # sorted by class, then state
    ptr = np.searchsorted(by_class, np.arange(class_delta.shape[1] + 1))
    first = classes[:, 0].astype(np.int64)
    counts = ptr[first + 1] - ptr[first]
    token = np.repeat(np.arange(R), counts)
    within = np.arange(len(token)) - np.repeat(np.cumsum(counts) - counts, counts)
    start = from_state[np.repeat(ptr[first], counts) + within]
    state = class_delta[start, classes[token, 0]]
    for k in range(1, classes.shape[1]):
        state = class_delta[state, classes[token, k]]
        keep = state >= 0
        token, start, state = token[keep], start[keep], state[keep]
    return token, start, state


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _group_outcomes(R: int, token: np.ndarray, start: np.ndarray, state: np.ndarray):
    """Tokens ``0..R-1`` grouped by equal outcome (the same alive pairs, `_alive_pairs`):
    ``(representative token of each group, each token's group)``, or None when two tokens
    with different outcomes share a hash (the caller then compares whole outcome columns).
    Each token's key is a sum of 64-bit hashes of its (start, end) pairs; the grouping is
    then checked exactly, pair by pair, against each group's representative."""
    count = np.bincount(token, minlength=R)
    offset = np.cumsum(count) - count
    with np.errstate(over="ignore"):
        pair_hash = _mix64((start.astype(np.uint64) << np.uint64(32)) ^ state.astype(np.uint64))
        key = np.zeros(R, np.uint64)
        some = count > 0
        if some.any():
            key[some] = np.add.reduceat(pair_hash, offset[some])
    _, rep, group = np.unique(key, return_index=True, return_inverse=True)
    group = group.reshape(-1)
    rep_of = rep[group]
    if not np.array_equal(count, count[rep_of]):
        return None
    at_rep = offset[rep_of[token]] + (np.arange(len(token)) - offset[token])
    if not (np.array_equal(start, start[at_rep]) and np.array_equal(state, state[at_rep])):
        return None
    return rep, group


def _outcome_columns(S: int, R: int, reps: np.ndarray, token: np.ndarray, start: np.ndarray, state: np.ndarray):
    """``[len(reps), S + 1]`` outcome columns of the tokens ``reps`` among ``0..R-1`` (-1:
    rejected; the last entry, the finished state, always -1)."""
    row = np.full(R, -1, np.int64)
    row[reps] = np.arange(len(reps))
    cols = np.full((len(reps), S + 1), -1, np.int32)
    mine = row[token] >= 0
    cols[row[token[mine]], start[mine]] = state[mine]
    return cols


def build_tables(dfa: ByteDFA, token_bytes: Sequence[bytes | None], stop_tokens: Sequence[int], *,
                 bitmask_limit: int = BITMASK_LIMIT, chunk: int = 4096) -> TokenTables:
    """`TokenTables` of ``dfa`` for a vocabulary of ``token_bytes`` (module docstring)."""
    V = len(token_bytes)
    stop = sorted({int(t) for t in stop_tokens})
    bad = [t for t in stop if not 0 <= t < V]
    if bad:
        raise GrammarError(f"stop token ids {bad} are outside the vocabulary [0, {V})")
    S = dfa.num_states
    finished = S  # one extra state after a stop token
    category = np.zeros(V, np.int32)
    columns: list[np.ndarray] = []
    seen: dict[bytes, int] = {}

    def assign(col: np.ndarray) -> int:
        key = col.tobytes()
        if key not in seen:
            seen[key] = len(columns)
            columns.append(col)
        return seen[key]

    never = np.full(S + 1, -1, np.int32)
    stop_col = np.where(np.append(dfa.accepting, False), finished, -1).astype(np.int32)
    lengths = np.array([len(t) if t else 0 for t in token_bytes], np.int64).reshape(V)
    special = np.zeros(V, bool)
    special[stop] = True
    for i in np.flatnonzero(special | (lengths == 0)):  # stop tokens; tokens that write nothing
        category[i] = assign(stop_col if special[i] else never)
    regular = ~special & (lengths > 0)
    # Bytes no state tells apart (equal columns of delta) form classes; tokens with the same
    # sequence of classes have the same outcome everywhere, so only one of each is run.
    _, first, byte_class = np.unique(dfa.delta.T, axis=0, return_index=True, return_inverse=True)
    byte_class = byte_class.reshape(-1).astype(np.uint8 if len(first) <= 256 else np.int32)
    class_delta = np.ascontiguousarray(dfa.delta[:, first])  # [S, n_classes]: a byte of each class
    for n in np.unique(lengths[regular]).tolist():
        ids = np.flatnonzero(regular & (lengths == n))
        data = np.frombuffer(b"".join([token_bytes[i] for i in ids.tolist()]), np.uint8).reshape(len(ids), n)
        classes = np.ascontiguousarray(byte_class[data])
        keys = classes.view(np.dtype((np.void, classes.shape[1] * classes.itemsize))).ravel()
        _, rep, inverse = np.unique(keys, return_index=True, return_inverse=True)
        unique_cat = np.empty(len(rep), np.int32)
        for lo in range(0, len(rep), chunk):
            seqs = classes[rep[lo: lo + chunk]]
            pairs = _alive_pairs(class_delta, seqs)
            # equal outcome columns share a category: each distinct column is built once
            grouped = _group_outcomes(len(seqs), *pairs)
            if grouped is None:  # a hash collision: compare whole columns
                cols = _outcome_columns(S, len(seqs), np.arange(len(seqs)), *pairs)
                keys = cols.view(np.dtype((np.void, cols.shape[1] * cols.itemsize))).ravel()
                _, col_rep, col_inverse = np.unique(keys, return_index=True, return_inverse=True)
                cols = cols[col_rep]
            else:
                col_rep, col_inverse = grouped
                cols = _outcome_columns(S, len(seqs), col_rep, *pairs)
            cats = np.array([assign(c) for c in cols], np.int32)
            unique_cat[lo: lo + len(seqs)] = cats[col_inverse.reshape(-1)]
        category[ids] = unique_cat[inverse.reshape(-1)]
    nxt = np.stack(columns, axis=1).astype(np.int32)  # [S + 1, C]
    accepting = np.append(dfa.accepting, True)
    # a state from which no sequence of tokens reaches acceptance is a dead end at the token
    # level (the vocabulary lacks bytes it needs, also behind a loop): cut the transitions into it
    live = _live_states(nxt, accepting)
    nxt = np.where((nxt >= 0) & ~live[np.where(nxt >= 0, nxt, 0)], -1, nxt)
    if not live[0]:
        raise GrammarError("this tokenizer cannot write any string of the grammar (its tokens lack the bytes "
                           "the grammar needs)")
    bitmask = None
    if (S + 1) * (-(-V // 32)) * 4 <= bitmask_limit:
        bitmask = pack_bits(nxt[:, category] >= 0)
    return TokenTables(category=category, next=nxt, accepting=accepting, bitmask=bitmask, stop_tokens=tuple(stop))


def _live_states(nxt: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """``[S]`` True where some path of transitions in ``nxt [S, C]`` (-1: none) reaches an
    accepting state: a breadth-first search backwards from them, linear in the transitions."""
    n = nxt.shape[0]
    src, cat = np.nonzero(nxt >= 0)
    dst = nxt[src, cat]
    finals = np.flatnonzero(accepting)
    rows = np.concatenate([dst, np.full(len(finals), n)])  # reversed edges; node n points to every final
    cols = np.concatenate([src, finals])
    graph = csr_matrix((np.ones(len(rows), np.int8), (rows, cols)), shape=(n + 1, n + 1))
    live = np.zeros(n + 1, bool)
    live[breadth_first_order(graph, n, directed=True, return_predecessors=False)] = True
    return live[:n]


def tables_key(dfa: ByteDFA, token_bytes: Sequence[bytes | None], stop_tokens: Sequence[int],
               bitmask_limit: int) -> str:
    h = hashlib.sha256()
    h.update(b"jaxlm-grammar-tables-v2")  # v2: transitions into token-level dead loops cut
    h.update(np.ascontiguousarray(dfa.delta).tobytes())
    h.update(np.ascontiguousarray(dfa.accepting).tobytes())
    for t in token_bytes:
        h.update(b"\xff" if t is None else len(t).to_bytes(4, "little") + t)
    h.update(repr((sorted(stop_tokens), bitmask_limit)).encode())
    return h.hexdigest()[:32]


def default_cache_dir() -> Path:
    root = os.environ.get("JAXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxlm")
    return Path(root) / "grammar"


def cached_tables(dfa: ByteDFA, token_bytes: Sequence[bytes | None], stop_tokens: Sequence[int], *,
                  cache_dir: str | os.PathLike | None, bitmask_limit: int = BITMASK_LIMIT) -> TokenTables:
    """`build_tables`, read from / written to ``cache_dir`` (None: no cache)."""
    if cache_dir is None:
        return build_tables(dfa, token_bytes, stop_tokens, bitmask_limit=bitmask_limit)
    path = Path(cache_dir) / f"{tables_key(dfa, token_bytes, stop_tokens, bitmask_limit)}.npz"
    if path.exists():
        try:
            with np.load(path) as z:
                return TokenTables(category=z["category"], next=z["next"], accepting=z["accepting"],
                                   bitmask=z["bitmask"] if "bitmask" in z else None,
                                   stop_tokens=tuple(int(t) for t in z["stop_tokens"]))
        except (OSError, KeyError, ValueError):
            pass  # a damaged cache entry is rebuilt
    tables = build_tables(dfa, token_bytes, stop_tokens, bitmask_limit=bitmask_limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = dict(category=tables.category, next=tables.next, accepting=tables.accepting,
                  stop_tokens=np.asarray(tables.stop_tokens, np.int64))
    if tables.bitmask is not None:
        arrays["bitmask"] = tables.bitmask
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return tables
