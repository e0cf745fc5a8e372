"""Edit labels (ME-DLM, arXiv 2605.09603): hand-worked alignments and labels, the canonical
alignment against an independent edit distance, one round of edits, convergence of repeated
label-and-apply rounds, and the two places where the reference's swap rule cannot encode
an insertion. Token ids: del 90, eos 99, ordinary tokens < 10."""

import functools

import numpy as np
import pytest

from jaxlm.data.edit_labels import (EditOp, apply_edits, edit_label_batch, edit_labels,
                                    levenshtein_alignment, position_labels)

DEL, EOS, IGN = 90, 99, -100


def labels(noisy, clean, **kw):
    tokens, nexts = edit_labels(noisy, clean, del_id=DEL, eos_id=EOS, **kw)
    assert tokens.dtype == np.int64 and nexts.dtype == np.int64
    assert tokens.shape == (len(noisy),) and nexts.shape == (len(noisy) + 1,)
    return tokens.tolist(), nexts.tolist()


def one_round(noisy, clean, **kw):
    tokens, nexts = edit_labels(noisy, clean, del_id=DEL, eos_id=EOS, **kw)
    return apply_edits(noisy, tokens, nexts, del_id=DEL, eos_id=EOS)


def brute_distance(a, b):
    """Unit-cost edit distance by plain recursion over suffixes."""
    a, b = tuple(a), tuple(b)

    @functools.lru_cache(maxsize=None)
    def dist(i, j):
        if i == len(a):
            return len(b) - j
        if j == len(b):
            return len(a) - i
        return min(dist(i + 1, j + 1) + (a[i] != b[j]), dist(i + 1, j) + 1, dist(i, j + 1) + 1)

    return dist(0, 0)


def random_pairs(seed, count, max_len=7):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        vocab = int(rng.integers(3, 5))
        yield (rng.integers(0, vocab, int(rng.integers(0, max_len + 1))).tolist(),
               rng.integers(0, vocab, int(rng.integers(0, max_len + 1))).tolist())


# --- hand cases -------------------------------------------------------------------------

@pytest.mark.parametrize("swap_rule", ["reference", "safe"])
@pytest.mark.parametrize("noisy, clean, tokens, nexts", [
    # Pure replace. Backtrace from (3,3): 3=3 keep; 2 vs 5, d(2,2)=1=d(1,1)+1 replace; 1=1 keep.
    # Gaps without insertions predict the target of the token after them; gap 3 -> eos.
    ([1, 2, 3], [1, 5, 3], [1, 5, 3], [1, 5, 3, EOS]),
    # Delete in the middle. (3,2): keep 3; (2,1): d=1, replace needs d(1,0)+1=2, delete
    # d(1,1)+1=1 -> delete 2; keep 1. Gap 1 (after 1, before the deleted 2) predicts the next
    # surviving token 3; gap 2 follows a deleted token -> ignore.
    ([1, 2, 3], [1, 3], [1, DEL, 3], [1, 3, IGN, EOS]),
    # Insert at the start: keep 3, keep 2, insert 1 into gap 0.
    ([2, 3], [1, 2, 3], [2, 3], [1, 3, EOS]),
    # Insert in the middle: keep 3; (1,2): d=1, replace needs d(0,1)+1=2, delete d(0,2)+1=3 ->
    # insert 2 into gap 1; keep 1.
    ([1, 3], [1, 2, 3], [1, 3], [1, 2, EOS]),
    # Insert at the end: (2,3) 2 vs 3 -> insert 3 into gap 2 (after both tokens); keep, keep.
    ([1, 2], [1, 2, 3], [1, 2], [1, 2, 3]),
    # Repeated token: keep 3, keep the noisy 2 as the clean's second 2, insert the first 2 into
    # gap 1 -- right before a 2, where it reads as "insert nothing". Swap rule: gap 1 holds
    # 2 == target of token 1 -> swap gaps 1 and 2: gap 2 holds 2 (before 3), gap 1 is filled
    # with token 1's target 2.
    ([1, 2, 3], [1, 2, 2, 3], [1, 2, 3], [1, 2, 2, EOS]),
    # The swap cascades along a run: the 2 inserted into gap 1 moves to gap 2 (token 2 is 2),
    # then to gap 3 (token 3 is 3, stop).
    ([1, 2, 2, 3], [1, 2, 2, 2, 3], [1, 2, 2, 3], [1, 2, 2, 2, EOS]),
    # Deleted tail: (3,1) d=2, replace needs d(2,0)+1=3, delete d(2,1)+1=2 -> delete 3;
    # (2,1) delete 2 likewise; keep 1. Gap 1 has no surviving token after it -> eos; gap 2
    # follows a deleted token -> ignore; gap 3 -> eos.
    ([1, 2, 3], [1], [1, DEL, DEL], [1, EOS, IGN, EOS]),
    # Identical: all keep, every gap predicts the existing next token, the last gap eos.
    ([4, 5, 6], [4, 5, 6], [4, 5, 6], [4, 5, 6, EOS]),
    # Empty noisy: both tokens go into gap 0, only the first one this round.
    ([], [1, 2], [], [1]),
    ([], [], [], [EOS]),
    # Empty clean: delete both; gap 0 has no surviving token after it -> eos; gap 1 follows a
    # deleted token -> ignore; gap 2 -> eos.
    ([1, 2], [], [DEL, DEL], [EOS, IGN, EOS]),
])
def test_hand_labels(noisy, clean, tokens, nexts, swap_rule):
    assert labels(noisy, clean, swap_rule=swap_rule) == (tokens, nexts)


