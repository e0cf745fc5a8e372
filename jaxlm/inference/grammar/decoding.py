"""Grammar tables on the device and the per-step mask and state update (Gram2Token's runtime).

Each row's grammar state is an int32 in the decode loop's carry. Per step:

    allowed = bit(bitmask[state], token)          # or next[state][:, category] >= 0
    logits  = where(allowed, logits, -inf)        # before temperature / top-k / top-p
    state   = next[state, category[token]]

With the bitmask, the mask can instead run as a Pallas kernel that unpacks the bits in-kernel
(`kernels_pallas.grammar_mask`), chosen by `MASK_BACKEND` (``jaxlm.inference.grammar.
mask_backend("kernel" | "interpret" | "reference")``). Its ``auto`` mode runs the jnp path on
every platform: the compiled kernel is not yet measured against it on hardware.

Several grammars (one per row) are merged into one table set: their states are stacked and
the joint category of a token is the tuple of its categories in each grammar, so a row's
lookups are exactly its own grammar's. A row given no grammar sits in a free state that
allows every token and never changes. A row stops when its state is terminal: accepting
with nothing but a stop token allowed, or after a stop token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxlm.inference.grammar.automaton import GrammarError
from jaxlm.inference.grammar.tables import TokenTables, pack_bits
from jaxlm.kernel_backend import KernelBackend
from kernels_pallas import grammar_mask

MASK_BACKEND = KernelBackend("grammar mask backend", auto_kernel_on=())

SHAPE_BUCKET = 64


@struct.dataclass
class DeviceGrammar:
    """Merged token tables as device arrays (a pytree: the decode loop takes it as data)."""

    category: jax.Array  # [V] int32
    next: jax.Array  # [S, C] int32, -1: not allowed
    terminal: jax.Array  # [S] bool: the row is complete here
    bitmask: jax.Array | None = None  # [S, ceil(V / 32)] int32


def allowed_tokens(g: DeviceGrammar, state: jax.Array) -> jax.Array:
    """``[B, V]`` bool: the tokens each row's grammar allows in ``state [B]``."""
    if g.bitmask is not None:
        # unpack by shifting each word through its 32 bits: elementwise work, no gather over V
        return grammar_mask.unpack_words(jnp.take(g.bitmask, state, axis=0), g.category.shape[0])
    return jnp.take(jnp.take(g.next, state, axis=0), g.category, axis=1) >= 0


def mask_logits(g: DeviceGrammar, state: jax.Array, logits: jax.Array) -> jax.Array:
    """``logits [B, V]`` with the tokens ``state [B]`` does not allow set to ``-inf``."""
    mode = MASK_BACKEND.resolved()
    if g.bitmask is not None and mode != "reference":
        words = jnp.take(g.bitmask, state, axis=0)
        return grammar_mask.masked_logits(logits, words, interpret=mode == "interpret")
    return jnp.where(allowed_tokens(g, state), logits, jnp.asarray(-jnp.inf, logits.dtype))


def advance(g: DeviceGrammar, state: jax.Array, token: jax.Array) -> jax.Array:
    """The state after ``token [B]`` (rows that are done keep theirs)."""
    return g.next[state, g.category[token]]


def _one(x, i: int = 0):
    if isinstance(x, TokenTables) or x is None:
        return x
    if not isinstance(getattr(x, "tables", None), TokenTables):  # a raw pattern / schema dict / grammar text
        raise TypeError(f"grammar[{i}] is a {type(x).__name__}, not a compiled grammar: compile it first with "
                        "jaxlm.compile_regex / compile_json_schema / compile_ebnf (or pass None for no grammar)")
    return x.tables


def check_stop_tokens(grammars: Sequence, stop_tokens: Sequence[int]) -> None:
    """A decode stop token that a row's grammar allows as ordinary text before it is complete
    would end that row outside the grammar's language (a space stopping a sentence grammar
    mid-word): refused, naming the token and the grammar's own stop tokens."""
    seen = set()
    for i, g in enumerate(grammars):
        t = _one(g, i)
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        for tok in stop_tokens:
            if tok in t.stop_tokens or not 0 <= tok < t.category.shape[0]:
                continue
            col = t.next[:, t.category[tok]]
            if np.any((col >= 0) & ~t.accepting):
                raise ValueError(
                    f"stop_tokens holds {tok}, which grammar[{i}] allows as text before its output is complete "
                    f"(its stop tokens are {list(t.stop_tokens)}): a row would stop outside the grammar; compile the "
                    "grammar with this stop token (stop_tokens=) or leave it out of generate's stop_tokens")


