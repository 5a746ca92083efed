"""Typed config trees: dataclasses whose fields carry their help text, whose
nested groups are owned by the modules they configure, and from which the
command line and the YAML file are derived.

A config class holds scalar fields (`field`) and nested configs (`group`).
Each class checks its own fields in `check()`; `validate(tree)` checks every
field's type and runs every node's `check()`, children first, so a rule that
spans groups lives in the root's `check()`. Every scalar field has a flag
name, unique in its tree (the field's name unless it says otherwise), so the
command line stays flat (`dpax.cli.flags`) while the YAML nests
(`optimizer: {lr: ...}`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from collections.abc import Iterator
from typing import Any

from dpax.errors import DpaxError

F32_MAX = 3.4028234663852886e38  # the largest finite float32


def field(default: Any, help: str, *, how: bool = False, flag: str | None = None,
          **meta) -> Any:
    """A scalar config field. `how=True`: it changes how a run executes, not
    what it computes (beyond float rounding), so a resumed run may change it.
    `flag`: its command-line name when not the field's own. Other `meta`
    (metavar, nargs, const, required) goes to argparse."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "how": how, "flag": flag, **meta})


def group(cls: type) -> Any:
    """A nested config of class `cls`, its defaults by default."""
    return dataclasses.field(default_factory=cls, metadata={"group": True})


def is_group(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("group"))


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f.name


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One scalar field of a config tree, where it sits and what it accepts."""

    path: tuple[str, ...]  # attribute names from the root, e.g. ("optimizer", "lr")
    field: dataclasses.Field
    types: tuple[type, ...]  # the Python types it accepts (None aside)
    optional: bool  # None is a legal value

    @property
    def flag(self) -> str:
        return flag_name(self.field)

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def _types(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        optional = type(None) in typing.get_args(tp)
        out[name] = (tuple(args) + ((int,) if float in args else ()), optional)
    return out


def leaves(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every scalar field of the tree rooted at config class `cls`, in order."""
    types = _types(cls)
    for f in dataclasses.fields(cls):
        if is_group(f):
            yield from leaves(types[f.name][0][0], prefix + (f.name,))
        else:
            yield Leaf(prefix + (f.name,), f, *types[f.name])


def flags(cls: type) -> dict[str, Leaf]:
    """Flag name -> leaf; refuses a tree in which two fields share a flag."""
    out: dict[str, Leaf] = {}
    for leaf in leaves(cls):
        if leaf.flag in out:
            raise TypeError(f"{cls.__name__}: flag {leaf.flag!r} of {leaf.dotted} is also "
                            f"{out[leaf.flag].dotted}'s")
        out[leaf.flag] = leaf
    return out