def test_hand_one_round():
    assert one_round([1, 2, 3], [1, 5, 3]) == [1, 5, 3]
    assert one_round([1, 2, 3], [1, 3]) == [1, 3]
    assert one_round([2, 3], [1, 2, 3]) == [1, 2, 3]
    assert one_round([1, 3], [1, 2, 3]) == [1, 2, 3]
    assert one_round([1, 2], [1, 2, 3]) == [1, 2, 3]
    assert one_round([1, 2, 3], [1, 2, 2, 3]) == [1, 2, 2, 3]
    assert one_round([1, 2, 2, 3], [1, 2, 2, 2, 3]) == [1, 2, 2, 2, 3]
    assert one_round([1, 2, 3], [1]) == [1]
    assert one_round([], [1, 2]) == [1]  # one insertion per gap: [1], then [1, 2]
    assert one_round([1], [1, 2]) == [1, 2]
    assert one_round([1, 2], []) == []


def test_keep_labels_ignored_without_pred_clean_token():
    # Replace 2 -> 5; kept tokens get ignore, and so do the gaps before kept tokens.
    assert labels([1, 2, 3], [1, 5, 3], pred_clean_token=False) == ([IGN, 5, IGN], [IGN, 5, IGN, EOS])
    assert one_round([1, 2, 3], [1, 5, 3], pred_clean_token=False) == [1, 5, 3]


def test_alignment_tie_break():
    # [1] -> [1, 1]: keep matches the last clean 1, the insertion goes into gap 0.
    assert levenshtein_alignment([1], [1, 1]) == [EditOp("insert", 0, 0), EditOp("keep", 0, 1)]
    # Replace beats delete + insert: [1, 2] -> [1, 3].
    assert [op.kind for op in levenshtein_alignment([1, 2], [1, 3])] == ["keep", "replace"]
    assert levenshtein_alignment([], []) == []


# --- the reference swap rule's blind spots, and the "safe" rule ------------------------

def test_reference_leaves_gap_zero_ambiguous():
    # [1] -> [1, 1]: the 1 inserted into gap 0 sits before a 1; the reference checks gaps
    # 1..N-1 only, so the label reads "insert nothing" and the round changes nothing.
    assert labels([1], [1, 1]) == ([1], [1, EOS])
    assert one_round([1], [1, 1]) == [1]
    # The safe rule moves it to gap 1 (free): gap 0 "nothing" (1), gap 1 inserts 1.
    assert labels([1], [1, 1], swap_rule="safe") == ([1], [1, 1])
    assert one_round([1], [1, 1], swap_rule="safe") == [1, 1]


