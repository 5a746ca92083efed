"""Command-line flags derived from a config tree (`dpax.config`): one `--flag`
per scalar field, with the field's default and help; the values of a command
line are defaults < a `--config` YAML file < the flags given."""

from __future__ import annotations

import argparse
from typing import Any

from dpax import config as cfg
from dpax.cli.exits import as_flags
from dpax.errors import DpaxError


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag` per scalar field of the tree rooted at `cls`."""
    for leaf in cfg.flags(cls).values():
        f, tp = leaf.field, leaf.types[0]
        meta = f.metadata
        helptext = as_flags(meta.get("help", ""))  # a config's help names arguments
        if f.default is not None and "(default: " not in helptext:  # a help may say it better
            helptext += f" (default: {f.default})"
        flag = "--" + leaf.flag.replace("_", "-")
        helptext = helptext.replace("%", "%%")  # argparse %-formats every help string
        # dest is the flag, default None everywhere: an unset flag leaves the
        # config's default in charge.
        common = {"dest": leaf.flag, "default": None, "help": helptext}
        if "nargs" in meta:  # e.g. --resume [PATH]
            parser.add_argument(flag, nargs=meta["nargs"], const=meta["const"],
                                metavar="PATH", **common)
        elif meta.get("repeat"):  # --tracker a --tracker b: joined as "a,b"
            parser.add_argument(flag, action="append", metavar=meta.get("metavar", "NAME"),
                                **common)
        elif tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            metavar = meta.get("metavar") or {int: "N", float: "X"}.get(tp, "NAME")
            parser.add_argument(flag, type=tp, metavar=metavar,
                                required=meta.get("required", False), **common)


def config_from_args(args: argparse.Namespace, cls: type) -> Any:
    """The config of a parsed command line (its `--config` file, if it has one)."""
    base = cls()
    path = getattr(args, "config", None)
    if path:
        loaded = read_yaml(path)  # its errors name the file already
        try:
            base = cfg.from_dict(cls, loaded)
        except DpaxError as e:
            raise DpaxError(f"--config {path}: {e}") from None
        except TypeError as e:
            raise DpaxError(f"--config {path}: {e}") from None
    given = {name: getattr(args, name) for name in cfg.flags(cls)
             if getattr(args, name, None) is not None}
    given = {k: ",".join(v) if isinstance(v, list) else v for k, v in given.items()}
    return cfg.with_flags(base, **given)


def flags_markdown(cls: type) -> str:
    """The flag table of a command, from its config tree, grouped as it nests."""
    lines = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for leaf in cfg.leaves(cls):
        f = leaf.field
        default = "" if f.default is None else f"`{f.default}`"
        meaning = as_flags(f.metadata["help"])
        lines.append(f"| `--{leaf.flag.replace('_', '-')}` | {default} | {meaning} |")
    return "\n".join(lines)


def read_yaml(path: str) -> dict:
    """A YAML file's mapping, with one-line errors for what is not one."""
    import yaml

    try:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
    except OSError as e:
        raise DpaxError(f"cannot read --config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise DpaxError(f"--config {path} is not a text file; give a YAML file such as a "
                        "run's config.yaml") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise DpaxError(f"--config {path} is not valid YAML{where}") from None
    if not isinstance(loaded, dict):
        raise DpaxError(f"--config {path} must hold a mapping of field: value")
    return loaded
