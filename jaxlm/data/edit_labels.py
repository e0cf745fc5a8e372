"""Edit labels for edit-based refinement of a diffusion LM (ME-DLM, Ren et al., arXiv
2605.09603): training targets for a current-token head and a next-token head, and one
round of edits that applies their predictions.

The model reads the noisy response ``n`` (after a prompt, followed by a trailing
end-of-sequence token). At response position ``i`` the current-token head says what token
``i`` becomes: itself (keep), another token (replace) or ``del_id`` (delete). The
next-token head at model position ``i - 1`` says which token to insert in gap ``i``, the gap
right before token ``i``; predicting the token that will stand at ``i`` anyway means
"insert nothing". Gap ``N`` is the gap before the trailing end-of-sequence token, so there
"insert nothing" is ``eos_id``.

Labels come from the canonical Levenshtein alignment of ``n`` to the clean response ``m``:
unit-cost DP, backtrace from ``(N, M)`` preferring KEEP > REPLACE > DELETE > INSERT. Each
gap gets at most one insertion per round (the first clean token inserted there). An
insertion ``x`` into the gap before a token that becomes ``x`` reads as "insert nothing";
the reference moves it one gap to the right (see `edit_labels`, ``swap_rule``).

    tokens, nexts = edit_labels([1, 2, 3], [1, 2, 2, 3], del_id=90, eos_id=99)
    # tokens = [1, 2, 3], nexts = [1, 2, 2, 99]
    apply_edits([1, 2, 3], tokens, nexts, del_id=90, eos_id=99)  # [1, 2, 2, 3]
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

KEEP, REPLACE, DELETE, INSERT = "keep", "replace", "delete", "insert"
SWAP_RULES = ("reference", "safe")


class EditOp(NamedTuple):
    """One step of an alignment of a noisy sequence to a clean one.

    ``noisy_pos`` is the noisy token's index for keep/replace/delete and, for insert, the
    gap: the index of the noisy token the inserted token goes before (``N`` = at the end).
    ``clean_pos`` is the clean token's index (``None`` for delete).
    """

    kind: str
    noisy_pos: int
    clean_pos: int | None


def _as_ids(values, name: str, *, allow: int | None = None) -> np.ndarray:
    """``values`` as a 1-D int64 array of non-negative ids (``allow`` also accepted)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) if allow is None else ((arr < 0) & (arr != allow))
    if bad.any():
        extra = "" if allow is None else f" (or {allow})"
        raise ValueError(f"{name} must hold non-negative token ids{extra}, got {arr[bad][0]} "
                         f"at index {int(np.flatnonzero(bad)[0])}")
    return arr


def _as_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _check_special_ids(del_id, eos_id, ignore_id) -> tuple[int, int, int]:
    del_id, eos_id = _as_int(del_id, "del_id"), _as_int(eos_id, "eos_id")
    ignore_id = _as_int(ignore_id, "ignore_id")
    for name, value in (("del_id", del_id), ("eos_id", eos_id)):
        if value < 0:
            raise ValueError(f"{name} must be a non-negative token id, got {value}")
    if del_id == eos_id:
        raise ValueError(f"del_id and eos_id must differ, both are {del_id}")
    if ignore_id >= 0:
        raise ValueError(f"ignore_id must be negative so it cannot be a token id, got {ignore_id}")
    return del_id, eos_id, ignore_id


def _distance_table(noisy: np.ndarray, clean: np.ndarray) -> np.ndarray:
    """``table[i, j]`` = unit-cost edit distance from ``noisy[:i]`` to ``clean[:j]``.

    Row by row: ``best[j] = min(table[i-1, j-1] + (noisy[i-1] != clean[j-1]),
    table[i-1, j] + 1)``, then the insert term ``table[i, j] = min_k best[k] + (j - k)``
    is a running minimum of ``best - j``.
    """
    n, m = len(noisy), len(clean)
    table = np.empty((n + 1, m + 1), dtype=np.int32)
    cols = np.arange(m + 1, dtype=np.int32)
    table[0] = cols
    for i in range(1, n + 1):
        prev = table[i - 1]
        best = np.empty(m + 1, dtype=np.int32)
        best[0] = i
        best[1:] = np.minimum(prev[:-1] + (clean != noisy[i - 1]), prev[1:] + 1)
        table[i] = np.minimum.accumulate(best - cols) + cols
    return table


