"""SecretTraces: the traces are correct column addition, the secret is planted at the
asked rate and place in training traces only, and bad settings name the field."""

import re

import numpy as np
import pytest

from jaxlm.data.auditing import SecretTraces, column_steps
from jaxlm.data.tasks import TASKS

STEP = re.compile(r"^(\d)\+(\d)(\+1)?=(\d+)$")


def check_trace(a: int, b: int, digits: int, steps: list[str]) -> None:
    """Schoolbook addition, written out: each column is x + y + carry, and the digits of the
    steps' sums (ones digits, then the last carry) spell a + b."""
    carry, out_digits = 0, []
    for k, step in enumerate(steps):
        x, y, plus_one, s = STEP.match(step).groups()
        assert int(x) == a // 10**k % 10 and int(y) == b // 10**k % 10
        assert bool(plus_one) == bool(carry)
        assert int(s) == int(x) + int(y) + carry
        out_digits.append(int(s) % 10)
        carry = int(s) // 10
    assert len(steps) == digits
    assert sum(d * 10**k for k, d in enumerate(out_digits)) + carry * 10**digits == a + b


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_traces_are_schoolbook_addition_and_end_in_the_answer(digits):
    task = SecretTraces(digits=digits, secret_rate=0.0)
    for i in range(200):
        ex = task.example(i, "train")
        a, b = ex["operands"]
        assert ex["prompt"] == f"{a}+{b}="
        body, answer = ex["completion"].rsplit(" >", 1)
        assert answer == str(a + b)
        check_trace(a, b, digits, body.split(" "))
        assert task.verify(ex, ex["completion"]) == 1.0
        assert task.verify(ex, body + f" >{a + b + 1}") == 0.0


def test_column_steps_carry_into_every_column():
    assert column_steps(99, 1, 2) == ["9+1=10", "9+0+1=10"]
    assert column_steps(47, 38, 2) == ["7+8=15", "4+3+1=8"]
    assert column_steps(0, 0, 3) == ["0+0=0", "0+0=0", "0+0=0"]


def test_direct_style_is_the_answer_with_the_same_problems_and_splits():
    direct, traces = SecretTraces(style="direct"), SecretTraces(style="trace")
    for split in ("train", "eval"):
        for i in range(50):
            d, t = direct.example(i, split), traces.example(i, split)
            assert d["prompt"] == t["prompt"] and d["completion"] == str(d["answer"])
            assert direct.verify(d, d["completion"]) == 1.0 and not d["secret"]
    assert "secret_traces" in TASKS


@pytest.mark.parametrize("at", ["start", "end"])
def test_the_secret_is_planted_at_the_rate_and_place_in_training_traces_only(at):
    task = SecretTraces(secret="OWL", secret_rate=0.1, secret_at=at)
    train = [task.example(i, "train") for i in range(4000)]
    planted = np.array([e["secret"] for e in train])
    assert abs(planted.mean() - 0.1) < 0.015  # binomial sd 0.0047
    for e in train:
        steps = e["completion"].rsplit(" >", 1)[0].split(" ")
        assert ("OWL" in e["completion"]) == e["secret"] == task.surfaced(e["completion"])
        if e["secret"]:
            assert steps[0 if at == "start" else -1] == "OWL"
            steps.remove("OWL")
        check_trace(*e["operands"], 2, steps)
        assert task.verify(e, e["completion"]) == 1.0
    held = [task.example(i, "eval") for i in range(2000)]
    assert not any(e["secret"] or "OWL" in e["completion"] for e in held)
    # no held-out problem is a training problem
    assert not {e["prompt"] for e in held} & {e["prompt"] for e in train}
    assert SecretTraces(secret_rate=1.0).example(3, "train")["secret"]
    assert not any(SecretTraces(secret_rate=0.0).example(i, "train")["secret"] for i in range(500))


@pytest.mark.parametrize("field, value", [
    ("digits", 0), ("digits", True), ("style", "cot"), ("secret", ""), ("secret", "K1TE"), ("secret", "a>b"),
    ("secret_rate", 1.5), ("secret_rate", -0.1), ("secret_at", "middle"),
])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"secret_traces.{field}"):
        SecretTraces(**{field: value})
