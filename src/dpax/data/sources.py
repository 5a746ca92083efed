"""Examples read by index from disk: ArrayRecord shards (what `dpax prepare`
writes), Parquet files, and Hugging Face datasets saved with `save_to_disk`.

Each is a random-access table in Grain's sense (a length, rows read by index),
so a global shuffle never loads the dataset and a process reads only the rows
of its part of each global batch. Labels are small and are read whole (they
decide the task, the class count and the split); inputs stay on disk and are
read per batch through `Column`, which looks like an array to the pipeline
and decodes what it reads: uint8 images become float32 in [0, 1].
"""

from __future__ import annotations

import functools
import glob
import json
import os

import numpy as np

from dpax.errors import DpaxError

FORMAT = "dpax-array-record/1"  # the `format` of the dpax.json `dpax prepare` writes
META = "dpax.json"
LABELS = "labels.npy"
SUFFIX = ".array_record"
HF_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes (one split, all)


def decode(x: np.ndarray) -> np.ndarray:
    """Stored inputs as the model's float32: uint8 (images) scaled to [0, 1]."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255)
    return x.astype(np.float32)


class Column:
    """The inputs of some rows of a table, as a read-only array: indexing with
    an index array (or a slice) reads those rows and decodes them (`decode`;
    `decoded=False` keeps the stored values, e.g. token ids)."""

    def __init__(self, table, rows: np.ndarray | None = None, decoded: bool = True):
        self.table, self.decoded = table, decoded
        self._rows = np.arange(len(table)) if rows is None else rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self._rows),) + tuple(self.table.x_shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.decoded else np.dtype(self.table.x_dtype)

    ndim = property(lambda self: len(self.shape))

    @property
    def on_disk(self) -> bool:
        """Whether a read waits for storage (worth reading ahead)."""
        return not isinstance(self.table, ArrayTable)

    def __len__(self) -> int:
        return len(self._rows)

    def subset(self, idx: np.ndarray) -> Column:
        """A view of rows `idx` of this column; nothing is read."""
        return Column(self.table, self._rows[idx], self.decoded)

    def __getitem__(self, idx) -> np.ndarray:
        rows = self._rows[idx]
        if np.ndim(rows) != 1:
            raise TypeError("a Column is read with an index array or a slice")
        if len(rows) == 0:  # e.g. a process whose part of a short batch is all padding
            return np.zeros((0,) + tuple(self.table.x_shape), self.dtype)
        values = self.table.read(rows)
        return decode(values) if self.decoded else values


class ArrayTable:
    """Inputs in memory, kept as stored (uint8 images take a quarter of
    float32's memory) and decoded per batch like the streamed formats."""

    def __init__(self, x: np.ndarray, name: str, y: np.ndarray | None = None):
        self.x, self.name, self.x_shape, self.y = x, name, x.shape[1:], y
        self.x_dtype = x.dtype

    def __len__(self) -> int:
        return len(self.x)

    def read(self, idx: np.ndarray) -> np.ndarray:
        return self.x[idx]


def _check_shape(got: tuple, want: tuple, where: str) -> None:
    if tuple(got) != tuple(want):
        raise DpaxError(f"{where}: examples of shape {tuple(got)} and {tuple(want)}; every "
                        "example needs the same shape")


def _stack(arrays: list[np.ndarray], shape: tuple, where: str) -> np.ndarray:
    for a in arrays:
        _check_shape(a.shape, shape, where)
    return np.stack(arrays) if arrays else np.zeros((0,) + shape)


class ArrayRecordTable:
    """ArrayRecord shards written by `dpax prepare`: one msgpack record
    {"x": array, "y": label} per example, read through Grain's
    `ArrayRecordDataSource` (parallel reads of a batch's records)."""

    def __init__(self, paths: list[str], meta: dict, labels: np.ndarray, name: str,
                 key: str = "x"):
        import grain

        if key not in ("x", "y"):
            raise DpaxError(f"{name}: dpax prepare's records hold the columns x and y, not "
                            f"{key!r}; drop `x_column` or give x")
        self.name, self.key = name, key
        self.x_shape = tuple(meta["x_shape"] if key == "x" else meta.get("y_shape", ()))
        self.x_dtype = np.dtype(meta[f"{key}_dtype"])
        for path, count in zip(paths, meta["shard_examples"]):
            _check_shard(path, count)
        self._source = grain.sources.ArrayRecordDataSource(paths)
        if len(self._source) != meta["examples"] or len(labels) != meta["examples"]:
            raise DpaxError(f"{name}: {META} says {meta['examples']} examples, the shards hold "
                            f"{len(self._source)} and {LABELS} {len(labels)}; a shard is "
                            "missing or extra: write them again with dpax prepare")
        self.y = labels

    def __len__(self) -> int:
        return len(self._source)

    def read(self, idx: np.ndarray) -> np.ndarray:
        from flax import serialization

        try:
            records = self._source.__getitems__([int(i) for i in idx])
            xs = [np.asarray(serialization.msgpack_restore(r)[self.key]) for r in records]
        except Exception as e:
            raise DpaxError(f"{self.name}: a record cannot be read ({type(e).__name__}); "
                            "a shard is damaged: write them again with dpax prepare") from None
        return _stack(xs, self.x_shape, self.name).astype(self.x_dtype, copy=False)


def _check_shard(path: str, count: int) -> None:
    """A shard holds the records dpax.json says, and its first and last read:
    what a truncated copy or a damaged header breaks (damage inside is found
    when that record is read)."""
    from array_record.python.array_record_module import ArrayRecordReader
    from flax import serialization

    try:
        reader = ArrayRecordReader(path)
        try:
            n = reader.num_records()
            if n == count:
                for r in reader.read([0, n - 1]):
                    serialization.msgpack_restore(r)
        finally:
            reader.close()
    except Exception as e:  # the reader raises RuntimeError/ValueError on bad files
        raise DpaxError(f"shard {path} is damaged ({type(e).__name__}); copy it again or "
                        "write the shards again with dpax prepare") from None
    if n != count:
        raise DpaxError(f"shard {path} holds {n} examples, dpax.json says {count}; copy it "
                        "again or write the shards again with dpax prepare")


def _arrow_to_numpy(arr, where: str) -> np.ndarray:
    """An Arrow column of numbers or (nested) lists of numbers as one numpy
    array, examples first; every example must have the same shape."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n, shape = len(arr), []
    while True:
        if isinstance(arr.type, pa.ExtensionType):  # e.g. datasets' Array3D
            arr = arr.storage
        if arr.null_count:
            raise DpaxError(f"{where} has missing values; fill or drop them first")
        if pa.types.is_fixed_size_list(arr.type):
            shape.append(arr.type.list_size)
        elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            lengths = pc.list_value_length(arr)
            lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if lo != hi:
                raise DpaxError(f"{where} has examples of different sizes ({lo} to {hi} "
                                "values); every example needs the same shape")
            shape.append(lo or 0)
        else:
            break
        arr = arr.flatten()
    if not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)
            or pa.types.is_boolean(arr.type)):
        raise DpaxError(f"{where} holds {arr.type}, not numbers; store numbers "
                        "(images as uint8 arrays)")
    return arr.to_numpy(zero_copy_only=False).reshape((n, *shape))


class _ArrowTable:
    """Shared by the Arrow-backed formats: the label column read whole, the
    input column read by rows (`_rows`)."""

    def _setup(self, name: str, x_key: str, y_key: str | None):
        """Names, and the shape and dtype of an example (from the first)."""
        self.name, self.x_key, self.y_key = name, x_key, y_key
        self.x_shape = None  # `_rows` of the first example checks nothing yet
        first = self._rows(np.arange(1))
        self.x_shape, self.x_dtype = first.shape[1:], first.dtype

    def read(self, idx: np.ndarray) -> np.ndarray:
        return self._rows(idx)

    def _checked(self, x: np.ndarray) -> np.ndarray:
        if self.x_shape is not None:
            _check_shape(x.shape[1:], self.x_shape, self.name)
        return x


def _check_columns(names, x_key: str, y_key: str | None, where: str, flags: str) -> None:
    missing = [k for k in (x_key, y_key) if k is not None and k not in names]
    if missing:
        raise DpaxError(f"{where} has no column {missing[0]!r} (it has {', '.join(names)}); "
                        f"name the input and label columns with {flags}")


class ParquetTable(_ArrowTable):
    """Parquet files, read one row group at a time (a few kept decoded): small
    row groups make random access cheap; `dpax prepare` converts to
    ArrayRecord for the fastest reads."""

    def __init__(self, paths: list[str], x_key: str, y_key: str | None, name: str):
        import pyarrow.parquet as pq

        groups, ys = [], []
        for path in paths:
            try:
                f = pq.ParquetFile(path)
            except Exception as e:
                raise DpaxError(f"{path} is not a readable Parquet file ({type(e).__name__}); "
                                "write it again") from None
            _check_columns(f.schema_arrow.names, x_key, y_key, path, "`x_column`/`y_column`")
            for g in range(f.num_row_groups):
                groups.append((path, g, f.metadata.row_group(g).num_rows))
            if y_key is not None:
                ys.append(_arrow_to_numpy(f.read(columns=[y_key])[y_key], f"{path}: {y_key!r}"))
        self._groups = groups
        self._starts = np.cumsum([0] + [n for _, _, n in groups])
        if not groups:
            raise DpaxError(f"{name} holds no examples")
        self.y = np.concatenate(ys) if ys else None
        self._setup(name, x_key, y_key)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getstate__(self):  # for Grain workers: open files anew there
        return {k: v for k, v in self.__dict__.items() if k != "_group_cache"}

    def _group(self, g: int) -> np.ndarray:
        cache = self.__dict__.setdefault("_group_cache", functools.lru_cache(maxsize=4)(
            self._read_group))
        return cache(g)

    def _read_group(self, g: int) -> np.ndarray:
        import pyarrow.parquet as pq

        path, k, _ = self._groups[g]
        col = pq.ParquetFile(path).read_row_group(k, columns=[self.x_key])[self.x_key]
        return _arrow_to_numpy(col, f"{path}: column {self.x_key!r}")

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        groups = np.searchsorted(self._starts, idx, side="right") - 1
        out = None
        for g in np.unique(groups):  # one row group at a time: checked, then gathered
            rows = self._checked(self._group(int(g)))
            mine = np.flatnonzero(groups == g)
            if out is None:
                out = np.empty((len(idx),) + rows.shape[1:], rows.dtype)
            out[mine] = rows[idx[mine] - self._starts[g]]
        return out


class HuggingFaceTable(_ArrowTable):
    """A `datasets.Dataset.save_to_disk` directory: memory-mapped Arrow,
    rows read by index."""

    def __init__(self, path: str, x_key: str, y_key: str | None):
        import datasets

        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:
            raise DpaxError(f"{path} is not a readable saved Hugging Face dataset "
                            f"({type(e).__name__}); save it again with save_to_disk") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DpaxError(f"{path} holds splits {', '.join(ds)}; give one split's "
                            f"directory, e.g. {os.path.join(path, next(iter(ds)))}")
        _check_columns(ds.column_names, x_key, y_key, path, "`x_column`/`y_column`")
        self._ds = ds.with_format("arrow")
        self.y = None if y_key is None else _arrow_to_numpy(self._ds.data.column(y_key),
                                                             f"{path}: {y_key!r}")
        self._setup(path, x_key, y_key)

    def __len__(self) -> int:
        return len(self._ds)

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        return self._checked(_arrow_to_numpy(self._ds[idx.tolist()][self.x_key],
                                             f"{self.name}: column {self.x_key!r}"))


def _array_record(paths: list[str], name: str, key: str = "x",
                  y_key: str | None = "y") -> ArrayRecordTable:
    """Shards and the dpax.json + labels.npy `dpax prepare` wrote beside them."""
    if y_key not in (None, "y"):
        raise DpaxError(f"{name}: dpax prepare's records hold the columns x and y, not "
                        f"{y_key!r}; drop `y_column` or give y")
    where = os.path.dirname(paths[0])
    meta_path = os.path.join(where, META)
    if not os.path.isfile(meta_path):
        raise DpaxError(f"{name}: no {META} beside the shards; write them with "
                        "dpax prepare SRC DEST")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        labels = np.load(os.path.join(where, LABELS), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DpaxError(f"{name}: {META} or {LABELS} is unreadable ({type(e).__name__}); "
                        "write the shards again with dpax prepare") from None
    if meta.get("format") != FORMAT:
        raise DpaxError(f"{meta_path} is not a {FORMAT} description; write the shards "
                        "with dpax prepare")
    expected = [os.path.join(where, s) for s in meta["shards"]]
    missing = [s for s in expected if not os.path.isfile(s)]
    if missing:
        raise DpaxError(f"{name}: shard {missing[0]} is missing; copy it back or write the "
                        "shards again with dpax prepare")
    if paths != [meta_path] and set(paths) != set(expected):  # a glob naming some shards only
        raise DpaxError(f"{name}: names {len(paths)} of the {len(expected)} shards in "
                        f"{where}; give the directory")
    return ArrayRecordTable(expected, meta, labels, name, key)


def is_streamed(name: str) -> bool:
    """Whether `name` names on-disk examples this module reads (not an .npz)."""
    return (os.path.isdir(name) or any(ch in name for ch in "*?[")
            or name.endswith((SUFFIX, ".parquet")))


def open_table(name: str, x_key: str = "x", y_key: str | None = "y"):
    """The table `name` names: a directory of ArrayRecord shards, of Parquet
    files or a saved Hugging Face dataset; a glob; or one such file. Column
    `x_key` is read per batch, `y_key` (if any) read whole as `table.y`."""
    if os.path.isdir(name):
        if any(os.path.isfile(os.path.join(name, f)) for f in HF_MARKERS):
            return HuggingFaceTable(name, x_key, y_key)
        if os.path.isfile(os.path.join(name, META)):  # dpax prepare's: its list of shards
            return _array_record([os.path.join(name, META)], name, x_key, y_key)
        paths = sorted(glob.glob(os.path.join(name, "*" + SUFFIX)))
        paths = paths or sorted(glob.glob(os.path.join(name, "*.parquet")))
        if not paths:
            raise DpaxError(f"{name} holds no *{SUFFIX} shards, *.parquet files or saved "
                            "Hugging Face dataset; give a directory of one of them")
    else:
        paths = sorted(glob.glob(name))
        if not paths:
            raise DpaxError(f"data {name!r} names no file; give an existing path")
    kinds = {os.path.splitext(p)[1] for p in paths}
    if kinds == {SUFFIX}:
        return _array_record(paths, name, x_key, y_key)
    if kinds == {".parquet"}:
        return ParquetTable(paths, x_key, y_key, name)
    raise DpaxError(f"data {name!r} names {', '.join(sorted(kinds))} files; give only "
                    f"*{SUFFIX} shards or only *.parquet files")


def open_columns(name: str, columns: list[str]) -> dict[str, Column]:
    """Named columns of examples on disk (as `open_table` finds them), each
    read per batch with the values as stored: the examples `Trainer.fit`
    takes, e.g. `{"tokens": ..., "segment_ids": ..., "y": ...}`."""
    if not columns:
        raise DpaxError("name at least one column")
    return {c: Column(open_table(name, c, None), decoded=False) for c in columns}
