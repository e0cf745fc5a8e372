"""ConditionedDigits: conditions (and their compositions) transform the digits as written,
held-out conditions are never trained, and bad settings name the field."""

import pytest

from jaxlm.data.conditioned import ConditionedDigits, apply_condition, compositions
from jaxlm.data.tokenizers import ByteTokenizer


def reference(condition: str, digits: list[int]) -> list[int]:
    """Each comma-separated step, applied left to right, written out by hand."""
    out = list(digits)
    for step in condition.split(", "):
        if step == "reverse":
            out = out[::-1]
        elif step == "sort":
            out = sorted(out)
        elif step.startswith("add "):
            out = [(x + int(step.split()[1])) % 10 for x in out]
    return out


@pytest.mark.parametrize("condition", ["copy", "reverse", "sort", "add 7", "reverse, add 3", "sort, add 9",
                                       "add 5, reverse", "add 8, sort", "reverse, reverse, add 1"])
def test_conditions_and_compositions_apply_left_to_right(condition):
    for digits in ([9, 0, 4, 4], [1, 2, 3], [7], []):
        assert apply_condition(condition, digits) == reference(condition, digits)
    # order matters: adding before sorting wraps 8 -> 1 and reorders
    assert apply_condition("add 3, sort", [8, 1]) == [1, 4] and apply_condition("sort, add 3", [8, 1]) == [4, 1]


def test_compositional_holds_out_pairs_whose_parts_are_trained():
    task = ConditionedDigits.compositional()
    assert set(task.conditions) | set(task.held_out) == set(compositions(("copy", "reverse", "sort"), range(1, 7)))
    assert not set(task.conditions) & set(task.held_out)
    for held in task.held_out:
        op, add = held.split(", ")
        assert any(c.startswith(op + ",") for c in task.conditions) and any(c.endswith(add) for c in task.conditions)
    train = [task.example(i, "train") for i in range(500)]
    assert {e["condition"] for e in train} == set(task.conditions)
    for e in train:
        digits = [int(x) for x in e["prompt"].rstrip("=").split()]
        assert e["completion"] == " ".join(map(str, reference(e["condition"], digits)))
    held = ConditionedDigits.compositional(eval_on="held_out")
    assert {held.example(i, "eval")["condition"] for i in range(200)} == set(task.held_out)
    tok = ByteTokenizer()
    enc = task.encode_arrays(train[0], tok)
    assert tok.decode(enc["condition"][enc["condition_mask"]].tolist()) == train[0]["condition"]


def test_prompt_condition_is_written_in_the_prompt():
    task = ConditionedDigits.compositional(condition_in="prompt")
    e = task.example(0, "train")
    assert e["prompt"].startswith(f"[{e['condition']}] ")


@pytest.mark.parametrize("kw, match", [
    (dict(conditions=("add x",)), "unknown condition"),
    (dict(conditions=("reverse, shuffle",)), "unknown condition"),
    (dict(conditions=("reverse, add 3",), cond_len=8), "cond_len=8"),
    (dict(conditions=("sort",), held_out=("sort",)), "both trained"),
    (dict(condition_in="text"), "condition_in"),
])
def test_bad_settings_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        ConditionedDigits(**kw)
