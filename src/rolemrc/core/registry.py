"""A tiny name -> object registry filled by a decorator, for pluggable pieces (metrics, judges).

    from rolemrc.core.registry import Registry

    THINGS = Registry("thing")

    @THINGS.register("one")
    def one(x): ...

An entry with metadata is a small frozen dataclass holding the function and its fields (eval's `Metric`: scale,
higher_is_better; `Judge`: endpoint), registered by its package's own decorator (`@metric(name, scale=...)`).
Every list of names a user sees (CLI help, error messages, defaults) reads `names()`, so adding an entry
is one decorated definition; `get` of an unknown name raises `UnknownNameError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from rolemrc.core.errors import RolemrcError

T = TypeVar("T")


class UnknownNameError(RolemrcError, ValueError):
    """A name no entry of a registry has; the message lists the known names."""


class Registry(Generic[T]):
    """Entries by name, in registration order; `kind` names them in messages ("metric", "judge")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding the decorated object under `name` (a name may be registered once)."""
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry
        return add

    def unregister(self, name: str) -> T:
        """Remove and return the entry `name` (plugins and tests that clean up after themselves)."""
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        self.check([name])
        return self._entries[name]

    def check(self, names: Iterable[str]) -> tuple[str, ...]:
        """`names` as a tuple, or UnknownNameError naming every unknown one."""
        names = tuple(names)
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            which = f"{self.kind}s {', '.join(map(repr, unknown))}" if len(unknown) > 1 else f"{self.kind} {unknown[0]!r}"
            raise UnknownNameError(f"unknown {which}; choose from {self.listing()}")
        return names

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def listing(self, sep: str = ", ") -> str:
        """The known names joined by `sep`, for help texts and messages."""
        return sep.join(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
