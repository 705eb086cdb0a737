"""Name → implementation registries (advantage estimators, losses, rewards, trackers, ...).

One small class so every extension point behaves the same: `@REG.register("name")` adds an entry, `REG["name"]`
looks it up and a miss raises a `KeyError` listing the registered names (with a "did you mean" hint).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A dict-like of named implementations with a helpful error on a miss."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, *aliases: str, override: bool = False) -> Callable[[T], T]:
        """Decorator: `@REG.register("name", "alias")` registers the decorated object under each name."""

        def deco(obj: T) -> T:
            for key in (name, *aliases):
                if key in self._items and not override:
                    raise ValueError(f"{self.kind} {key!r} is already registered; pass override=True to replace it")
                self._items[key] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            hint = difflib.get_close_matches(name, self._items, n=1)
            did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
            raise KeyError(
                f"unknown {self.kind} {name!r}.{did_you_mean} Registered: {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        return sorted(self._items)
