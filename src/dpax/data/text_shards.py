"""Text windows written once as ArrayRecord shards, then streamed.

`dpax prepare text:PATH DEST` (`dpax.data.prepare.prepare_text`) cuts the
text into the windows `dpax.data.text` makes in memory (the same documents
held out, the same tokenizer, packed or not) and writes one record per
window, {"x": its tokens, "y": its real length or, packed, its segment ids}:
the training windows first, then the held-out ones. A run with `data=DEST`
reads only the windows of each batch, so the text need not fit the memory
of the machines that train on it (only that of the one that prepares it),
and trains exactly what `data=text:PATH` trains: the same windows in the
same order.

Beside the shards, dpax.json's "text" entry says how the windows were cut
(`seq_len`, `tokenizer`, `pack`: a run must ask for the same) and how many are
for training; `tokenizer.json` holds a BPE.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from dpax.data import sources, tokenizer
from dpax.errors import DpaxError

TOKENIZER = "tokenizer.json"


KEYS = {"source": str, "seq_len": int, "tokenizer": str, "packed": bool, "train_examples": int}


def describe(name: str) -> dict | None:
    """The "text" entry of `name`'s dpax.json if `name` is a directory of
    prepared text, else None. Reads one small file. Shards of prepared text
    named without their directory (a glob) are refused: read as examples,
    their labels would be the windows' lengths."""
    if not os.path.isdir(name):
        if sources.is_streamed(name):
            shards = sorted(glob.glob(name))
            if shards and describe(os.path.dirname(shards[0]) or ".") is not None:
                raise DpaxError(f"`data={name}` names shards of prepared text; give their "
                                f"directory, {os.path.dirname(shards[0]) or '.'}")
        return None
    path = os.path.join(name, sources.META)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None  # the shards' own checks name what is wrong
    info = meta.get("text") if isinstance(meta, dict) else None
    if info is not None and not (isinstance(info, dict) and all(
            type(info.get(k)) is t for k, t in KEYS.items())):
        raise DpaxError(f"{path}: its \"text\" entry is damaged; write the text again with "
                        "dpax prepare")
    return info


def check_asked(name: str, info: dict, seq_len: int, tokenizer_spec: str, pack: bool) -> None:
    """Refuse a run that asks for windows other than those `name` holds: the
    shards are the windows, they are not cut again."""
    for arg, asked, held in (("seq_len", seq_len, info["seq_len"]),
                             ("tokenizer", tokenizer_spec, info["tokenizer"]),
                             ("pack", pack, info["packed"])):
        if asked != held:
            raise DpaxError(f"`data={name}` holds windows prepared with `{arg}={held}`, and "
                            f"the run asks for `{arg}={asked}`; give `{arg}={held}`, or "
                            "prepare the text again as you want it")


def load(name: str, info: dict, tok: tokenizer.Tokenizer | None = None):
    """The prepared windows of `name` as `text.load` gives them in memory:
    `(name, x_train, y_train, x_eval, y_eval, tokenizer)`, each split a
    `sources.Column` read per batch. `tok`, if given (a pretrained model's),
    must be the tokenizer the text was prepared with."""
    saved = None
    if tokenizer.check_spec(info["tokenizer"]) is not None:
        try:
            with open(os.path.join(name, TOKENIZER)) as f:
                saved = f.read()
        except OSError as e:
            raise DpaxError(f"{name}: its {TOKENIZER} is unreadable ({e.strerror}); write "
                            "the text again with dpax prepare") from None
    prepared = tokenizer.from_json(info["tokenizer"], saved)
    if tok is not None and tok.to_json() != prepared.to_json():
        raise DpaxError(f"`data={name}` was prepared with another tokenizer than the "
                        "model's; prepare the text again with the model's tokenizer")
    tok = prepared
    x_table = sources.open_table(name, "x", None)
    y_table = _Int32(sources.open_table(name, "y", None))
    n, n_train = len(x_table), info["train_examples"]
    seq = info["seq_len"] + 1
    if (x_table.x_shape != (seq,) or y_table.x_shape != ((seq,) if info["packed"] else ())
            or not 0 < n_train <= n):
        raise DpaxError(f"{name}: its dpax.json does not describe its shards (windows of "
                        f"{x_table.x_shape} tokens, {n} of them); write the text again with "
                        "dpax prepare")
    train, held = np.arange(n_train), np.arange(n_train, n)
    if len(held) == 0:
        held = train

    def column(table, rows):
        return sources.Column(table, rows, decoded=False)

    return (name, column(x_table, train), column(y_table, train), column(x_table, held),
            column(y_table, held), tok)


class _Int32:
    """A table's values read as int32, what `text.load` gives for `y`
    (`dpax prepare` stores them in fewer bytes)."""

    x_dtype = np.dtype(np.int32)

    def __init__(self, table):
        self.table, self.name, self.x_shape = table, table.name, table.x_shape

    def __len__(self) -> int:
        return len(self.table)

    def read(self, idx: np.ndarray) -> np.ndarray:
        return self.table.read(idx).astype(np.int32)
