"""A synthetic pairwise judging task in CAMEL's format (`jaxlm.eval.camel`): which of two
answers to ``a+b=`` is right.

The prompt is `jaxlm.eval.judge.pairwise_prompts`'s (what `gated_judge` scores); a
demonstration is the verdict letter, the reflection marker, a worked reflection
(``a+b=c``) and the final marker with the same letter::

    Question: 47+38=
    Answer A: 75
    Answer B: 85
    Better: B
    Why: 47+38=85
    Final: B

The wrong answer is the right one with one digit off by one (``wrong_offsets``: 1 or 10 by
default, a ones or tens slip, the errors a carry makes), so the one-token verdict must compare
close numbers while the reflection computes the sum and settles it. `verify` reads the last
final verdict of the text (prefix included: CAMEL's rollouts continue after a forced verdict).

With ``reflection="check"`` the worked reflection also copies answer A and says whether it
equals the sum, so the final verdict follows from one comparison the reflection has just
written (``Why: 47+38=85`` / ``A=75? no`` / ``Final: B``). The bare sum leaves a small judge
to find, across the prompt, which answer shows that sum.

With ``reflection="columns"`` the reflection is column addition, right to left, with answer A
checked one digit at a time: each line adds one column of the operands and the carry, then
copies A's digit in that column and says whether it equals the column's last digit; a last line
says whether every digit matched. Every step reads only a few tokens a fixed distance back (the
carry is the previous line's tens digit), so nothing has to be compared across a whole number::

    Why: 47+38=
    7+8+0=15 A5 ok
    4+3+1=08 A7 no
    A? no
    Final: B

The lines run over ``width`` columns (with a width) or over the digits of the longer of the sum
and answer A; missing digits are zeros.

In such demonstrations the final verdict always repeats the initial one, so a judge can learn
to copy it (rubber-stamping) instead of reading its reflection. With ``revise_fraction`` that
share of the examples are revision demonstrations: the prompt ends with the *wrong* verdict and
the reflection marker (context, not trained, as in CAMEL's counterfactual prefixes) and the
completion is the reflection and the corrected final verdict. ``judge_prompt`` is always the
bare judging prompt.
"""

from __future__ import annotations

import dataclasses

from jaxlm.data.tasks import TASKS, Task, _split_of
from jaxlm.eval.camel import CamelTemplate, final_verdict
from jaxlm.eval.judge import pairwise_prompts


REFLECTIONS = ("sum", "check", "columns")


def column_lines(a: int, b: int, answer: str, letter: str, columns: int) -> list[str]:
    """Column addition of ``a + b`` right to left over ``columns`` columns, each line checking
    ``answer``'s digit in that column against the column's last digit:
    ``{a_k}+{b_k}+{carry}={two-digit total} {letter}{answer_k} ok|no``."""
    lines, carry = [], 0
    digits = answer[::-1]
    for k in range(columns):
        x, y = a // 10 ** k % 10, b // 10 ** k % 10
        total = x + y + carry
        shown = int(digits[k]) if k < len(digits) else 0
        lines.append(f"{x}+{y}+{carry}={total:02d} {letter}{shown} {'ok' if shown == total % 10 else 'no'}")
        carry = total // 10
    return lines