def edit_distance(noisy, clean) -> int:
    """Unit-cost Levenshtein distance between two token sequences."""
    return int(_distance_table(_as_ids(noisy, "noisy"), _as_ids(clean, "clean"))[-1, -1])


def levenshtein_alignment(noisy, clean) -> list[EditOp]:
    """The canonical minimum-edit alignment of ``noisy`` to ``clean``, in sequence order.

    Unit costs; the backtrace from ``(N, M)`` takes the first applicable of KEEP (equal
    tokens on an optimal diagonal), REPLACE, DELETE, INSERT, which fixes one alignment among
    the optimal ones (repeated insertions end up left of matched tokens). The number of
    non-keep ops is the Levenshtein distance.
    """
    noisy, clean = _as_ids(noisy, "noisy"), _as_ids(clean, "clean")
    table = _distance_table(noisy, clean)
    ops: list[EditOp] = []
    i, j = len(noisy), len(clean)
    while i > 0 or j > 0:
        here = table[i, j]
        if i > 0 and j > 0 and noisy[i - 1] == clean[j - 1] and here == table[i - 1, j - 1]:
            ops.append(EditOp(KEEP, i - 1, j - 1))
            i, j = i - 1, j - 1
        elif i > 0 and j > 0 and here == table[i - 1, j - 1] + 1:
            ops.append(EditOp(REPLACE, i - 1, j - 1))
            i, j = i - 1, j - 1
        elif i > 0 and here == table[i - 1, j] + 1:
            ops.append(EditOp(DELETE, i - 1, None))
            i -= 1
        else:
            ops.append(EditOp(INSERT, i, j - 1))
            j -= 1
    ops.reverse()
    return ops