def get(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def with_flags(config: Any, **values) -> Any:
    """A copy of `config` with fields set by flag name (`lr=0.1`, `devices=4`)."""
    by_flag = flags(type(config))
    unknown = sorted(set(values) - set(by_flag))
    if unknown:
        raise DpaxError(f"unknown field(s) {', '.join(unknown)} of {type(config).__name__}")
    nested = to_dict(config)
    for name, value in values.items():
        *parents, last = by_flag[name].path
        node = nested
        for p in parents:
            node = node[p]
        node[last] = value
    return from_dict(type(config), nested)


def to_dict(config: Any) -> dict:
    """The tree as nested dicts (what the YAML holds)."""
    return dataclasses.asdict(config)


def from_dict(cls: type, values: dict, where: str = "") -> Any:
    """A config of class `cls` from nested dicts; unknown or misplaced names
    are refused, naming where they are."""
    if not isinstance(values, dict):
        raise DpaxError(f"{where or cls.__name__} must be a mapping of field: value, "
                        f"got {values!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        at = f" in `{where}:`" if where else ""  # a YAML section (the colon: not a flag)
        raise DpaxError(f"unknown field(s) {', '.join(unknown)}{at}; known: "
                        f"{', '.join(known)}")
    types = _types(cls)
    kwargs = {}
    for name, value in values.items():
        if is_group(known[name]):
            value = from_dict(types[name][0][0], value, f"{where}.{name}".lstrip("."))
        kwargs[name] = value
    return cls(**kwargs)


def what_is_trained(config: Any) -> dict[str, Any]:
    """{flag: value} of the fields that define what is trained (not `how`)."""
    return {leaf.flag: get(config, leaf.path) for leaf in leaves(type(config))
            if not leaf.field.metadata["how"]}


def nodes(config: Any) -> Iterator[Any]:
    """Every config object of the tree, children before their parent."""
    for f in dataclasses.fields(config):
        if is_group(f):
            yield from nodes(getattr(config, f.name))
    yield config


def validate(config: Any) -> Any:
    """Check every field's type, then every node's own rules (`check()`),
    children first; returns `config`. Raises `DpaxError` naming the field."""
    for node in nodes(config):
        check_types(node)
    for node in nodes(config):
        if hasattr(node, "check"):
            node.check()
    return config


# -- the checks a config's `check()` uses ------------------------------------------------
def check_types(config: Any) -> None:
    """Each scalar field of this node holds a value of its annotated type."""
    types = _types(type(config))
    for f in dataclasses.fields(config):
        if is_group(f):
            continue
        value = getattr(config, f.name)
        expected, optional = types[f.name]
        if value is None and optional:
            continue
        ok = isinstance(value, expected) and not (isinstance(value, bool)
                                                  and bool not in expected)
        if not ok:
            raise DpaxError(f"`{flag_name(f)}` must be "
                            f"{' or '.join(t.__name__ for t in expected)}, got {value!r}")


def _flag(config: Any, name: str) -> str:
    return next((flag_name(f) for f in dataclasses.fields(config) if f.name == name), name)


def changed(config: Any, name: str) -> bool:
    """Whether `config`'s field `name` holds other than its default."""
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    return getattr(config, name) != field.default


def whole(config: Any, name: str, low: int = 1) -> None:
    """`config.name` is None or a whole number >= `low`."""
    value = getattr(config, name)
    if value is not None and value < low:
        raise DpaxError(f"`{_flag(config, name)}` must be a whole number >= {low}, "
                        f"got {value!r}")


def number(config: Any, name: str, low: float, high: float = math.inf, *,
           low_open: bool = False, high_open: bool = True) -> None:
    """`config.name` is None or a finite float32 in the given interval."""
    value = getattr(config, name)
    if value is None:
        return
    # Finite as the float32 the step computes in (1e39 is a Python float, not one).
    ok = abs(value) <= F32_MAX and (value > low if low_open else value >= low) and (
        value < high if high_open else value <= high)
    if not ok:
        where = f"{'>' if low_open else '>='} {low:g}" + (
            f" and {'<' if high_open else '<='} {high:g}" if math.isfinite(high) else "")
        raise DpaxError(f"`{_flag(config, name)}` must be a finite number {where}, "
                        f"got {value!r}")


def one_of(config: Any, name: str, choices) -> None:
    """`config.name` is one of `choices` (names, or a dict's keys)."""
    value = getattr(config, name)
    if value not in choices:
        raise DpaxError(f"unknown `{_flag(config, name)}` {value!r}; choose one of "
                        f"{', '.join(choices)}")


def directory(config: Any, name: str) -> None:
    """`config.name` is None or a path that is not an existing file."""
    path = getattr(config, name)
    if path is None:
        return
    flag = _flag(config, name)
    if not path.strip():
        raise DpaxError(f"`{flag}` is empty; give a directory path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise DpaxError(f"`{flag}={path}` is a file; give a directory path")


# -- YAML ----------------------------------------------------------------------------------
def to_yaml(config: Any) -> str:
    import yaml

    return yaml.safe_dump(to_dict(config), sort_keys=False)
