"""A multi-condition task for meta-gating (MeGan) experiments: the same input digits, answers
depending on a condition string ("add 3", "reverse", "sort", ...).

``condition_in="hyper"``: the condition is not in the prompt; it travels as ``condition``
token ids (padded to ``cond_len``) that a ``meta_swiglu`` model's hypernetwork reads.
``"prompt"``: the condition is written at the start of the prompt (``[add 3] 5 2 9 1=``).
``"none"``: no condition anywhere (the answer is the input, e.g. for a copy-trained base).
Held-out conditions never appear in training; ``eval_on`` picks seen / held-out / all.
`ConditionedDigits.compositional` builds conditions as ``"<op>, add <k>"`` pairs whose
held-out pairs combine parts that training shows only in other pairs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxlm.data.encoding import encode
from jaxlm.data.tasks import TASKS, Task

_OPS = {
    "copy": lambda d: d,
    "reverse": lambda d: d[::-1],
    "sort": lambda d: sorted(d),
}


def apply_condition(condition: str, digits: list[int]) -> list[int]:
    """The digits transformed by ``condition``: ``add K`` (mod 10), ``copy``, ``reverse``,
    ``sort``, or a comma-separated composition applied left to right (``reverse, add 3``).
    An unknown part raises ``KeyError`` / ``ValueError``."""
    out = list(digits)
    for part in (p.strip() for p in condition.split(",")):
        if part.startswith("add "):
            k = int(part[4:])
            out = [(x + k) % 10 for x in out]
        else:
            out = list(_OPS[part](out))
    return out


def compositions(ops: tuple[str, ...], adds: tuple[int, ...]) -> tuple[str, ...]:
    """Every ``"<op>, add <k>"`` condition of ``ops x adds``."""
    return tuple(f"{op}, add {k}" for op in ops for k in adds)


@TASKS.register("conditioned_digits")
@dataclasses.dataclass(frozen=True)
class ConditionedDigits(Task):
    n_digits: int = 4
    conditions: tuple[str, ...] = ("add 1", "add 2", "add 4", "add 5", "add 6", "add 8", "reverse", "sort")
    held_out: tuple[str, ...] = ("add 3", "add 7")
    condition_in: str = "hyper"
    cond_len: int = 8
    eval_on: str = "seen"

    def __post_init__(self):
        super().__post_init__()
        if self.condition_in not in ("hyper", "prompt", "none"):
            raise ValueError(f"conditioned_digits.condition_in={self.condition_in!r} must be hyper, prompt or none")
        for name in ("n_digits", "cond_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"conditioned_digits.{name}={v!r} must be an int >= 1")
        if not self.conditions:
            raise ValueError("conditioned_digits.conditions is empty: train at least one condition")
        if self.condition_in == "none" and (tuple(self.conditions) != ("copy",) or self.held_out):
            # no condition anywhere: a hidden one would decide the answer, which nothing shows
            raise ValueError(f"conditioned_digits.condition_in='none' gives the model no condition: conditions must "
                             f"be ('copy',) and held_out empty, got conditions={self.conditions!r}, "
                             f"held_out={self.held_out!r}")
        if self.eval_on not in ("seen", "held_out", "all"):
            raise ValueError(f"conditioned_digits.eval_on={self.eval_on!r} must be seen, held_out or all")
        for c in self.conditions + self.held_out:
            try:
                apply_condition(c, [1, 2])
            except (KeyError, ValueError):
                raise ValueError(f"conditioned_digits: unknown condition {c!r} (add K, copy, reverse, sort, "
                                 "or a comma-separated composition of them)") from None
            if self.condition_in == "hyper" and len(c.encode()) > self.cond_len:
                raise ValueError(f"conditioned_digits.cond_len={self.cond_len} is too short for condition {c!r} "
                                 f"({len(c.encode())} bytes): raise cond_len")
        if set(self.conditions) & set(self.held_out):
            raise ValueError(f"conditioned_digits: {sorted(set(self.conditions) & set(self.held_out))} are both "
                             "trained (conditions) and held out")

    @classmethod
    def compositional(cls, ops: tuple[str, ...] = ("copy", "reverse", "sort"), adds: tuple[int, ...] = (1, 2, 3, 4, 5, 6),
                      held_out: tuple[str, ...] = ("copy, add 3", "reverse, add 5", "sort, add 1"),
                      **kw) -> "ConditionedDigits":
        """Conditions ``"<op>, add <k>"`` over ``ops x adds``; ``held_out`` pairs are never
        trained, though each of their parts is (with other partners): a test of composition."""
        conditions = tuple(c for c in compositions(ops, adds) if c not in held_out)
        return cls(conditions=conditions, held_out=held_out, cond_len=kw.pop("cond_len", 16), **kw)

    def example(self, index: int, split: str = "train"):
        """Train: seen conditions on the train half of (condition, digits) pairs (by hash).
        Eval: ``seen`` -> seen conditions on the other half (never trained on); ``held_out``
        -> held-out conditions; ``all`` -> both."""
        if split == "eval" and self.eval_on != "seen":
            rng = np.random.default_rng([self.seed, index, 1])
            pool = self.held_out if self.eval_on == "held_out" else self.conditions + self.held_out
            ex = self._draw_with(rng, pool)
            if ex["condition"] in self.held_out:
                return ex
        return super().example(index, split)

    def _draw(self, rng):
        return self._draw_with(rng, self.conditions)

    def _draw_with(self, rng, pool):
        cond = pool[int(rng.integers(0, len(pool)))]
        digits = [int(x) for x in rng.integers(0, 10, self.n_digits)]
        body = " ".join(map(str, digits)) + "="
        prompt = f"[{cond}] {body}" if self.condition_in == "prompt" else body
        answer = " ".join(map(str, apply_condition(cond, digits)))
        # the condition is part of what the split hashes, whether or not the prompt shows it
        return {"prompt": prompt, "completion": f"{answer}", "condition": cond, "answer": answer,
                "_split_key": cond}

    def encode_arrays(self, example, tokenizer):
        enc = encode(example, tokenizer)
        if self.condition_in == "hyper":
            ids = tokenizer.encode(example["condition"])[: self.cond_len]
            cond = np.zeros(self.cond_len, np.int32)
            cond[: len(ids)] = ids
            enc["condition"] = cond
            enc["condition_mask"] = np.arange(self.cond_len) < len(ids)
        return enc

    def verify(self, example, completion):
        return float(completion.strip() == example["answer"])

    def chance_accuracy(self):
        return 0.1**self.n_digits

    generative_eval = False  # exact match is measured under teacher forcing (condition arrays)