_MERGED: "OrderedDict[tuple, tuple]" = OrderedDict()  # recent merges: (key) -> (tables kept alive, result)
_MERGED_SIZE = 16


def merge_tables(grammars: Sequence, vocab_size: int, bitmask_limit: int) -> tuple[DeviceGrammar, np.ndarray]:
    """`DeviceGrammar` of the rows' grammars (`CompiledGrammar`, `TokenTables` or None) and
    each row's start state. The merged device tables of the last few grammar sets are kept,
    so repeated calls with the same grammars do no host work beyond the start states."""
    tables = [_one(g, i) for i, g in enumerate(grammars)]
    order: list[TokenTables] = []
    for t in tables:
        if t is not None and all(t is not u for u in order):
            order.append(t)
    if not order:
        raise GrammarError("grammar= holds no grammar")
    has_free = any(t is None for t in tables)
    key = (tuple(id(t) for t in order), has_free, vocab_size, bitmask_limit)
    if key in _MERGED:
        _MERGED.move_to_end(key)
        _, (device, offsets, free) = _MERGED[key]
    else:
        device, offsets, free = _merge(order, has_free, vocab_size, bitmask_limit)
        _MERGED[key] = (order, (device, offsets, free))
        while len(_MERGED) > _MERGED_SIZE:
            _MERGED.popitem(last=False)
    place = {id(t): i for i, t in enumerate(order)}
    starts = np.array([free if t is None else offsets[place[id(t)]] + t.start for t in tables], np.int32)
    return device, starts


def _merge(order: list[TokenTables], has_free: bool, vocab_size: int, bitmask_limit: int):
    unique: list[TokenTables] = []
    for t in order:
        if t.vocab_size > vocab_size:
            raise GrammarError(f"a grammar was compiled for a vocabulary of {t.vocab_size} tokens; the model "
                               f"has vocab_size={vocab_size}")
        if t.vocab_size < vocab_size:  # the model's padded ids past the tokenizer's are never allowed
            never = t.num_categories
            t = TokenTables(category=np.pad(t.category, (0, vocab_size - t.vocab_size), constant_values=never),
                            next=np.pad(t.next, ((0, 0), (0, 1)), constant_values=-1), accepting=t.accepting,
                            bitmask=None, stop_tokens=t.stop_tokens, start=t.start)
        unique.append(t)
    joint = np.stack([t.category for t in unique], axis=1)  # [V, n]
    _, rep, category = np.unique(joint, axis=0, return_index=True, return_inverse=True)
    category = category.reshape(-1).astype(np.int32)
    blocks, terminal, offsets = [], [], []
    offset = 0
    for t in unique:
        nxt = t.next[:, t.category[rep]]  # [S_i, C]
        blocks.append(np.where(nxt >= 0, nxt + offset, -1))
        only_stop = ~np.any(np.delete(nxt, [category[s] for s in t.stop_tokens], axis=1) >= 0, axis=1) \
            if t.stop_tokens else ~np.any(nxt >= 0, axis=1)
        terminal.append(t.accepting & only_stop)
        offsets.append(offset)
        offset += t.num_states
    free = None
    if has_free:
        free = offset
        blocks.append(np.full((1, len(rep)), free, np.int32))
        terminal.append(np.zeros(1, bool))
        offset += 1
    nxt = np.concatenate(blocks).astype(np.int32)
    terminal = np.concatenate(terminal)
    # pad states and categories to multiples of SHAPE_BUCKET: grammars of similar size reuse
    # one compiled decode loop (padded states are unreachable, padded categories unused)
    S, C = nxt.shape
    S2, C2 = -(-S // SHAPE_BUCKET) * SHAPE_BUCKET, -(-C // SHAPE_BUCKET) * SHAPE_BUCKET
    nxt = np.pad(nxt, ((0, S2 - S), (0, C2 - C)), constant_values=-1)
    terminal = np.pad(terminal, (0, S2 - S))
    bitmask = None
    if S2 * (-(-vocab_size // 32)) * 4 <= bitmask_limit:
        bitmask = pack_bits(nxt[:, category] >= 0)
    device = DeviceGrammar(category=jnp.asarray(category), next=jnp.asarray(nxt),
                           terminal=jnp.asarray(terminal),
                           bitmask=None if bitmask is None else jnp.asarray(bitmask))
    return device, offsets, free