def edit_labels(noisy, clean, *, del_id: int, eos_id: int, pred_clean_token: bool = True,
                ignore_id: int = -100, swap_rule: str = "reference") -> tuple[np.ndarray, np.ndarray]:
    """Targets of both heads for one noisy response against its clean response.

    Returns ``(token_target [N], next_target [N + 1])``, int64:

    - ``token_target[i]``: the clean token for a replaced token, ``del_id`` for a deleted
      one, and for a kept one the token itself (``pred_clean_token=True``, how ME-DLM
      trains) or ``ignore_id``.
    - ``next_target[g]`` for gap ``g`` (before noisy token ``g``; gap ``N`` is after the
      last one): the first clean token the alignment inserts there. A gap without one gets
      "insert nothing", the target of the first non-deleted token from ``g`` on (``eos_id``
      if none) -- except when token ``g - 1`` is deleted, then ``ignore_id``; gap ``N``
      without an insertion is always ``eos_id``.

    Model alignment (as in ME-DLM's trainer, with the prompt of length ``P >= 1`` before the
    response and the trailing end-of-sequence token after it, see `position_labels`): the
    current-token head at model position ``P + i`` learns ``token_target[i]`` and the
    next-token head at model position ``P - 1 + g`` learns ``next_target[g]``. So gap 0 is
    predicted at the last prompt token and gap ``N`` at the last response token, whose next
    token is the trailing end-of-sequence token.

    ``swap_rule`` resolves an insertion ``x`` into gap ``g`` when token ``g`` becomes ``x``
    (indistinguishable from "insert nothing"):

    - ``"reference"`` (ME-DLM's ``compute_labels_cpp``): for ``g = 1 .. N-1`` left to right,
      if ``next_target[g]`` is an insertion equal to ``token_target[g]``, swap
      ``next_target[g]`` and ``next_target[g + 1]`` (the gaps before and after token ``g``),
      so an insertion slides right along a run of equal tokens. Gap 0 is never checked, the
      swap also moves whatever gap ``g + 1`` held into gap ``g`` (reordering two insertions),
      and with ``pred_clean_token=False`` kept tokens (target ``ignore_id``) never match.
      Then gaps are filled as above.
    - ``"safe"``: for ``g = 0 .. N-1``, compare against the token that token ``g`` becomes,
      and move the insertion to gap ``g + 1`` only when that gap holds no insertion (and
      token ``g + 1`` is not deleted); otherwise leave it, a no-op this round. Identical to
      ``"reference"`` whenever the reference only moves into empty gaps from gaps >= 1. With
      it every round applies part of an optimal edit script, so repeating label-and-apply
      reaches ``clean`` in at most ``levenshtein(noisy, clean)`` rounds.
    """
    noisy, clean = _as_ids(noisy, "noisy"), _as_ids(clean, "clean")
    del_id, eos_id, ignore_id = _check_special_ids(del_id, eos_id, ignore_id)
    if swap_rule not in SWAP_RULES:
        raise ValueError(f"swap_rule must be one of {SWAP_RULES}, got {swap_rule!r}")
    if (clean == del_id).any():
        raise ValueError(f"clean contains del_id {del_id} at index {int(np.flatnonzero(clean == del_id)[0])}")
    if (clean == eos_id).any():  # "insert eos" reads as "insert nothing": the edits would never reach it
        raise ValueError(f"clean contains eos_id {eos_id} at index {int(np.flatnonzero(clean == eos_id)[0])}: "
                         "strip the end-of-sequence token from the clean response")

    n = len(noisy)
    token_target = noisy.copy() if pred_clean_token else np.full(n, ignore_id, dtype=np.int64)
    becomes = noisy.copy()  # the token each position holds after this round; del_id if deleted
    next_target = np.full(n + 1, ignore_id, dtype=np.int64)  # first insertion per gap
    for op in levenshtein_alignment(noisy, clean):
        if op.kind == REPLACE:
            token_target[op.noisy_pos] = becomes[op.noisy_pos] = clean[op.clean_pos]
        elif op.kind == DELETE:
            token_target[op.noisy_pos] = becomes[op.noisy_pos] = del_id
        elif op.kind == INSERT and next_target[op.noisy_pos] == ignore_id:
            next_target[op.noisy_pos] = clean[op.clean_pos]

    if swap_rule == "reference":
        for g in range(1, n):
            if next_target[g] != ignore_id and next_target[g] == token_target[g]:
                next_target[g], next_target[g + 1] = next_target[g + 1], next_target[g]
    else:
        for g in range(n):
            if (next_target[g] != ignore_id and next_target[g] == becomes[g]
                    and next_target[g + 1] == ignore_id and (g + 1 == n or becomes[g + 1] != del_id)):
                next_target[g + 1], next_target[g] = next_target[g], ignore_id

    # "Insert nothing": the target of the next surviving token, filled right to left.
    following = eos_id
    fill = np.empty(n, dtype=np.int64)
    for g in range(n - 1, -1, -1):
        if token_target[g] != del_id:
            following = token_target[g]
        fill[g] = following
    for g in range(n):
        if next_target[g] == ignore_id and (g == 0 or token_target[g - 1] != del_id):
            next_target[g] = fill[g]
    if next_target[n] == ignore_id:
        next_target[n] = eos_id
    return token_target, next_target


def apply_edits(noisy, cur, nxt, *, del_id: int, eos_id: int, max_len: int | None = None,
                ignore_id: int = -100) -> list[int]:
    """One round of edits from current-token ``cur [N]`` and gap ``nxt [N + 1]`` tokens.

    As ME-DLM's inference loop, on the response alone (the trailing end-of-sequence token
    is implied and stays):

    1. Token ``i`` with ``cur[i] == del_id`` is dropped together with gap ``i`` (the
       insertion before it). Otherwise it becomes ``cur[i]`` (``noisy[i]`` where ``cur[i]``
       is ``ignore_id``, so keep-labels ignored with ``pred_clean_token=False`` apply).
    2. Before each surviving token ``i``, ``nxt[i]`` is inserted when it differs from the
       token's new value (and is not ``ignore_id``); at the end, ``nxt[N]`` is appended
       when it is not ``eos_id`` (nor ``ignore_id``). Any other token is inserted as is,
       ``del_id`` included.
    3. With ``max_len``, only the first ``max_len - survivors`` insertions (left to right)
       are made; surviving tokens are never cut.

    Returns the new response as a list of ints.
    """
    noisy = _as_ids(noisy, "noisy")
    del_id, eos_id, ignore_id = _check_special_ids(del_id, eos_id, ignore_id)
    cur = _as_ids(cur, "cur", allow=ignore_id)
    nxt = _as_ids(nxt, "nxt", allow=ignore_id)
    n = len(noisy)
    if len(cur) != n:
        raise ValueError(f"cur must have one entry per noisy token ({n}), got {len(cur)}")
    if len(nxt) != n + 1:
        raise ValueError(f"nxt must have one entry per gap ({n + 1}), got {len(nxt)}")
    if max_len is not None:
        max_len = _as_int(max_len, "max_len")
        if max_len < 0:
            raise ValueError(f"max_len must be non-negative, got {max_len}")

    survivors = [(g, int(noisy[g] if cur[g] == ignore_id else cur[g])) for g in range(n) if cur[g] != del_id]
    budget = None if max_len is None else max(0, max_len - len(survivors))
    out: list[int] = []

    def insert(token) -> None:
        nonlocal budget
        if budget is None or budget > 0:
            out.append(int(token))
            if budget is not None:
                budget -= 1

    for g, token in survivors:
        if nxt[g] != ignore_id and nxt[g] != token:
            insert(nxt[g])
        out.append(token)
    if nxt[n] != ignore_id and nxt[n] != eos_id:
        insert(nxt[n])
    return out