def test_reference_swap_reorders_two_insertions():
    # [1, 2, 3] -> [1, 2, 2, 4, 3]: keep 3; (2,4) 2 vs 4 -> insert 4 into gap 2; keep 2;
    # insert 2 into gap 1; keep 1. Gaps: 1 -> 2 (ambiguous before a 2), 2 -> 4.
    # Reference: swap gaps 1 and 2 -> [1, 4, 2, eos], which builds 1 4 2 2 3.
    assert labels([1, 2, 3], [1, 2, 2, 4, 3]) == ([1, 2, 3], [1, 4, 2, EOS])
    assert one_round([1, 2, 3], [1, 2, 2, 4, 3]) == [1, 4, 2, 2, 3]
    # Safe: gap 2 is taken, so the 2 stays (a no-op this round) -> 1 2 4 3, one step closer.
    assert labels([1, 2, 3], [1, 2, 2, 4, 3], swap_rule="safe") == ([1, 2, 3], [1, 2, 4, EOS])
    assert one_round([1, 2, 3], [1, 2, 2, 4, 3], swap_rule="safe") == [1, 2, 4, 3]
    assert one_round([1, 2, 4, 3], [1, 2, 2, 4, 3], swap_rule="safe") == [1, 2, 2, 4, 3]


# --- apply_edits ------------------------------------------------------------------------

def test_apply_edits_gaps_and_cap():
    # Gap 0: 7 != 1 insert; gap 1: 8 != 3 insert; end: 9 != eos append.
    assert apply_edits([1, 3], [1, 3], [7, 8, 9], del_id=DEL, eos_id=EOS) == [7, 1, 8, 3, 9]
    # Only the first max_len - survivors insertions, left to right; tokens are never cut.
    assert apply_edits([1, 3], [1, 3], [7, 8, 9], del_id=DEL, eos_id=EOS, max_len=3) == [7, 1, 3]
    assert apply_edits([1, 3], [1, 3], [7, 8, 9], del_id=DEL, eos_id=EOS, max_len=1) == [1, 3]
    # Insertion compares with the new token: 3 -> 5 and gap 1 predicting 5 is "nothing".
    assert apply_edits([1, 3], [1, 5], [1, 5, EOS], del_id=DEL, eos_id=EOS) == [1, 5]
    # A deleted token takes the insertion before it along.
    assert apply_edits([1, 2], [1, DEL], [1, 7, EOS], del_id=DEL, eos_id=EOS) == [1]
    # Ignore entries: keep the token / insert nothing.
    assert apply_edits([1, 2], [IGN, 4], [IGN, IGN, IGN], del_id=DEL, eos_id=EOS) == [1, 4]
    assert apply_edits([], [], [EOS], del_id=DEL, eos_id=EOS) == []
    assert apply_edits([], [], [5], del_id=DEL, eos_id=EOS) == [5]


# --- random pairs -------------------------------------------------------------------------

def test_alignment_is_minimal_and_rebuilds_clean():
    for noisy, clean in random_pairs(0, 300, max_len=6):
        ops = levenshtein_alignment(noisy, clean)
        assert sum(op.kind != "keep" for op in ops) == brute_distance(noisy, clean)
        rebuilt, next_noisy = [], 0
        for op in ops:
            if op.kind == "insert":
                assert op.noisy_pos == next_noisy
                rebuilt.append(clean[op.clean_pos])
                continue
            assert op.noisy_pos == next_noisy
            next_noisy += 1
            if op.kind == "keep":
                assert noisy[op.noisy_pos] == clean[op.clean_pos]
            if op.kind != "delete":
                rebuilt.append(clean[op.clean_pos])
        assert next_noisy == len(noisy) and rebuilt == clean


@pytest.mark.parametrize("swap_rule", ["reference", "safe"])
def test_labels_well_formed(swap_rule):
    for noisy, clean in random_pairs(1, 300):
        tokens, nexts = labels(noisy, clean, swap_rule=swap_rule)
        assert all(t == DEL or t in clean for t in tokens)
        assert DEL not in nexts and nexts[-1] in clean + [EOS]
        for g, value in enumerate(nexts[:-1]):
            if value == IGN:
                assert g > 0 and tokens[g - 1] == DEL
        apply_edits(noisy, tokens, nexts, del_id=DEL, eos_id=EOS)


