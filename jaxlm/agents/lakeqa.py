"""LakeQA-style search-centric QA over a data lake: search and read tools over csv, jsonl and
text files, multi-hop questions, exact-match scoring.

A `Lake` is a set of text files (relative path -> content), read from a directory
(`Lake.from_dir`) or generated (`generate_lake`). The agent sees it only through tools:

- ``search(query, limit=5)``: the lines containing every word of ``query`` (case-insensitive,
  whole words), as ``path:line: text``;
- ``read(path, start=1, lines=5)``: lines ``start..start+lines-1`` of one file;
- ``list_files()``: the paths.

The generated lake holds ``people.csv`` (name, company, role), ``companies.jsonl`` (company,
city, founded) and ``cities/<city>.txt`` (the city's country) drawn afresh per seed, so
answers must be looked up, not remembered. A question of ``hops`` = 1, 2 or 3 asks for a
person's company, that company's city, or that city's country; `expert_plan` gives the tool
calls that answer it (one search per hop), which `expert_trajectory` executes for SFT data.

Real benchmark files: `LakeQATask.from_files` takes a jsonl of ``{"question", "answer"}``
(``answer`` a string or a list of accepted strings; an optional ``"lake"`` names a
subdirectory of ``lake_dir`` per question) and the lake directory; scoring is the same exact
match (`exact_match`, SQuAD normalisation).
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import unicodedata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxlm.agents.loop import Episode, question_episode, read_rows
from jaxlm.agents.tools import Tool, Toolbox, tool

LAKE_SUFFIXES = (".csv", ".jsonl", ".json", ".txt", ".md", ".tsv")
_WORD = re.compile(r"(?:[^\W_]|[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f])+")
# letters and digits of any script, with the combining marks a decomposed letter carries


def _words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFC", text).casefold())

PEOPLE = ("Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kit", "Lu", "Max", "Ned", "Oz",
          "Pia", "Quinn", "Roy", "Sue", "Ty", "Una", "Vic", "Wes", "Xia", "Yul", "Zed")
COMPANIES = ("Acme", "Birch", "Cobalt", "Delta", "Ember", "Flint", "Garnet", "Helix", "Iris", "Jade", "Krypt",
             "Lumen")
CITIES = ("Oslo", "Lima", "Rome", "Kyiv", "Doha", "Baku", "Riga", "Suva", "Apia", "Bern", "Male", "Nuuk")
COUNTRIES = ("Norway", "Peru", "Italy", "Chile", "Qatar", "Spain", "Latvia", "Fiji", "Samoa", "Kenya", "Japan",
             "Nepal")
ROLES = ("clerk", "chef", "pilot", "nurse", "coder")


@dataclasses.dataclass(frozen=True)
class Lake:
    """Text files by relative posix path."""

    files: dict[str, str]

    @classmethod
    def from_dir(cls, root: str | Path, *, max_bytes: int = 10_000_000) -> "Lake":
        """Every file under ``root`` with a suffix in `LAKE_SUFFIXES` (UTF-8)."""
        root = Path(root)
        if not root.is_dir():
            raise ValueError(f"lake directory {root} does not exist" if not root.exists() else f"{root} is not a directory")
        files, total = {}, 0
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.suffix.lower() in LAKE_SUFFIXES:
                text = p.read_text(encoding="utf-8", errors="replace")
                total += len(text)
                if total > max_bytes:
                    raise ValueError(f"lake {root} holds more than max_bytes={max_bytes} of text")
                files[p.relative_to(root).as_posix()] = text
        if not files:
            raise ValueError(f"lake directory {root} has no {'/'.join(LAKE_SUFFIXES)} files")
        return cls(files)

    def write(self, root: str | Path) -> Path:
        root = Path(root)
        for rel, text in self.files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text, encoding="utf-8")
        return root

    def search(self, query: str, limit: int = 5) -> list[str]:
        """Lines holding every word of ``query`` as a whole word, case-folded and compared in
        NFC (a file written with decomposed accents, "Zoe" + U+0308, matches "Zoë" and not "Zoe")."""
        words = _words(query)
        if not words:
            raise ValueError("search needs at least one word")
        hits = []
        for path, text in sorted(self.files.items()):
            for i, line in enumerate(text.splitlines(), 1):
                if set(words) <= set(_words(line)):
                    hits.append(f"{path}:{i}: {line}")
        return hits[:limit]


def lake_tools(lake: Lake) -> list[Tool]:
    """``search``, ``read`` and ``list_files`` over ``lake``."""

    @tool
    def search(query: str, limit: int = 5) -> str:
        """Lines of the lake containing every word of the query, as path:line: text."""
        if limit <= 0:
            raise ValueError("limit must be > 0")
        return "\n".join(lake.search(query, limit)) or "no match"

    @tool
    def read(path: str, start: int = 1, lines: int = 5) -> str:
        """Lines start..start+lines-1 of one file."""
        if path not in lake.files:
            raise ValueError(f"no file {path!r}; list_files() gives the paths")
        if start < 1 or lines < 1:
            raise ValueError("start and lines must be >= 1")
        rows = lake.files[path].splitlines()
        return "\n".join(f"{i}: {rows[i - 1]}" for i in range(start, min(start + lines, len(rows) + 1))) or "(end)"

    @tool
    def list_files() -> str:
        """The paths of the lake's files."""
        return "\n".join(sorted(lake.files))

    return [search, read, list_files]


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces; first the
    Unicode NFC form, as the lake's search reads text (a decomposed "Zoë" copied from a tool's
    output scored 0 against the composed gold)."""
    text = unicodedata.normalize("NFC", text)
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: str | Sequence[str]) -> float:
    golds = [answers] if isinstance(answers, str) else list(answers)
    return float(any(normalize_answer(prediction) == normalize_answer(g) for g in golds))


def generate_lake(seed: int, *, n_people: int = 8, n_companies: int = 4) -> tuple[Lake, dict[str, Any]]:
    """A lake and its facts: ``{"company": {person: company}, "city": {company: city},
    "country": {city: country}}``."""
    if not 1 <= n_companies <= min(len(COMPANIES), len(CITIES)) or not 1 <= n_people <= len(PEOPLE):
        raise ValueError(f"n_people={n_people} must be in [1, {len(PEOPLE)}], n_companies={n_companies} in "
                         f"[1, {min(len(COMPANIES), len(CITIES))}]")
    rng = np.random.default_rng([seed, 7])
    people = [PEOPLE[i] for i in rng.choice(len(PEOPLE), n_people, replace=False)]
    companies = [COMPANIES[i] for i in rng.choice(len(COMPANIES), n_companies, replace=False)]
    cities = [CITIES[i] for i in rng.choice(len(CITIES), n_companies, replace=False)]
    countries = {c: COUNTRIES[i] for c, i in zip(cities, rng.choice(len(COUNTRIES), n_companies, replace=False))}
    company = {p: companies[int(rng.integers(n_companies))] for p in people}
    city = dict(zip(companies, cities))
    files = {"people.csv": "name,company,role\n" + "".join(
        f"{p},{company[p]},{ROLES[int(rng.integers(len(ROLES)))]}\n" for p in people)}
    files["companies.jsonl"] = "".join(json.dumps({"company": c, "city": city[c], "founded": int(rng.integers(1900, 2020))})
                                       + "\n" for c in companies)
    for c in cities:
        files[f"cities/{c.lower()}.txt"] = f"{c} is a city in the country of {countries[c]}.\n"
    return Lake(files), {"company": company, "city": city, "country": countries, "people": people}


QUESTIONS = {1: "Which company does {p} work for?", 2: "In which city is the company of {p}?",
             3: "In which country is the company of {p}?"}


def expert_plan(facts: dict[str, Any], person: str, hops: int) -> tuple[list[tuple[str, dict]], str]:
    """The searches that answer a question (one per hop) and the answer."""
    company = facts["company"][person]
    plan = [("search", {"query": person})]
    answer = company
    if hops >= 2:
        plan.append(("search", {"query": f"{company} city"}))
        answer = facts["city"][company]
    if hops >= 3:
        plan.append(("search", {"query": f"{answer} country"}))
        answer = facts["country"][answer]
    return plan, answer


SYSTEM = ("Answer from the files. Tools: search(query), read(path, start, lines), list_files(). "
          "Write one tool call per line as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
          "when you know the answer, reply with the answer alone.")


@dataclasses.dataclass(frozen=True)
class LakeQATask:
    """Generated LakeQA episodes: episode ``i`` is a fresh lake (seed ``(seed, i)``) and one
    question of ``hops`` hops about one of its people. ``system``: the system prompt."""

    seed: int = 0
    hops: int = 2
    n_people: int = 8
    n_companies: int = 4
    system: str = SYSTEM

    def __post_init__(self):
        if self.hops not in QUESTIONS:
            raise ValueError(f"LakeQATask.hops={self.hops!r} must be one of {sorted(QUESTIONS)}")

    def instance(self, index: int) -> dict[str, Any]:
        lake, facts = generate_lake(self.seed * 1_000_003 + index, n_people=self.n_people,
                                    n_companies=self.n_companies)
        rng = np.random.default_rng([self.seed, index, 11])
        person = facts["people"][int(rng.integers(len(facts["people"])))]
        plan, answer = expert_plan(facts, person, self.hops)
        return {"lake": lake, "question": QUESTIONS[self.hops].format(p=person), "answer": answer, "plan": plan}

    def episode(self, index: int) -> Episode:
        inst = self.instance(index)
        return question_episode(self.system, inst["question"], Toolbox(lake_tools(inst["lake"])),
                                lambda a, gold=inst["answer"]: exact_match(a, gold),
                                {"index": index, "answer": inst["answer"]})

    @staticmethod
    def from_files(questions: str | Path, lake_dir: str | Path, *, system: str = SYSTEM) -> "LakeQAFiles":
        return LakeQAFiles(str(questions), str(lake_dir), system)


class LakeQAFiles:
    """LakeQA episodes from benchmark files (see the module docstring); the questions are read
    and checked once, each episode's lake when the episode is made."""

    def __init__(self, questions: str, lake_dir: str, system: str = SYSTEM):
        self.questions, self.lake_dir, self.system = questions, lake_dir, system
        self._rows = read_rows(questions, {"question": str, "answer": (str, list)})
        for n, row in enumerate(self._rows, 1):  # the optional sub-directory of the lake, checked now
            if row.get("lake") is not None and not isinstance(row["lake"], str):
                raise ValueError(f"{questions}: row {n}: 'lake' must be a directory name (a string), "
                                 f"got {type(row['lake']).__name__}")

    def __len__(self) -> int:
        return len(self._rows)

    def episode(self, index: int) -> Episode:
        row = self._rows[index]
        root = Path(self.lake_dir) / row["lake"] if row.get("lake") else Path(self.lake_dir)
        return question_episode(self.system, row["question"], Toolbox(lake_tools(Lake.from_dir(root))),
                                lambda a, gold=row["answer"]: exact_match(a, gold),
                                {"index": index, "answer": row["answer"]})


def expert_trajectory(task: LakeQATask, index: int) -> dict[str, Any]:
    """Episode ``index`` solved by its expert plan, each observation the tool's real output:
    an SFT example in the agentic-data format."""
    inst = task.instance(index)
    box = Toolbox(lake_tools(inst["lake"]))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": task.system},
                                  {"role": "user", "content": inst["question"]}]
    for name, args in inst["plan"]:
        result = box.call(name, args)
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        msgs.append({"role": "tool", "name": name, "content": result.content})
    msgs.append({"role": "assistant", "content": inst["answer"]})
    return {"messages": msgs}
