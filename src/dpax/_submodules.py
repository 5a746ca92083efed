"""A package's submodules as attributes on first use (`dpax.models.layers`
without importing it first), as `import` would give them."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType


def lazy_submodules(package: str) -> Callable[[str], ModuleType]:
    """A module `__getattr__` for `package` that imports `package.<name>`."""

    def __getattr__(name: str) -> ModuleType:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
