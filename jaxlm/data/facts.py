"""A synthetic fact world for model editing (CounterFact / ZsRE in miniature).

Subjects are made-up names; each has one object per relation (a city, a job, a drink),
stated in several templates (the paraphrases). A model trained on
``FactWorld`` learns every fact in every template, interleaved with a capability task
(2-digit addition by default) whose accuracy is the "capability retention" an edit must
not destroy. `FactWorld.edit_requests` draws counterfactual rewrites in the CounterFact
layout: a rewrite prompt, paraphrase prompts and neighbourhood prompts (other subjects,
same relation, facts that must not change).

Facts are memorised, not generalised: the ``eval`` split is the capability task's
held-out split; fact recall is scored by `jaxlm.editing.metrics.EditEvaluator`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxlm.data.tasks import SPLITS, TASKS, Arithmetic, Task
from jaxlm.fileio import jsonl_lines

RELATIONS: dict[str, dict[str, Any]] = {
    "city": {
        "templates": ("{s} lives in", "{s} is a resident of", "The home town of {s} is"),
        "objects": ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito"),
    },
    "job": {
        "templates": ("{s} works as a", "{s} earns a living as a", "The job of {s} is"),
        "objects": ("baker", "pilot", "nurse", "judge", "chef", "poet", "miner", "tailor"),
    },
    "drink": {
        "templates": ("{s} drinks", "{s} always orders", "The favourite drink of {s} is"),
        "objects": ("tea", "milk", "cola", "wine", "beer", "juice", "water", "cocoa"),
    },
}

_ONSETS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def subject_names(n: int, seed: int) -> list[str]:
    """``n`` distinct pronounceable names (CVCVC, capitalised), fixed by ``seed``."""
    rng = np.random.default_rng([seed, 7])
    names: list[str] = []
    seen = set()
    while len(names) < n:
        c = [_ONSETS[i] for i in rng.integers(0, len(_ONSETS), 3)]
        v = [_VOWELS[i] for i in rng.integers(0, len(_VOWELS), 2)]
        name = (c[0] + v[0] + c[1] + v[1] + c[2]).capitalize()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


@TASKS.register("facts")
@dataclasses.dataclass(frozen=True)
class FactWorld(Task):
    """``n_subjects`` x ``relations`` facts, each in every template, mixed with
    ``capability`` examples at rate ``capability_fraction``."""

    n_subjects: int = 100
    """Fictional subjects, each with one fact per relation."""
    relations: tuple[str, ...] = ("city", "job")
    """Relations every subject has a value for."""
    capability: Arithmetic | None = Arithmetic(digits=2)
    """A task mixed into training, whose held-out accuracy measures what an edit preserves."""
    capability_fraction: float = 0.5
    """Fraction of training examples drawn from the capability task."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.n_subjects, bool) or not isinstance(self.n_subjects, int) or self.n_subjects < 2:
            raise ValueError(f"facts.n_subjects={self.n_subjects!r} must be an int >= 2")
        bad = [r for r in self.relations if r not in RELATIONS]
        if not self.relations or bad:
            raise ValueError(f"facts.relations={self.relations!r} is invalid: each must be one of {sorted(RELATIONS)}")
        if not 0 <= self.capability_fraction < 1:
            raise ValueError(f"facts.capability_fraction={self.capability_fraction!r} must be in [0, 1)")

    # ------------------------------------------------------------ the world
    @property
    def subjects(self) -> list[str]:
        return subject_names(self.n_subjects, self.seed)

    def true_object(self, subject_index: int, relation: str) -> str:
        objects = RELATIONS[relation]["objects"]
        rng = np.random.default_rng([self.seed, subject_index, sorted(RELATIONS).index(relation)])
        return objects[int(rng.integers(0, len(objects)))]

    def facts(self) -> list[dict[str, Any]]:
        """Every (subject, relation) with its object and its prompts, one per template."""
        return [dict(f) for f in _facts(self)]

    def _build_facts(self) -> tuple[dict[str, Any], ...]:
        out = []
        for i, s in enumerate(self.subjects):
            for r in self.relations:
                out.append({
                    "subject": s, "subject_index": i, "relation": r, "object": self.true_object(i, r),
                    "prompts": [t.format(s=s) for t in RELATIONS[r]["templates"]],
                })
        return tuple(out)

    # ------------------------------------------------------------- as a task
    def example(self, index: int, split: str = "train") -> dict[str, Any]:
        """``train``: facts (every template) and capability examples; ``eval``: the
        capability task's held-out examples only (facts are memorised, so they have no
        held-out split; `jaxlm.editing.metrics.EditEvaluator` measures them)."""
        if split not in SPLITS:  # "test" / "validation" read as training data
            raise ValueError(f"split={split!r} is invalid: must be one of {SPLITS}")
        if split == "eval":
            if self.capability is None:
                raise ValueError("FactWorld has no held-out split without a capability task (capability=None)")
            ex = dict(self.capability.example(index, split))
            ex["kind"] = "capability"
            return ex
        rng = np.random.default_rng([self.seed, index, 99])
        if self.capability is not None and rng.random() < self.capability_fraction:
            ex = dict(self.capability.example(index, split))
            ex["kind"] = "capability"
            return ex
        facts = _facts(self)
        n_templates = len(RELATIONS[self.relations[0]]["templates"])
        k = int(rng.integers(0, len(facts) * n_templates))
        fact, t = facts[k // n_templates], k % n_templates
        return {"prompt": fact["prompts"][t], "completion": " " + fact["object"], "kind": "fact",
                "answer": fact["object"]}

    def verify(self, example, completion):
        if example.get("kind") == "capability":
            return self.capability.verify(example, completion)
        return float(completion.strip() == example["answer"])

    def chance_accuracy(self):
        fact = 1.0 / min(len(RELATIONS[r]["objects"]) for r in self.relations)
        if self.capability is None:
            return fact
        f = self.capability_fraction
        return f * self.capability.chance_accuracy() + (1 - f) * fact

    # ------------------------------------------------------------- editing
    def edit_requests(self, n: int, *, seed: int = 0, neighbours: int = 3) -> list[dict[str, Any]]:
        """``n`` counterfactual rewrites of distinct facts, CounterFact-style::

            {"subject", "relation", "prompt", "target_new", "target_true",
             "paraphrase_prompts": [...], "neighborhood": [{"prompt", "target"}, ...]}

        Neighbourhood prompts are facts of *other* subjects with the same relation that no
        request in this set rewrites (so they must keep their answers)."""
        facts = self.facts()
        if not 0 < n <= len(facts) // 2:
            raise ValueError(f"n={n!r} edit requests is invalid: must be in [1, {len(facts) // 2}] for this world")
        rng = np.random.default_rng([self.seed, seed, 1234])
        chosen = rng.permutation(len(facts))[:n]
        edited = {(facts[i]["subject"], facts[i]["relation"]) for i in chosen}
        out = []
        for i in chosen:
            f = facts[i]
            objects = [o for o in RELATIONS[f["relation"]]["objects"] if o != f["object"]]
            new = objects[int(rng.integers(0, len(objects)))]
            # CounterFact's neighbourhood: other subjects that share the *original* object
            # (falling back to any object but the new one), so the new object must not leak.
            pool = [g for g in facts if g["relation"] == f["relation"] and (g["subject"], g["relation"]) not in edited
                    and g["object"] != new]
            same = [g for g in pool if g["object"] == f["object"]]
            pool = same if len(same) >= neighbours else pool
            picks = rng.choice(len(pool), size=min(neighbours, len(pool)), replace=False)
            out.append({
                "subject": f["subject"], "relation": f["relation"], "prompt": f["prompts"][0],
                "target_new": " " + new, "target_true": " " + f["object"],
                "paraphrase_prompts": f["prompts"][1:],
                "neighborhood": [{"prompt": pool[j]["prompts"][0], "target": " " + pool[j]["object"]} for j in picks],
            })
        return out


@functools.lru_cache(maxsize=16)
def _facts(world: FactWorld) -> tuple[dict[str, Any], ...]:
    return world._build_facts()


def write_requests(requests: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


REQUIRED_FIELDS = ("prompt", "target_new")


def _nonempty_str(x) -> bool:
    return isinstance(x, str) and bool(x)


def check_request(row: Any, where: str) -> dict[str, Any]:
    """One edit request checked, with its optional fields filled in (``paraphrase_prompts``:
    a list of non-empty strings; ``neighborhood``: a list of ``{"prompt", "target"}`` objects
    of non-empty strings; ``target_true``: a non-empty string or absent). ValueError names
    ``where`` and the field."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: an edit request is a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED_FIELDS if not _nonempty_str(row.get(k))]
    if missing:
        raise ValueError(f"{where}: edit request needs non-empty string field(s) {missing}")
    row = {**row, "paraphrase_prompts": row.get("paraphrase_prompts", []), "neighborhood": row.get("neighborhood", [])}
    para = row["paraphrase_prompts"]
    if not isinstance(para, list) or not all(_nonempty_str(q) for q in para):
        raise ValueError(f"{where}: paraphrase_prompts must be a list of non-empty strings, got {para!r:.80}")
    nb = row["neighborhood"]
    if not isinstance(nb, list) or not all(isinstance(n, dict) and _nonempty_str(n.get("prompt"))
                                           and _nonempty_str(n.get("target")) for n in nb):
        raise ValueError(f"{where}: neighborhood must be a list of {{\"prompt\": ..., \"target\": ...}} objects "
                         f"of non-empty strings, got {nb!r:.80}")
    if row.get("target_true") is not None and not _nonempty_str(row["target_true"]):
        raise ValueError(f"{where}: target_true must be a non-empty string, got {row['target_true']!r:.80}")
    if row.get("target_true") is not None and row["target_true"] == row["target_new"]:
        raise ValueError(f"{where}: target_new equals target_true ({row['target_new']!r:.80}): an edit must change the "
                         "answer")
    subject = row.get("subject")
    if subject is not None and (not _nonempty_str(subject) or subject not in row["prompt"]):
        raise ValueError(f"{where}: subject must be a non-empty string that occurs in prompt (its last token is "
                         f"where the edit keys), got subject={subject!r:.80} and prompt={row['prompt']!r:.80}")
    return row


def read_requests(path: str | Path) -> list[dict[str, Any]]:
    """Edit requests from a jsonl file, each checked by `check_request`; a bad row or a
    malformed line -> ValueError naming the file and line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"edit requests file {path} does not exist")
    out = []
    for lineno, line in jsonl_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, very deep nesting
            raise ValueError(f"{path}:{lineno}: cannot be read as JSON ({e})") from None
        out.append(check_request(row, f"{path}:{lineno}"))
    if not out:
        raise ValueError(f"{path}: no edit requests")
    return out