@TASKS.register("sum_judging")
@dataclasses.dataclass(frozen=True)
class SumJudging(Task):
    """Judge which of two answers to ``a+b=`` (``digits``-digit operands) is right; the right
    one is shown first or second with equal probability."""

    digits: int = 2
    """Digits of each operand (1-6)."""
    wrong_offsets: tuple[int, ...] = (1, 10)
    """The wrong answer is the right one plus or minus one of these (drawn uniformly)."""
    random_wrong: float = 0.0
    """Share of pairs whose wrong answer is instead a random number with as many digits as the
    right one (never the right one). Offsets keep most digits of the right answer, so a judge
    can guess a digit of the sum from answer A; random wrong answers take that shortcut away."""
    template: CamelTemplate = CamelTemplate()
    """The judging prompt, verdict letters and reflection/final markers."""
    revise_fraction: float = 0.0
    """Share of revision demonstrations (a wrong initial verdict in the prompt, corrected)."""
    width: int = 0
    """Zero-pad the shown answers and the reflection's numbers to this many digits (0: no
    padding). With a width every number sits at a fixed position, so the checking reflection
    compares digits a fixed distance apart."""
    reflection: str = "sum"
    """The worked reflection: ``"sum"`` (``a+b=c``), ``"check"`` (the sum, then answer A
    copied and checked against it: ``a+b=c`` / ``A=x? yes|no``) or ``"columns"`` (column
    addition with A checked digit by digit, see the module docstring)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 6:
            raise ValueError(f"sum_judging.digits={self.digits!r} must be an int in [1, 6]")
        if not self.wrong_offsets or any(isinstance(o, bool) or not isinstance(o, int) or o <= 0
                                         for o in self.wrong_offsets):
            raise ValueError(f"sum_judging.wrong_offsets={self.wrong_offsets!r} must be positive ints")
        for name in ("revise_fraction", "random_wrong"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ValueError(f"sum_judging.{name}={v!r} must be a number in [0, 1]")
        w = self.width
        longest = len(str(2 * (10 ** self.digits - 1) + max(self.wrong_offsets)))
        if isinstance(w, bool) or not isinstance(w, int) or not (w == 0 or w >= longest):
            raise ValueError(f"sum_judging.width={w!r} must be 0 (no padding) or an int >= {longest}, the digits "
                             f"of the longest answer {self.digits}-digit operands and wrong_offsets can give")
        if self.reflection not in REFLECTIONS:
            raise ValueError(f"sum_judging.reflection={self.reflection!r} must be one of {REFLECTIONS}")
        if not isinstance(self.template, CamelTemplate):
            raise ValueError(f"sum_judging.template must be a CamelTemplate, got {type(self.template).__name__}")

    def letter(self, verdict: int) -> str:
        return (self.template.judge.first, self.template.judge.second)[verdict]

    def _draw(self, rng):
        lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits
        a, b = (int(x) for x in rng.integers(lo, hi, 2))
        right = a + b
        offset = int(self.wrong_offsets[int(rng.integers(len(self.wrong_offsets)))])
        wrong = right + offset if right - offset < 0 or rng.random() < 0.5 else right - offset
        if self.random_wrong and rng.random() < self.random_wrong:
            n = len(str(right))
            wrong = int(rng.integers(10 ** (n - 1) if n > 1 else 0, 10 ** n - 1))
            wrong += wrong >= right  # uniform over the n-digit numbers other than the right one
        answer = int(rng.integers(2))  # 0: the right answer is shown first (A)
        first, second = (f"{x:0{self.width}d}" for x in ((right, wrong) if answer == 0 else (wrong, right)))
        question = f"{a}+{b}="
        prompt = pairwise_prompts([question], [first], [second], self.template.judge)[0]
        v = self.letter(answer)
        letter_a, verdict_a = self.template.judge.first, "yes" if answer == 0 else "no"
        if self.reflection == "columns":
            columns = self.width or max(len(str(right)), len(first))
            reflection = "\n".join([question, *column_lines(a, b, first, letter_a, columns),
                                    f"{letter_a}? {verdict_a}", ""])
        else:
            reflection = f"{question}{right:0{self.width}d}\n"
            if self.reflection == "check":
                reflection += f"{letter_a}={first}? {verdict_a}\n"
        reflection += f"{self.template.final}{v}"
        revise = bool(rng.random() < self.revise_fraction)
        if revise:
            text, completion = prompt + self.letter(1 - answer) + self.template.reflect, reflection
        else:
            text, completion = prompt, v + self.template.reflect + reflection
        return {"prompt": text, "completion": completion, "answer": answer, "question": question,
                "first": first, "second": second, "operands": [a, b], "judge_prompt": prompt,
                "revision": revise}

    def split_of(self, ex):
        """By the judging prompt alone: a revision demonstration of a problem (its prompt
        extended by a wrong verdict) is in the split of the problem itself."""
        return _split_of(ex["judge_prompt"], self.eval_fraction)

    def verify(self, example, completion):
        """1 if the text's last final verdict names the right answer (0 without one)."""
        return float(final_verdict(completion, self.template) == example["answer"])

    def chance_accuracy(self):
        return 0.5
