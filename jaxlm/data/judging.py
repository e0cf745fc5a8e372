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

In such demonstrations the final verdict always repeats the initial one, so a judge can learn
to copy it (rubber-stamping) instead of reading its reflection. With ``revise_fraction`` that
share of the examples are revision demonstrations: the prompt ends with the *wrong* verdict and
the reflection marker (context, not trained, as in CAMEL's counterfactual prefixes) and the
completion is the reflection and the corrected final verdict. ``judge_prompt`` is always the
bare judging prompt.
"""

from __future__ import annotations

import dataclasses

from jaxlm.data.tasks import TASKS, Task
from jaxlm.eval.camel import CamelTemplate, final_verdict
from jaxlm.eval.judge import pairwise_prompts


@TASKS.register("sum_judging")
@dataclasses.dataclass(frozen=True)
class SumJudging(Task):
    """Judge which of two answers to ``a+b=`` (``digits``-digit operands) is right; the right
    one is shown first or second with equal probability."""

    digits: int = 2
    """Digits of each operand (1-6)."""
    wrong_offsets: tuple[int, ...] = (1, 10)
    """The wrong answer is the right one plus or minus one of these (drawn uniformly)."""
    template: CamelTemplate = CamelTemplate()
    """The judging prompt, verdict letters and reflection/final markers."""
    revise_fraction: float = 0.0
    """Share of revision demonstrations (a wrong initial verdict in the prompt, corrected)."""
    width: int = 0
    """Zero-pad the shown answers and the reflection's numbers to this many digits (0: no
    padding). With a width every number sits at a fixed position, so the checking reflection
    compares digits a fixed distance apart."""
    reflection: str = "sum"
    """The worked reflection: ``"sum"`` (``a+b=c``) or ``"check"`` (the sum, then answer A
    copied and checked against it: ``a+b=c`` / ``A=x? yes|no``)."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 6:
            raise ValueError(f"sum_judging.digits={self.digits!r} must be an int in [1, 6]")
        if not self.wrong_offsets or any(isinstance(o, bool) or not isinstance(o, int) or o <= 0
                                         for o in self.wrong_offsets):
            raise ValueError(f"sum_judging.wrong_offsets={self.wrong_offsets!r} must be positive ints")
        v = self.revise_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"sum_judging.revise_fraction={v!r} must be a number in [0, 1]")
        w = self.width
        longest = len(str(2 * (10 ** self.digits - 1) + max(self.wrong_offsets)))
        if isinstance(w, bool) or not isinstance(w, int) or not (w == 0 or w >= longest):
            raise ValueError(f"sum_judging.width={w!r} must be 0 (no padding) or an int >= {longest}, the digits "
                             f"of the longest answer {self.digits}-digit operands and wrong_offsets can give")
        if self.reflection not in ("sum", "check"):
            raise ValueError(f"sum_judging.reflection={self.reflection!r} must be 'sum' or 'check'")
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
        answer = int(rng.integers(2))  # 0: the right answer is shown first (A)
        first, second = (f"{x:0{self.width}d}" for x in ((right, wrong) if answer == 0 else (wrong, right)))
        question = f"{a}+{b}="
        prompt = pairwise_prompts([question], [first], [second], self.template.judge)[0]
        v = self.letter(answer)
        reflection = f"{question}{right:0{self.width}d}\n"
        if self.reflection == "check":
            reflection += f"{self.template.judge.first}={first}? {'yes' if answer == 0 else 'no'}\n"
        reflection += f"{self.template.final}{v}"
        revise = bool(rng.random() < self.revise_fraction)
        if revise:
            text, completion = prompt + self.letter(1 - answer) + self.template.reflect, reflection
        else:
            text, completion = prompt, v + self.template.reflect + reflection
        return {"prompt": text, "completion": completion, "answer": answer, "question": question,
                "first": first, "second": second, "operands": [a, b], "judge_prompt": prompt,
                "revision": revise}

    def verify(self, example, completion):
        """1 if the text's last final verdict names the right answer (0 without one)."""
        return float(final_verdict(completion, self.template) == example["answer"])

    def chance_accuracy(self):
        return 0.5
