"""`dpax prepare SRC DEST`: examples (.npz, Parquet, a saved Hugging Face
dataset) written once as ArrayRecord shards that a run's data, DEST, streams;
or the windows of text (`dpax.data.text_shards`).

Each example is one record, msgpack {"x": array, "y": label} (Flax's
serialization), in the stored dtype (uint8 images stay uint8); records are
written one per chunk (`group_size:1`), so a random read reads one example.
Beside the shards: `dpax.json` (count, shapes, shard names) and `labels.npy`
(every label, in order: the task, class count and split are known without
reading the images). DEST appears only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable

import numpy as np

from dpax.data import sources, text, text_shards, tokenizer
from dpax.data.datasets import labelled, read_npz
from dpax.errors import DpaxError

SHARD_BYTES = 256 << 20  # of inputs per shard: many shards, each a size a copy handles well
WRITE_OPTIONS = "group_size:1,uncompressed"  # a random read reads one example's bytes
CHUNK_ROWS = 4096  # read from the source at a time: memory stays small for any dataset


def open_source(src: str, x_column: str = "x", y_column: str = "y"):
    """The table `src` names: an .npz (loaded), or what `sources.open_table` reads."""
    takes = ("dpax prepare takes an .npz, Parquet file(s) (a file, a directory or a glob) "
             "or a saved Hugging Face dataset's directory")
    if not (os.path.exists(src) or any(ch in src for ch in "*?[")):
        raise DpaxError(f"{src!r} does not exist; {takes}")
    if src.endswith(".npz"):
        arrays = read_npz(src, (x_column, y_column))
        return sources.ArrayTable(arrays[x_column], src, arrays[y_column])
    if not sources.is_streamed(src):
        raise DpaxError(f"cannot read {src!r}; {takes}")
    return sources.open_table(src, x_column, y_column)


def prepare(src: str, dest: str, x_column: str = "x", y_column: str = "y",
            shard_bytes: int = SHARD_BYTES, progress: bool = True) -> dict:
    """Write `src`'s examples, in order, as ArrayRecord shards in `dest`;
    returns the dpax.json written."""
    table = open_source(src, x_column, y_column)
    labelled(src, sources.Column(table), table.y)  # the checks training would make, first
    chunks = (table.read(np.arange(lo, min(lo + CHUNK_ROWS, len(table))))
              for lo in range(0, len(table), CHUNK_ROWS))
    return write_shards(dest, chunks, table.y, shard_bytes, progress)


def prepare_text(path: str | None, dest: str, seq_len: int,
                 tokenizer_spec: str = tokenizer.BYTES, packed: bool = False,
                 tok: tokenizer.Tokenizer | None = None, progress: bool = True) -> dict:
    """Write the windows `dpax.data.text` cuts of the text under `path`
    (None: the standard library's sources), in the tokens of `tok` (default:
    `tokenizer_spec`'s, trained on the text), to `dest` for
    `dpax.data.text_shards` to stream; returns the dpax.json written."""
    tokenizer.check_spec(tokenizer_spec)
    check_new(dest)  # before the text is read and tokenized
    name, x_train, y_train, x_eval, y_eval, tok = text.load(path, seq_len, tokenizer_spec,
                                                            tok, packed)
    held_out = 0 if x_eval is x_train else len(x_eval)  # none: evaluate on the training set
    x = np.concatenate([x_train, x_eval[:held_out]])
    y = np.concatenate([y_train, y_eval[:held_out]])
    real = (y > 0).sum(1).astype(np.int32) if packed else y  # tokens per window
    # Stored in the fewest bytes that hold them (read back as int32): segment
    # ids as int32 took 4x the tokens' own space.
    y = y.astype(np.min_scalar_type(int(y.max(initial=0))))
    info = {"source": name, "seq_len": seq_len, "tokenizer": tokenizer_spec,
            "packed": packed, "train_examples": len(x_train)}
    files = {text_shards.TOKENIZER: tok.to_json()} if tok.hf is not None else {}
    chunks = (x[lo:lo + CHUNK_ROWS] for lo in range(0, len(x), CHUNK_ROWS))
    return write_shards(dest, chunks, y, progress=progress, labels=real,
                        extra={"text": info}, files=files)


def check_new(dest: str) -> None:
    """Refuse a `dest` that holds anything: shards are written to a new directory."""
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise DpaxError(f"{dest} already exists; give a new directory (nothing was written)")


def write_shards(dest: str, x_chunks: Iterable[np.ndarray], y: np.ndarray,
                 shard_bytes: int = SHARD_BYTES, progress: bool = True,
                 labels: np.ndarray | None = None, extra: dict | None = None,
                 files: dict[str, str] | None = None) -> dict:
    """Examples given as consecutive chunks of inputs (any sizes; together
    `len(y)` rows) and their labels, as shards in `dest`. Generated data can
    be written without ever being whole in memory.

    `labels` is what labels.npy holds, one value per example (default: `y`;
    text keeps its windows' lengths there, not each token's segment id);
    `extra` goes into dpax.json, `files` (name: text) beside it."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from flax import serialization
    from tqdm import tqdm

    check_new(dest)
    n = len(y)
    partial = dest.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # a conversion that died half way
    os.makedirs(partial)
    meta, writer, shard, per_shard = None, None, -1, 1
    bar = tqdm(total=n, unit="ex", desc=f"writing {dest}", disable=not progress)
    try:
        i = 0
        for chunk in x_chunks:
            if meta is None:
                shape, dtype = chunk.shape[1:], chunk.dtype
                per_shard = max(1, shard_bytes // max(chunk[:1].nbytes, 1))
                count = math.ceil(n / per_shard)
                names = [f"data-{k:05d}-of-{count:05d}{sources.SUFFIX}" for k in range(count)]
                meta = {"format": sources.FORMAT, "examples": n, "x_shape": list(shape),
                        "x_dtype": dtype.str, "y_dtype": y.dtype.str,
                        "y_shape": list(y.shape[1:]), "shards": names,
                        "shard_examples": [min(per_shard, n - k * per_shard)
                                           for k in range(count)], **(extra or {})}
            if chunk.shape[1:] != shape or chunk.dtype != dtype:
                raise DpaxError(f"examples of shape {chunk.shape[1:]} {chunk.dtype} after "
                                f"{shape} {dtype}; every example needs one shape and dtype")
            for row in chunk:
                if i == n:
                    raise DpaxError(f"more inputs than the {n} labels")
                if i // per_shard != shard:
                    if writer is not None:
                        writer.close()
                    shard = i // per_shard
                    writer = ArrayRecordWriter(os.path.join(partial, names[shard]),
                                               WRITE_OPTIONS)
                writer.write(serialization.msgpack_serialize({"x": row, "y": y[i]}))
                i += 1
            bar.update(len(chunk))
        if i != n:
            raise DpaxError(f"{i} inputs for {n} labels; give one input per label")
        if writer is not None:
            writer.close()
            writer = None
        np.save(os.path.join(partial, sources.LABELS), y if labels is None else labels)
        for name, content in (files or {}).items():
            with open(os.path.join(partial, name), "w") as f:
                f.write(content)
        with open(os.path.join(partial, sources.META), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty (checked above)
        os.rename(partial, dest)
    except BaseException:
        if writer is not None:
            writer.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        bar.close()
    return meta
