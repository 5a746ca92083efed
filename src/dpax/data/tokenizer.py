"""Tokens of text: bytes, or a byte-level BPE trained on the training text.

`tokenizer="bytes"` (the default) makes each byte a token (vocabulary 256).
`tokenizer="bpe:VOCAB"` trains a byte-level BPE of VOCAB tokens with Hugging
Face `tokenizers` on the training documents (never the held-out ones), the
way GPT-2's tokenizer was made: deterministic, so every process of a run, and
a resumed run, trains the same one. The run keeps it (`tokenizer.json` in
the run directory, and in every checkpoint), `dpax sample` uses it, and `dpax export`
writes it in Hugging Face's layout.

Bits per byte stay comparable across tokenizers: every token of a byte-level
BPE stands for a fixed byte string, so a window's loss is divided by the
bytes its real targets cover (`token_bytes`), not by their count.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from dpax.errors import DpaxError

BYTES = "bytes"
BPE = "bpe"
MAX_VOCAB = 1 << 16  # token ids fit uint16


def check_spec(spec: str) -> int | None:
    """The BPE vocabulary of `spec` (None for bytes), or a one-line error."""
    if spec == BYTES:
        return None
    kind, _, size = spec.partition(":")
    if kind == BPE and size.isdigit() and 257 <= int(size) <= MAX_VOCAB:
        return int(size)
    raise DpaxError(f"`tokenizer` must be bytes or bpe:VOCAB with 257 <= VOCAB <= "
                    f"{MAX_VOCAB} (e.g. bpe:4096), got {spec!r}")


@dataclasses.dataclass
class Tokenizer:
    """Text <-> token ids. `hf` is the Hugging Face tokenizer of a BPE (None:
    byte tokens); `token_bytes[i]` the bytes token i stands for."""

    spec: str
    vocab: int
    token_bytes: np.ndarray
    hf: object | None = None

    @property
    def dtype(self):
        return np.uint8 if self.vocab <= 256 else np.uint16

    def encode(self, text: bytes) -> np.ndarray:
        if self.hf is None:
            return np.frombuffer(text, np.uint8)
        return self.encode_all([text])[0]

    def encode_all(self, docs: list[bytes]) -> list[np.ndarray]:
        if self.hf is None:
            return [np.frombuffer(d, np.uint8) for d in docs]
        encoded = self.hf.encode_batch([_text(d) for d in docs])
        return [np.asarray(e.ids, self.dtype) for e in encoded]

    def decode(self, ids) -> bytes:
        ids = np.asarray(ids)
        if self.hf is None:
            return bytes(ids.astype(np.uint8))
        return self.hf.decode(ids.tolist()).encode("utf-8", "replace")

    def to_json(self) -> str | None:
        """The BPE as `tokenizer.json` holds it (None for byte tokens)."""
        return None if self.hf is None else self.hf.to_str()


def byte_tokens() -> Tokenizer:
    return Tokenizer(BYTES, 256, np.ones(256, np.int32))


def train(spec: str, docs: list[bytes]) -> Tokenizer:
    """The tokenizer `spec` names, a BPE trained on `docs` (UTF-8 text)."""
    vocab = check_spec(spec)
    if vocab is None:
        return byte_tokens()
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([_text(d) for d in docs], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return _wrap(hf, spec)


def from_json(spec: str, text: str | None) -> Tokenizer:
    """A tokenizer a run saved (`to_json`); byte tokens need nothing saved."""
    if check_spec(spec) is None:
        return byte_tokens()
    from tokenizers import Tokenizer as HF

    return _wrap(HF.from_str(text), spec)


def _wrap(hf, spec: str) -> Tokenizer:
    size = hf.get_vocab_size()
    # A byte-level BPE token is a string of the byte alphabet: one char per byte.
    lengths = np.array([len(hf.id_to_token(i) or "") for i in range(size)], np.int32)
    return Tokenizer(spec, size, lengths, hf)


def _text(doc: bytes) -> str:
    # Text files are UTF-8; a stray byte becomes U+FFFD rather than an error.
    return doc.decode("utf-8", "replace")


HF_FILES = ("tokenizer.json", "tokenizer_config.json")  # what `hf_files` names


def hf_files(tok: Tokenizer) -> dict[str, str]:
    """The files of a Hugging Face tokenizer directory (for `dpax export`):
    `tokenizer.json` and a `tokenizer_config.json` that AutoTokenizer reads."""
    if tok.hf is None:
        return {}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": None,
              "clean_up_tokenization_spaces": False}
    return dict(zip(HF_FILES, (tok.to_json(), json.dumps(config, indent=2))))
