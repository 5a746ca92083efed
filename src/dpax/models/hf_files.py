"""A Hugging Face model directory: `config.json`, safetensors weights (one
file, or shards an index lists) and a tokenizer's files, read and written
with `safetensors` and `json` alone (`dpax.models.hf_gpt2`, `hf_llama`)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from dpax.errors import DpaxError

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_config(directory: str, model_type: str, imports: str) -> dict:
    """`config.json` of a directory holding a `model_type` model; `imports`
    names what dpax imports, for the message."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise DpaxError(f"{directory} is not a Hugging Face model directory (no {CONFIG}); "
                        "give a directory written by save_pretrained or dpax export")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DpaxError(f"{path} is unreadable ({e})") from None
    if config.get("model_type") != model_type:
        raise DpaxError(f"{path} describes a {config.get('model_type')!r} model; {imports} "
                        f"(model_type {model_type})")
    return config


def model_type(directory: str) -> str | None:
    """The `model_type` a directory's config names (None: no readable config)."""
    try:
        with open(os.path.join(directory, CONFIG)) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


def tensors(directory: str, prefix: str = "") -> dict[str, np.ndarray]:
    """Every weight of the directory by name, `prefix` taken off the names."""
    from safetensors.numpy import load_file

    # One file before the shards an index lists, as `transformers` prefers it.
    index = os.path.join(directory, INDEX)
    if os.path.isfile(os.path.join(directory, WEIGHTS)):
        files = [WEIGHTS]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        raise DpaxError(f"{directory} holds no {WEIGHTS}; save the model with safetensors "
                        "(save_pretrained does by default)")
    found = {}
    for name in files:
        found.update(load_file(os.path.join(directory, name)))
    return {k.removeprefix(prefix): v for k, v in found.items()}


def write(directory: str, config: dict, weights: dict[str, np.ndarray]) -> None:
    """`config.json` and `model.safetensors` into `directory` (which must exist)."""
    from safetensors.numpy import save_file

    path = os.path.join(directory, CONFIG)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    # `transformers` reads the format to know the tensors' framework.
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
              os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    # safetensors writes a private temporary file (0600) and renames it into
    # place; the weights get the mode `open` gave config.json (the umask's).
    shutil.copymode(path, os.path.join(directory, WEIGHTS))


def tokenizer_json(directory: str) -> str | None:
    """The directory's `tokenizer.json` (a BPE's), or None."""
    path = os.path.join(directory, TOKENIZER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def check_tokenizer(directory: str, spec: str) -> None:
    """Refuse a `tokenizer` that would not give the token ids the
    directory's embeddings were trained on."""
    text = tokenizer_json(directory)
    if text is None:
        if spec != "bytes":
            raise DpaxError(f"{directory} has no {TOKENIZER}: a BPE trained here would give "
                            "other token ids than its embeddings learned; use "
                            f"`tokenizer=bytes` or a directory with its {TOKENIZER}")
        return
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(text).get_vocab_size()
    if spec != f"bpe:{vocab}":
        raise DpaxError(f"{directory} carries its tokenizer (a BPE of {vocab} tokens); give "
                        f"`tokenizer=bpe:{vocab}` to train with it")
