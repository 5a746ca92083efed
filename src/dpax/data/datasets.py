"""Datasets dpax can name: arrays in memory with a fixed train/eval split.

Nothing is downloaded: digits ships inside scikit-learn, the rest is generated
from a fixed seed or read from the user's `.npz`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import warnings
import zipfile

import numpy as np

from dpax import config as cfg
from dpax.data import augment, checks, sources, text, text_shards
from dpax.data.tokenizer import BYTES, Tokenizer, check_spec
from dpax.errors import BadExamples, BadLabels, DpaxError, DpaxWarning

# The data never depends on the run's `seed`: runs with different seeds see the same split.
DATA_SEED = 0
EVAL_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Train and eval arrays; `n_out` is the class count (classification) or 1."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray
    task: str  # "classification" | "regression" | "lm"
    n_out: int
    tokenizer: Tokenizer | None = None  # text's (`dpax.data.tokenizer`)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _split(name, x, y, task, n_out) -> Dataset:
    order = np.random.default_rng(DATA_SEED).permutation(len(x))
    n_eval = int(round(len(x) * EVAL_FRACTION)) if len(x) >= 5 else 0
    ev, tr = order[:n_eval], order[n_eval:]
    if n_eval == 0:  # too few examples to hold any out: evaluate on the training set
        ev = tr

    def rows(idx):  # inputs on disk (`sources.Column`) are split as views
        return x.subset(idx) if isinstance(x, sources.Column) else x[idx]

    return Dataset(name, rows(tr), y[tr], rows(ev), y[ev], task, n_out)


def regression(n: int = 800, dim: int = 5) -> Dataset:
    """Synthetic linear data: y = x w + b + 0.1 noise."""
    rng = np.random.default_rng(DATA_SEED)
    w, b = true_regression_params(dim)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = (x @ w + b + 0.1 * rng.normal(size=n)).astype(np.float32)
    return _split("regression", x, y, "regression", 1)


def true_regression_params(dim: int = 5) -> tuple[np.ndarray, float]:
    """The w and b that `regression` data was drawn from."""
    rng = np.random.default_rng(DATA_SEED + 1)
    return rng.normal(size=dim).astype(np.float32), float(rng.normal())


def digits() -> Dataset:
    """scikit-learn's 1,797 8x8 digit images as NHWC float32 in [0, 1].

    Read from the file scikit-learn ships, as its `load_digits` reads it, but
    without importing scikit-learn: that import alone took ~2 s of every
    `dpax` process here (tests check the arrays equal `load_digits`')."""
    data = np.loadtxt(_sklearn_file("datasets/data/digits.csv.gz"), delimiter=",")
    x = (data[:, :-1].reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    return _split("digits", x, data[:, -1].astype(np.int32), "classification", 10)


def _sklearn_file(name: str) -> pathlib.Path:
    """A data file inside the installed scikit-learn, found without importing it."""
    spec = importlib.util.find_spec("sklearn")
    path = pathlib.Path(spec.submodule_search_locations[0]) / name if spec else None
    if path is None or not path.is_file():
        raise DpaxError(f"scikit-learn's {name} is missing: reinstall dpax's pinned "
                        "dependencies (pip install -e .)")
    return path


def random_images(n: int = 2048, side: int = 32, channels: int = 3, classes: int = 10):
    """Synthetic NHWC images whose label is a fixed linear function of the pixels,
    so a model can learn it (benchmarks need real gradients, not noise)."""
    rng = np.random.default_rng(DATA_SEED)
    x = rng.normal(size=(n, side, side, channels)).astype(np.float32)
    proj = rng.normal(size=(side * side * channels, classes)).astype(np.float32)
    y = np.argmax(x.reshape(n, -1) @ proj, -1).astype(np.int32)
    return _split("random-images", x, y, "classification", classes)


def read_npz(path: str, names: tuple[str, ...], columns: bool = True) -> dict[str, np.ndarray]:
    """The named arrays of an .npz, or a DpaxError that says how to fix the file
    (`columns`: whether the caller takes `x_column`/`y_column`)."""
    how = "np.savez(path, " + ", ".join(f"{n}=..." for n in names) + ")"
    rename = "name them with `x_column`/`y_column`, or " if columns else ""
    if not os.path.isfile(path):
        raise DpaxError(f"data file {path!r} does not exist; pass an existing .npz")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = sorted(set(names) - set(f.files))
            if missing:
                has = ", ".join(f.files) or "none"
                raise DpaxError(f"{path} lacks array(s) {', '.join(missing)} (it has {has}); "
                                f"{rename}save it with {how}")
            return {n: f[n] for n in names}
    except DpaxError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DpaxError(f"{path} is not a readable .npz ({type(e).__name__}); "
                        f"write it with {how}") from None


def from_npz(path: str, x_key: str = "x", y_key: str = "y", task: str | None = None
             ) -> Dataset:
    """A user's `.npz` with arrays `x` (examples first) and `y` (labels or
    targets), or the arrays named `x_key` and `y_key` (`task`: see `labelled`)."""
    arrays = read_npz(path, (x_key, y_key))
    return labelled(path, arrays[x_key], arrays[y_key], task)


def from_table(table, task: str | None = None) -> Dataset:
    """Examples on disk (`dpax.data.sources`): inputs read per batch, labels in memory."""
    return labelled(table.name, sources.Column(table), table.y, task)


TASKS = ("classification", "regression")  # what a user's y can be for (`labelled`)
# Float y is guessed to hold class ids (a warning) only for this many classes
# at most: beyond, whole-number targets (counts, years) are the likelier meaning.
MAX_GUESSED_CLASSES = 100


def labelled(path: str, x, y: np.ndarray, task: str | None = None) -> Dataset:
    """Checked examples split into train and eval. `x` is an array, or a
    `sources.Column` (then only what can be seen without reading it is checked:
    the Trainer checks its first batch).

    `task`: "classification" (y holds class ids 0..max(y): integers, or
    floats of whole values), "regression" (y holds numbers to predict), or
    None: integer (or bool) y means classification, float y regression.
    uint8 `x` holds images: scaled to [0, 1] (`sources.decode`), per batch.
    """
    if x.ndim == 0 or len(x) == 0:
        raise BadExamples(f"{path} holds no examples; x needs at least one row", path)
    if y.ndim != 1 or len(y) != len(x):
        raise BadExamples(f"{path}: x has {len(x)} examples but y has shape {y.shape}; "
                          "y needs one value per example", path, "y")
    if isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim > 1:
        x = sources.Column(sources.ArrayTable(x, path))  # kept as uint8, decoded per batch
    checks.values(checks.Examples({"x": x, "y": y}, file=path))  # the Trainer's rule
    if not isinstance(x, sources.Column):
        x = sources.decode(x)
        if x.ndim == 1:
            x = x[:, None]
    if (task or _task_of(path, y)) == "classification":
        y, classes = _class_ids(path, y)
        return _split(path, x, y, "classification", classes)
    return _split(path, x, y.astype(np.float32), "regression", 1)


def _is_integer(y: np.ndarray) -> bool:
    return np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_


def _sparse(classes: int, distinct: int) -> bool:
    """Labels 0..classes-1 of which only `distinct` occur: too few to be meant."""
    return classes > max(2 * distinct, distinct + 10)


def _task_of(path: str, y: np.ndarray) -> str:
    """The task y's dtype means; a warning when float y looks like class ids."""
    if _is_integer(y):
        return "classification"
    low, high = float(y.min()), float(y.max())
    if 0 <= low and high < MAX_GUESSED_CLASSES and np.all(np.mod(y, 1) == 0):
        distinct = np.count_nonzero(np.bincount(y.astype(np.intp)))  # one pass, no sort
        if distinct > 1 and not _sparse(int(high) + 1, distinct):
            warnings.warn(
                f"{path}: y is {y.dtype} but holds only whole numbers ({distinct} distinct, "
                f"{low:g}..{high:g}), so a regression is trained on it; for a classifier of "
                f"{int(high) + 1} classes give `task=classification` (or save y as integers), "
                "or `task=regression` to keep the regression without this warning",
                DpaxWarning, stacklevel=3)
    return "regression"


def _class_ids(path: str, y: np.ndarray) -> tuple[np.ndarray, int]:
    """`y` as int32 class ids, and the classes a model needs for them (the
    largest id + 1); warns when most ids in 0..largest never occur."""
    if not _is_integer(y):
        whole = np.mod(y, 1) == 0
        if not whole.all():
            raise BadLabels(f"{path}: y holds {y[np.argmin(whole)]:g}, not a whole number, "
                            "but a classifier takes class ids 0..K-1; give "
                            "`task=regression`, or save y as class ids", path, "y")
    y = y.astype(np.int64)
    checks.ids(checks.Examples({"y": y}, file=path), "y", ndim=1, below=None,
               what="class labels", reader="a classifier", per_example="one per example")
    if y.max() >= 2**31:
        raise BadLabels(f"{path}: class label {y.max()} is too large; relabel to 0..K-1, or "
                        "give `task=regression` if y holds numbers to predict", path, "y")
    classes, distinct = int(y.max()) + 1, len(np.unique(y))
    if _sparse(classes, distinct):
        warnings.warn(f"{path}: y has {distinct} distinct labels but its largest is "
                      f"{classes - 1}, so the model gets {classes} outputs; relabel to "
                      f"0..{distinct - 1} if that is not meant, or give `task=regression` if "
                      "y holds numbers to predict", DpaxWarning, stacklevel=3)
    return y.astype(np.int32), classes


def read_inputs(path: str) -> np.ndarray:
    """Array `x` of a user's .npz (for prediction; `y` may be absent)."""
    x = read_npz(path, ("x",), columns=False)["x"]
    if (x.ndim == 0 or len(x) == 0 or not np.issubdtype(x.dtype, np.number)
            or np.iscomplexobj(x)):
        raise DpaxError(f"{path}: x must be a non-empty array of real numbers, examples first")
    if not np.all(np.isfinite(x)):
        raise DpaxError(f"{path}: x contains NaN or infinite values; clean the data first")
    return x.astype(np.float32)


DATASETS = {"regression": regression, "digits": digits, "random-images": random_images}
TEXT = "text"  # `text` (the standard library's sources) or `text:PATH`
DEFAULT_SEQ_LEN = 128


def check_name(name: str) -> None:
    """Refuse a data name `load` cannot read, before anything runs."""
    if not (name.endswith(".npz") or name in DATASETS or is_text(name)
            or sources.is_streamed(name)):
        raise DpaxError(f"unknown data {name!r}: no dataset, file or directory of that name "
                        "here; choose one of "
                        f"{', '.join(DATASETS)}, text, text:PATH, a path to a .npz, or a "
                        "directory (or glob) of ArrayRecord shards, Parquet files or a saved "
                        "Hugging Face dataset")


def is_text(name: str) -> bool:
    """Whether `name` is text: `text`, `text:PATH`, or text prepared as shards
    (`dpax.data.text_shards`)."""
    return (name == TEXT or name.startswith(TEXT + ":")
            or text_shards.describe(name) is not None)


def load(name: str, seq_len: int = DEFAULT_SEQ_LEN, x_column: str = "x",
         y_column: str = "y", tokenizer_spec: str = BYTES,
         tok: Tokenizer | None = None, task: str | None = None,
         packed: bool = False) -> Dataset:
    """A named dataset, a path ending in `.npz`, text (`dpax.data.text`) cut into
    windows of `seq_len` tokens of `tok` (default: `tokenizer_spec`'s, trained on
    the text; `packed`: documents packed into windows), text prepared as
    windows (`dpax.data.text_shards`: `seq_len`, `tokenizer_spec` and
    `packed` must be theirs, and so must `tok` if given), or examples on
    disk (`dpax.data.sources`) with inputs and labels in the named columns
    (`task`: what those labels are for, see `labelled`)."""
    check_name(name)
    prepared = text_shards.describe(name)
    if prepared is not None:
        text_shards.check_asked(name, prepared, seq_len, tokenizer_spec, packed)
        name, x_train, y_train, x_eval, y_eval, tok = text_shards.load(name, prepared, tok)
        return Dataset(name, x_train, y_train, x_eval, y_eval, "lm", tok.vocab, tok)
    if is_text(name):
        name, x_train, y_train, x_eval, y_eval, tok = text.load(
            name.partition(":")[2] or None, seq_len, tokenizer_spec, tok, packed)
        return Dataset(name, x_train, y_train, x_eval, y_eval, "lm", tok.vocab, tok)
    if name.endswith(".npz"):
        return from_npz(name, x_column, y_column, task)
    if sources.is_streamed(name):
        return from_table(sources.open_table(name, x_column, y_column), task)
    return DATASETS[name]()


@dataclasses.dataclass
class DataConfig:
    """Where the examples come from and how each batch is made of them."""

    name: str = cfg.field(
        "digits", "data: regression, digits, random-images, a path to a .npz, text (the "
        "Python standard library's sources) or text:PATH (a text file or a directory of "
        "them; byte tokens), or examples streamed from disk: a directory or glob of "
        "ArrayRecord shards (dpax prepare), Parquet files, or a saved Hugging Face dataset",
        flag="data")
    x_column: str = cfg.field("x", "an .npz's array or streamed data's column of inputs")
    y_column: str = cfg.field("y", "an .npz's array or streamed data's column of labels or "
                              "targets")
    task: str | None = cfg.field(
        None, "what a .npz's or streamed data's y is for: classification (class ids; float y "
        "of whole numbers too) or regression (numbers to predict; integer y too); default: "
        "integer y classification, float y regression")
    seq_len: int = cfg.field(DEFAULT_SEQ_LEN, "text: tokens per training window (gpt's "
                             "context length)")
    tokenizer: str = cfg.field(
        BYTES, "text: bytes (256 tokens) or bpe:VOCAB, a byte-level BPE of VOCAB "
        "tokens trained on the training text (bits per byte stay comparable)")
    pack: bool = cfg.field(
        False, "text: pack documents into full windows (each keeps its own positions and "
        "attention) instead of padding each one's last window")
    augment: str | None = cfg.field(
        None, "images: crop, flip or crop,flip; each example's draw comes from the seed, the "
        "step and its place in the global batch, so any device count trains the same")
    workers: int = cfg.field(
        0, "Grain worker processes that read and decode batches (0: the training thread)",
        how=True, flag="data_workers")
    on_device: bool | None = cfg.field(
        None, "keep the training arrays on the devices and gather each batch there, the same "
        "batches (default: on GPUs and TPUs when they take at most 1/8 of a device's free "
        "memory, one process; docs/data.md)", how=True, flag="data_on_device")

    def check(self) -> None:
        check_name(self.name)
        if self.task is not None:
            cfg.one_of(self, "task", TASKS)
            if self.name in DATASETS or self.is_text:
                raise DpaxError(f"`task` is for the labels of a .npz or of streamed data; "
                                f"`data={self.name}` has a task of its own")
        augment.parse(self.augment)
        if self.pack and not self.is_text:
            raise DpaxError(f"`pack` packs text documents into windows; `data={self.name}` "
                            "is not text")
        cfg.whole(self, "seq_len")
        check_spec(self.tokenizer)
        cfg.whole(self, "workers", low=0)
        prepared = text_shards.describe(self.name)
        if prepared is not None:
            text_shards.check_asked(self.name, prepared, self.seq_len, self.tokenizer,
                                    self.pack)

    @property
    def is_text(self) -> bool:
        return is_text(self.name)

    def load(self, tok: Tokenizer | None = None) -> Dataset:
        """The dataset, its augmentation checked against its examples; text in
        the tokens of `tok` if given (else of `tokenizer`, trained on it)."""
        ds = load(self.name, self.seq_len, self.x_column, self.y_column, self.tokenizer, tok,
                  self.task, self.pack)
        aug = augment.parse(self.augment)
        if aug is not None:
            aug.check(ds.input_shape)
        return ds
