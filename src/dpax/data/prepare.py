"""`dpax prepare SRC DEST`: examples (.npz, Parquet, a saved Hugging Face
dataset) written once as ArrayRecord shards that a run's data, DEST, streams.

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

from dpax.data import sources
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


def write_shards(dest: str, x_chunks: Iterable[np.ndarray], y: np.ndarray,
                 shard_bytes: int = SHARD_BYTES, progress: bool = True) -> dict:
    """Examples given as consecutive chunks of inputs (any sizes; together
    `len(y)` rows) and their labels, as shards in `dest`. Generated data can
    be written without ever being whole in memory."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from flax import serialization
    from tqdm import tqdm

    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise DpaxError(f"{dest} already exists; give a new directory (nothing was written)")
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
                        "x_dtype": dtype.str, "y_dtype": y.dtype.str, "shards": names,
                        "shard_examples": [min(per_shard, n - k * per_shard)
                                           for k in range(count)]}
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
        np.save(os.path.join(partial, sources.LABELS), y)
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
