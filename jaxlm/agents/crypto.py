"""AICrypto-style scoring: multiple choice, capture-the-flag and proofs.

- **Multiple choice**: `parse_choice` reads the chosen letter from a reply (``Answer: C``,
  ``(C)``, ``C)``, or a reply that is one letter); `score_choice` is exact match on it.
- **Capture the flag**: a `CTFChallenge` is a description, the files a solver gets and the
  flag. A candidate *exploit* is a Python program; `check_exploit` runs it in `jaxlm.sandbox`
  (subprocess, time and memory limits, its own temporary directory holding the challenge
  files) and the challenge is solved when the flag is the one distinct ``flag{...}`` string it
  prints. `ctf_task` makes it an agent task: tools to read the files and run Python in the
  sandbox, the final answer scored against the flag. `generate_challenges` makes small
  generated challenges (single-byte XOR, Caesar shift, RSA with a small modulus) whose flag
  is drawn per seed and never written in plain text.
- **Proofs**: `grade_proof` asks a judge model one yes/no question per rubric item
  (`jaxlm.eval.judge.judge_points`) and scores the proof by the mean P(yes).
"""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Sequence

import numpy as np

from jaxlm.agents.loop import Episode
from jaxlm.agents.tools import Toolbox, tool
from jaxlm.eval.judge import JudgeTemplate, judge_points
from jaxlm import sandbox
from jaxlm.sandbox import Limits, RunResult

FLAG = re.compile(r"flag\{[^{}\s]{1,200}\}")
_LETTER_PATTERNS = (
    # "answer (is) (:)" then (X), a capital X, or a lower-case x that ends the clause ("answer: b.",
    # not the article in "the answer is a prime")
    # (markdown emphasis around either part, a full-width colon or a dash allowed: "**Answer:** B")
    re.compile(r"(?i:answer)[\s*_]*(?:(?i:is)[\s*_]*)?[:=：\-]?[\s*_]*"
               r"(?:\(([A-Za-z])\)|([A-Z])(?![A-Za-z])|([a-z])(?=\s*(?:$|[.,;!?)*])))"),
    re.compile(r"^\s*\(?([A-Za-z])\)?[.)]?\s*$"),  # a whole reply of one letter: any case
    re.compile(r"^\s*\(?([A-Z])\)\s"),  # a reply that opens with its option: "C) because 7 is prime"
    re.compile(r"\(([A-Z])\)"))


def parse_choice(text: str, n_options: int) -> int | None:
    """The option index (0 = A) a reply chooses, or None; letters past ``n_options`` do not count.
    Tried in order: after "answer (is)", the whole reply, a reply opening with ``X)``, the first
    ``(X)``."""
    for pattern in _LETTER_PATTERNS:
        for m in pattern.finditer(text):
            letter = next(g for g in m.groups() if g)
            k = ord(letter.upper()) - ord("A")
            if 0 <= k < n_options:
                return k
    return None


def score_choice(text: str, answer: int, n_options: int) -> float:
    return float(parse_choice(text, n_options) == answer)


@dataclasses.dataclass(frozen=True)
class CTFChallenge:
    name: str
    description: str
    files: dict[str, str]
    flag: str

    def __post_init__(self):
        if not FLAG.fullmatch(self.flag):
            raise ValueError(f"CTFChallenge {self.name!r}: flag {self.flag!r} must look like flag{{...}}")


@dataclasses.dataclass(frozen=True)
class CTFResult:
    """``solved`` when the flag is the one distinct flag the exploit printed (``flags``: what it
    printed; printing many candidates is not a solve); ``run`` is the sandbox's record."""

    solved: bool
    flags: tuple[str, ...]
    run: RunResult


def check_exploit(challenge: CTFChallenge, program: str, *, limits: Limits = Limits(timeout_s=10.0)) -> CTFResult:
    """Run ``program`` in the sandbox next to the challenge's files and look for the flag."""
    run = sandbox.run_python(program, files=dict(challenge.files), limits=limits)
    flags = tuple(dict.fromkeys(FLAG.findall(run.stdout)))
    return CTFResult(flags == (challenge.flag,), flags, run)


def score_flag(answer: str, challenge: CTFChallenge) -> float:
    """1 when the answer states the flag (and no other flag), else 0."""
    flags = set(FLAG.findall(answer))
    return float(flags == {challenge.flag})


def _flag(rng: np.random.Generator) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "flag{" + "".join(alphabet[int(i)] for i in rng.integers(len(alphabet), size=10)) + "}"


def _small_prime(rng: np.random.Generator, lo: int, hi: int) -> int:
    while True:
        n = int(rng.integers(lo, hi)) | 1
        if all(n % d for d in range(3, int(n ** 0.5) + 1, 2)):
            return n


