"""Synthetic configurable-safety data for reward-model miniatures (CSRM's setting).

A *safety configuration* lists the harm categories a deployment allows. A response names its
category and has a severity (0 = harmless, 1..3 = increasingly specific help); it complies
with a configuration when its severity is 0 or its category is allowed. One (request,
response) thus has opposite labels under a permissive and a restrictive configuration,
which is what configuration-targeted augmentation exploits (`augment`): for each
(request, response) it draws configurations that allow and that forbid the response's
category, relabels compliance under each, and adds ranking pairs that keep the severity
order under a configuration that forbids the category (a less severe response ranks above
a more severe one) and put a compliant response above a non-compliant one.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

CATEGORIES = ("weapons", "drugs", "hacking", "medical")
SEVERITY_WORDS = ("a safety note", "background", "detailed steps", "full instructions")
TOPICS = {
    "weapons": ("building a rifle", "making a blade", "modding a crossbow"),
    "drugs": ("making a sedative", "growing a plant extract", "mixing stimulants"),
    "hacking": ("cracking a wifi key", "bypassing a login", "reading a locked phone"),
    "medical": ("dosing a painkiller", "stitching a wound", "treating a burn"),
}


@dataclasses.dataclass(frozen=True)
class SafetyItem:
    request: str
    response: str
    category: str
    severity: int


def items(seed: int = 0, n: int | None = None) -> list[SafetyItem]:
    """Every (category, topic, severity) item, shuffled; ``n`` of them when given."""
    out = []
    for cat, topics in TOPICS.items():
        for topic in topics:
            for sev, words in enumerate(SEVERITY_WORDS):
                out.append(SafetyItem(f"{topic}?", f"{words} ({cat})", cat, sev))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(out))
    out = [out[i] for i in order]
    return out if n is None else out[:n]


def config_text(allowed: frozenset[str]) -> str:
    allowed_list = " ".join(c for c in CATEGORIES if c in allowed) or "none"
    return f"allow: {allowed_list}"


def compliant(item: SafetyItem, allowed: frozenset[str]) -> bool:
    return item.severity == 0 or item.category in allowed


def all_configs() -> list[frozenset[str]]:
    return [frozenset(c) for r in range(len(CATEGORIES) + 1) for c in itertools.combinations(CATEGORIES, r)]


def rm_input(config: frozenset[str], item: SafetyItem) -> str:
    """What the reward model reads: the configuration, the conversation, the response."""
    return f"{config_text(config)}\nQ: {item.request}\nA: {item.response}"


def augment(base: list[SafetyItem], configs: list[frozenset[str]], *, per_item: int = 4, seed: int = 0
            ) -> tuple[list[tuple[str, bool]], list[tuple[str, str]]]:
    """Configuration-targeted augmentation. Returns ``points`` (input text, compliant) and
    ``pairs`` (preferred input, rejected input): for each item, ``per_item`` configurations
    from ``configs``, half allowing and half forbidding its category where possible; under
    each forbidding one, the item ranks below every less severe item of its topic."""
    rng = np.random.default_rng(seed)
    by_topic: dict[str, list[SafetyItem]] = {}
    for it in base:
        by_topic.setdefault(it.request, []).append(it)
    points, pairs = [], []
    for it in base:
        allow = [c for c in configs if it.category in c]
        forbid = [c for c in configs if it.category not in c]
        chosen = []
        for k in range(per_item):
            pool = allow if (k % 2 == 0 and allow) or not forbid else forbid
            chosen.append(pool[int(rng.integers(len(pool)))])
        for c in chosen:
            points.append((rm_input(c, it), compliant(it, c)))
            if it.category in c:
                continue
            for other in by_topic[it.request]:
                if other.severity < it.severity:  # severity order under a forbidding configuration
                    pairs.append((rm_input(c, other), rm_input(c, it)))
    return points, pairs