def test_safe_rule_converges_within_distance():
    for noisy, clean in random_pairs(2, 400):
        current, distance = noisy, brute_distance(noisy, clean)
        rounds = 0
        while current != clean:
            current = one_round(current, clean, swap_rule="safe")
            rounds += 1
            new_distance = brute_distance(current, clean)
            assert new_distance < distance, (noisy, clean, current)
            distance = new_distance
        assert rounds <= brute_distance(noisy, clean) <= max(len(noisy), len(clean))


@pytest.mark.parametrize("swap_rule", ["reference", "safe"])
def test_one_round_when_each_gap_needs_one_unambiguous_insertion(swap_rule):
    checked = 0
    for noisy, clean in random_pairs(3, 400):
        ops = levenshtein_alignment(noisy, clean)
        becomes = {op.noisy_pos: clean[op.clean_pos] for op in ops if op.kind in ("keep", "replace")}
        gaps = [op.noisy_pos for op in ops if op.kind == "insert"]
        if len(gaps) != len(set(gaps)):
            continue
        if any(clean[op.clean_pos] == becomes.get(op.noisy_pos) for op in ops if op.kind == "insert"):
            continue
        checked += 1
        assert one_round(noisy, clean, swap_rule=swap_rule) == clean, (noisy, clean)
    assert checked > 100


# --- batch, model positions, errors -------------------------------------------------------

def test_batch_and_positions():
    tokens, nexts = edit_label_batch([[1, 2, 3], [2, 3]], [[1, 3], [1, 2, 3]], del_id=DEL, eos_id=EOS, pad_to=4)
    assert tokens.tolist() == [[1, DEL, 3, IGN], [2, 3, IGN, IGN]]
    assert nexts.tolist() == [[1, 3, IGN, EOS, IGN], [1, 3, EOS, IGN, IGN]]
    assert edit_label_batch([], [], del_id=DEL, eos_id=EOS)[1].shape == (0, 1)
    with pytest.raises(ValueError, match="pad_to"):
        edit_label_batch([[1, 2]], [[1]], del_id=DEL, eos_id=EOS, pad_to=1)
    # Prompt of 2, response [5, 6], trailing eos: gap 0 is learnt at the last prompt token.
    current, following = position_labels([5, 6], [5, 7, EOS], prompt_len=2, eos_id=EOS)
    assert current.tolist() == [IGN, IGN, 5, 6, EOS]
    assert following.tolist() == [IGN, 5, 7, EOS, IGN]


@pytest.mark.parametrize("kwargs, match", [
    (dict(noisy=[[1, 2]]), "noisy"),
    (dict(clean=[[1]]), "clean"),
    (dict(noisy=[1.5]), "noisy"),
    (dict(noisy=[-1]), "noisy"),
    (dict(clean=[1, DEL]), "del_id"),
    (dict(clean=[1, EOS]), "clean contains eos_id"),  # labelled as "insert nothing": never reached
    (dict(del_id=-1), "del_id"),
    (dict(eos_id=-2), "eos_id"),
    (dict(eos_id=DEL), "del_id and eos_id"),
    (dict(ignore_id=0), "ignore_id"),
    (dict(swap_rule="other"), "swap_rule"),
])
def test_bad_input(kwargs, match):
    args = dict(noisy=[1, 2], clean=[1], del_id=DEL, eos_id=EOS) | kwargs
    with pytest.raises(ValueError, match=match):
        edit_labels(args.pop("noisy"), args.pop("clean"), **args)


def test_bad_apply_input():
    with pytest.raises(ValueError, match="cur"):
        apply_edits([1, 2], [1], [1, 2, EOS], del_id=DEL, eos_id=EOS)
    with pytest.raises(ValueError, match="nxt"):
        apply_edits([1, 2], [1, 2], [1, 2], del_id=DEL, eos_id=EOS)
    with pytest.raises(ValueError, match="max_len"):
        apply_edits([1], [1], [1, EOS], del_id=DEL, eos_id=EOS, max_len=-1)
    with pytest.raises(ValueError, match="prompt_len"):
        position_labels([1], [1, EOS], prompt_len=0, eos_id=EOS)
