"""Lazy attributes for a package's `__init__`: its submodules on first use
(`dpax.models.layers` without importing it first), and names it exports from
them, imported only when asked for. A package's `__init__` then imports none
of its own modules, so importing one submodule never runs the others."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy(package: str, exports: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports` maps a name to the
    module that defines it; any other name is tried as `package.<name>`."""
    exports = dict(exports or {})

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__
