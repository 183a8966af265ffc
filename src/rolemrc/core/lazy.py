"""Packages whose public names import their (torch-heavy) modules on first use, so importing a light submodule
(a spec, a table) or building the CLI imports no torch."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterable, Mapping


class LazyPackage(types.ModuleType):
    """A package module whose names in `_lazy` (name -> module) are imported when first read."""

    def __getattr__(self, name: str) -> object:
        module = self.__dict__["_lazy"].get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name: str, value: object) -> None:
        # importing submodule `bake` binds the package's `bake` to it; the package's public `bake` is the function
        if isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}" and name in self.__dict__["_lazy"]:
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_package(package: str, exports: Mapping[str, Iterable[str]]) -> None:
    """Make `package` (its `__name__`) a LazyPackage exporting each module's names (module -> names) on first use."""
    module = sys.modules[package]
    module.__dict__["_lazy"] = {name: mod for mod, names in exports.items() for name in names}
    module.__class__ = LazyPackage
