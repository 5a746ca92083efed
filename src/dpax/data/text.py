"""Text as training data: bytes as tokens, documents cut into windows.

A window holds `seq_len + 1` tokens of ONE document: the model reads the
first `seq_len` and predicts each next one. Consecutive windows of a document
overlap by one token, so every token but a document's first is predicted
exactly once. A document's last window is padded with zeros and its real
length recorded: the loss counts only real targets (`lm_loss` weights each
window by them), so documents are never glued together silently and padding
never counts.

With packing (`pack`), a document's windows, cut as above, are packed
together into windows instead of each padding its own: `y` is then a segment
id per token (1, 2, ... for the pieces a window holds, 0 for padding), and
the models restart positions and attention at each piece, so every token is
predicted from what it would be predicted from unpacked, and fewer tokens
are padding (`lm_loss` counts a target when it and its input share a piece).

The held-out split is by document: a seeded choice of whole files, so no eval
text was trained on. The default corpus is the running Python's standard
library (`*.py` under its `Lib`): real text on every machine, nothing to
download. Tokens are bytes (vocabulary 256) by default, so a loss in nats
per token is in nats per byte, or a byte-level BPE trained on the training
documents (`dpax.data.tokenizer`).
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig

import numpy as np

from dpax.data import tokenizer
from dpax.errors import DpaxError

EVAL_FRACTION = 0.02  # of the documents (at least one, when there are two or more)
# A single text file is cut into documents of this many windows, so it has
# something to hold out.
WINDOWS_PER_DOCUMENT = 64
DATA_SEED = 0  # the split never depends on the run's `seed`
# A file is text when at most this share of its bytes are control bytes no text
# holds (NUL and the like; tabs, newlines and escapes are text): text in any
# 8-bit encoding passes, a program or an image does not.
MAX_BINARY_SHARE = 0.01
_CONTROL = np.zeros(256, bool)
_CONTROL[[*range(0, 9), *range(14, 27), *range(28, 32), 127]] = True


def stdlib_dir() -> str:
    """The running Python's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def documents(path: str | None, seq_len: int) -> list[tuple[str, bytes]]:
    """(name, bytes) of every document under `path` (a text file or a directory
    of them; None: the standard library's `*.py`), sorted by name."""
    if path is None:
        root = stdlib_dir()
        files = [f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                 if "site-packages" not in f.split(os.sep)]
        return [(os.path.relpath(f, root), _read(f)) for f in sorted(files)]
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and not os.path.basename(f).startswith("."))
        if not files:
            raise DpaxError(f"text directory {path!r} holds no files; put text files in it")
        return [(os.path.relpath(f, path), _read(f)) for f in files]
    if os.path.isfile(path):
        text, size = _read(path), WINDOWS_PER_DOCUMENT * seq_len
        return [(f"{path}@{i}", text[i:i + size]) for i in range(0, len(text), size)]
    raise DpaxError(f"text data {path!r} does not exist; give a text file or a directory of them")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DpaxError(f"cannot read text file {path}: {e.strerror}") from None
    share = binary_share(data)
    if share > MAX_BINARY_SHARE:
        raise DpaxError(f"{path} is not text: {100 * share:.0f}% of its bytes are control "
                        "bytes (a program or an image?); give text files for text:PATH")
    return data


def binary_share(data: bytes) -> float:
    """The share of `data`'s bytes that are control bytes no text holds."""
    if not data:
        return 0.0
    return float(np.mean(_CONTROL[np.frombuffer(data, np.uint8)]))


def windows(tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows of seq_len + 1 tokens, zero-padded; their real lengths) of one
    document's tokens; none for fewer than 2 tokens (nothing to predict)."""
    n = math.ceil((len(tokens) - 1) / seq_len) if len(tokens) >= 2 else 0
    padded = np.zeros(n * seq_len + 1, tokens.dtype)
    padded[:len(tokens)] = tokens
    starts = np.arange(n) * seq_len
    x = padded[starts[:, None] + np.arange(seq_len + 1)]
    return x, np.minimum(seq_len + 1, len(tokens) - starts).astype(np.int32)


def pack(x: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows `x` of real `lengths` (`windows`'s) packed: the full ones as
    they are, the others (documents' last windows, short documents) in order
    into shared windows, a new one opened when the next does not fit:
    (windows, each token's segment id, 0 for padding)."""
    size = x.shape[1]
    full = lengths == size
    out = [x[full]]
    seg = [np.ones((int(full.sum()), size), np.int32)]
    rows, ids, used = [], [], size  # the shared windows; `used` of the last
    for piece, n in zip(x[~full], lengths[~full]):
        if used + n > size:
            rows.append(np.zeros(size, x.dtype))
            ids.append(np.zeros(size, np.int32))
            used = 0
        rows[-1][used:used + n] = piece[:n]
        ids[-1][used:used + n] = ids[-1].max() + 1
        used += n
    if rows:
        out.append(np.stack(rows))
        seg.append(np.stack(ids))
    return np.concatenate(out), np.concatenate(seg)


def split(docs: list[tuple[str, bytes]]) -> tuple[list[bytes], list[bytes]]:
    """(train documents, held-out documents): a seeded choice of whole documents."""
    n_eval = max(1, round(len(docs) * EVAL_FRACTION)) if len(docs) >= 2 else 0
    order = np.random.default_rng(DATA_SEED).permutation(len(docs))
    held = set(order[:n_eval].tolist())
    train = [d for i, (_, d) in enumerate(docs) if i not in held]
    held_out = [d for i, (_, d) in enumerate(docs) if i in held] or train
    return train, held_out


def stack(docs: list[bytes], seq_len: int, tok: tokenizer.Tokenizer,
          packed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    parts = [windows(t, seq_len) for t in tok.encode_all(docs)]
    if not parts:
        return np.zeros((0, seq_len + 1), tok.dtype), np.zeros(0, np.int32)
    x, lengths = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    return pack(x, lengths) if packed else (x, lengths)


def load(path: str | None, seq_len: int, tokenizer_spec: str = tokenizer.BYTES,
         tok: tokenizer.Tokenizer | None = None, packed: bool = False):
    """Windows of the text under `path` (default: the standard library's
    sources): `(name, x_train, y_train, x_eval, y_eval, tokenizer)`, x (n,
    seq_len + 1) tokens, y the real length of each window, or with `packed`
    each token's segment id (`pack`). The tokenizer is `tok` if given, else
    `tokenizer_spec`'s, trained on the training documents."""
    if seq_len < 1:
        raise DpaxError(f"`seq_len` must be >= 1, got {seq_len}")
    docs = documents(path, seq_len)
    train, held_out = split(docs)
    tok = tok or tokenizer.train(tokenizer_spec, train)
    x_train, y_train = stack(train, seq_len, tok, packed)
    x_eval, y_eval = ((x_train, y_train) if held_out is train
                      else stack(held_out, seq_len, tok, packed))
    if len(x_eval) == 0:  # held-out documents too short: evaluate on the training set
        x_eval, y_eval = x_train, y_train
    if len(x_train) == 0:
        raise DpaxError(f"text data {path or stdlib_dir()!r} has no document of 2 bytes or "
                        "more; give files with text in them")
    return "text:" + (path or "stdlib"), x_train, y_train, x_eval, y_eval, tok