def position_labels(token_target, next_target, *, prompt_len: int, eos_id: int,
                    ignore_id: int = -100) -> tuple[np.ndarray, np.ndarray]:
    """Per-position labels of both heads for ``prompt + response + [eos]`` (ME-DLM's layout).

    Both have length ``prompt_len + N + 1``. Current-token labels: ``ignore_id`` over the
    prompt, ``token_target``, then ``eos_id`` for the trailing end-of-sequence token.
    Next-token labels: ``ignore_id`` over the first ``prompt_len - 1`` positions,
    ``next_target`` (gap 0 at the last prompt token), then ``ignore_id`` at the trailing
    end-of-sequence token.
    """
    token_target = _as_ids(token_target, "token_target", allow=_as_int(ignore_id, "ignore_id"))
    next_target = _as_ids(next_target, "next_target", allow=ignore_id)
    prompt_len, eos_id = _as_int(prompt_len, "prompt_len"), _as_int(eos_id, "eos_id")
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1 (gap 0 is predicted at the last prompt token), "
                         f"got {prompt_len}")
    if len(next_target) != len(token_target) + 1:
        raise ValueError(f"next_target must be one longer than token_target ({len(token_target) + 1}), "
                         f"got {len(next_target)}")
    ignore = np.full(prompt_len, ignore_id, dtype=np.int64)
    current = np.concatenate([ignore, token_target, [eos_id]])
    following = np.concatenate([ignore[1:], next_target, [ignore_id]])
    return current, following


def edit_label_batch(noisy_rows: Sequence, clean_rows: Sequence, *, del_id: int, eos_id: int,
                     pad_to: int | None = None, pred_clean_token: bool = True, ignore_id: int = -100,
                     swap_rule: str = "reference") -> tuple[np.ndarray, np.ndarray]:
    """`edit_labels` per row, padded with ``ignore_id``: ``token_target [B, pad_to]`` and
    ``next_target [B, pad_to + 1]`` (``pad_to`` defaults to the longest noisy row)."""
    if len(noisy_rows) != len(clean_rows):
        raise ValueError(f"noisy_rows and clean_rows must have the same length, got "
                         f"{len(noisy_rows)} and {len(clean_rows)}")
    rows = [edit_labels(noisy, clean, del_id=del_id, eos_id=eos_id, pred_clean_token=pred_clean_token,
                        ignore_id=ignore_id, swap_rule=swap_rule)
            for noisy, clean in zip(noisy_rows, clean_rows)]
    longest = max((len(tokens) for tokens, _ in rows), default=0)
    if pad_to is None:
        pad_to = longest
    pad_to = _as_int(pad_to, "pad_to")
    if pad_to < longest:
        raise ValueError(f"pad_to ({pad_to}) is shorter than the longest noisy row ({longest})")
    token_targets = np.full((len(rows), pad_to), ignore_id, dtype=np.int64)
    next_targets = np.full((len(rows), pad_to + 1), ignore_id, dtype=np.int64)
    for b, (tokens, nexts) in enumerate(rows):
        token_targets[b, :len(tokens)] = tokens
        next_targets[b, :len(nexts)] = nexts
    return token_targets, next_targets