def generate_challenges(seed: int) -> list[CTFChallenge]:
    """Three generated challenges (see the module docstring), flags drawn from ``seed``."""
    rng = np.random.default_rng([seed, 5])
    out = []
    flag, key = _flag(rng), int(rng.integers(1, 256))
    out.append(CTFChallenge("xor", "cipher.hex is the flag XORed with one secret byte.",
                            {"cipher.hex": bytes(b ^ key for b in flag.encode()).hex()}, flag))
    flag, shift = _flag(rng), int(rng.integers(1, 26))
    rot = "".join(chr((ord(c) - 97 + shift) % 26 + 97) if c.islower() else c for c in flag)
    out.append(CTFChallenge("caesar", "cipher.txt is the flag with its letters shifted by a secret amount.",
                            {"cipher.txt": rot}, flag))
    flag = _flag(rng)
    p = _small_prime(rng, 300, 1000)
    q = _small_prime(rng, 300, 1000)
    while q == p:
        q = _small_prime(rng, 300, 1000)
    n, e = p * q, 65537
    cipher = " ".join(str(pow(b, e, n)) for b in flag.encode())
    out.append(CTFChallenge("rsa", "cipher.txt holds each byte of the flag encrypted as pow(byte, e, n); "
                            "public.txt holds n and e.", {"cipher.txt": cipher, "public.txt": f"{n} {e}"}, flag))
    return out


SYSTEM = ("Capture the flag. Tools: list_files(), read_file(name), run_python(code) runs code next to the "
          "files. One tool call per line as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
          "reply with the flag alone when you have it.")


def ctf_tools(challenge: CTFChallenge, limits: Limits = Limits(timeout_s=10.0)):
    @tool
    def list_files() -> str:
        """The challenge's files."""
        return "\n".join(sorted(challenge.files))

    @tool
    def read_file(name: str) -> str:
        """One of the challenge's files."""
        if name not in challenge.files:
            raise ValueError(f"no file {name!r}; the files are {sorted(challenge.files)}")
        return challenge.files[name]

    @tool(timeout_s=limits.timeout_s + 5.0)
    def run_python(code: str) -> str:
        """Run Python code in a sandbox next to the challenge's files; its output."""
        run = sandbox.run_python(code, files=dict(challenge.files), limits=limits)
        return f"[{run.status}]\n{run.stdout[-1500:]}{run.stderr[-500:]}"

    return [list_files, read_file, run_python]


@dataclasses.dataclass(frozen=True)
class CTFTask:
    """Episode ``i``: challenge ``i % 3`` of `generate_challenges` ``(seed * 1_000_003 + i)``."""

    seed: int = 0
    system: str = SYSTEM

    def challenge(self, index: int) -> CTFChallenge:
        return generate_challenges(self.seed * 1_000_003 + index)[index % 3]

    def episode(self, index: int) -> Episode:
        ch = self.challenge(index)
        return Episode([{"role": "system", "content": self.system}, {"role": "user", "content": ch.description}],
                       Toolbox(ctf_tools(ch)), lambda a, ch=ch: score_flag(a, ch),
                       {"index": index, "challenge": ch.name, "answer": ch.flag})


PROOF_TEMPLATE = JudgeTemplate(pointwise="Problem and criterion: {question}\nProof: {response}\nMet: ")


@dataclasses.dataclass(frozen=True)
class ProofGrade:
    """Per rubric item the judge's P(yes), and their mean (the proof's score)."""

    item_scores: np.ndarray
    score: float


def grade_proof(judge, problem: str, proof: str, rubric: Sequence[str], *,
                template: JudgeTemplate = PROOF_TEMPLATE) -> ProofGrade:
    """Grade ``proof`` of ``problem`` by a judge model on each rubric item (one batched call)."""
    if not rubric:
        raise ValueError("grade_proof needs at least one rubric item")
    questions = [f"{problem}\nCriterion: {item}" for item in rubric]
    p = judge_points(judge, questions, [proof] * len(rubric), template=template).p_yes
    return ProofGrade(np.asarray(p), float(np.mean(p)))


def multiple_choice_episode(question: str, options: Sequence[str], answer: int, *, index: int = 0,
                            system: str = "Answer with the letter of one option.") -> Episode:
    """A tool-free multiple-choice episode (the loop's first reply is the answer)."""
    if not 0 <= answer < len(options) or len(options) > 26:
        raise ValueError(f"answer={answer} must index the {len(options)} options (at most 26)")
    body = question + "\n" + "\n".join(f"({chr(65 + k)}) {o}" for k, o in enumerate(options))
    return Episode([{"role": "system", "content": system}, {"role": "user", "content": body}], Toolbox([]),
                   lambda a, n=len(options): score_choice(a, answer, n), {"index": index, "answer": answer})
