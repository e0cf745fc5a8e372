"""String-keyed registries: how variants plug in without touching their callers.

Layers (attention, MLP, RoPE), RL pieces (advantage estimators, policy losses,
aggregators, KL estimators, rewards, collectors), token weights and training algorithms
are chosen by a config string. A
registry is a mapping with a ``register`` decorator and an error that lists the
known keys when a lookup fails.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@ATTENTION.register("softmax")``. Names are unique."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __getitem__(self, name: str) -> T:
        if not isinstance(name, str):  # None or a list: no close matches to look for (difflib fails)
            raise KeyError(f"unknown {self.kind} {name!r} (a name is a string); registered: {sorted(self._entries)}")
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(name, self._entries, n=3)
            hint = f" (did you mean {close}?)" if close else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}{hint}; registered: {sorted(self._entries)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"
