"""dpax's GPT as a Hugging Face GPT-2 directory, and back.

A Hugging Face GPT-2 directory is `config.json` (a `GPT2Config`) and
`model.safetensors` (or shards listed in `model.safetensors.index.json`) with
the names and layouts of `transformers`' `GPT2LMHeadModel`. dpax's GPT has
GPT-2's architecture exactly: pre-LayerNorm blocks with GPT-2's epsilon
(1e-5), the tanh GELU (`gelu_new`), biases everywhere, learned positions and
an output layer tied to the token embedding. GPT-2's `Conv1D` stores its
weight as (in, out), as Flax's `Linear` does, so the kernels map as they are.

Dropout maps to `resid_pdrop` and `embd_pdrop`; dpax has no dropout on the
attention probabilities, so an export says `attn_pdrop: 0.0`. An import takes
the weights only: the dropout rate is the model's own `dropout`.

Written with `safetensors` and `json` alone: neither `transformers` nor
PyTorch is needed to export or import (the tests load both sides with
`transformers` itself).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from flax import nnx

from dpax.errors import DpaxError
from dpax.models import hf_files
from dpax.models.gpt import GPT, LAYER_NORM_EPSILON

# Activations that are GPT-2's tanh approximation of GELU, dpax's `nnx.gelu`.
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Each block's parameters: dpax's path inside the block -> GPT-2's name.
BLOCK = {
    ("ln1", "scale"): "ln_1.weight", ("ln1", "bias"): "ln_1.bias",
    ("qkv", "kernel"): "attn.c_attn.weight", ("qkv", "bias"): "attn.c_attn.bias",
    ("proj", "kernel"): "attn.c_proj.weight", ("proj", "bias"): "attn.c_proj.bias",
    ("ln2", "scale"): "ln_2.weight", ("ln2", "bias"): "ln_2.bias",
    ("up", "kernel"): "mlp.c_fc.weight", ("up", "bias"): "mlp.c_fc.bias",
    ("down", "kernel"): "mlp.c_proj.weight", ("down", "bias"): "mlp.c_proj.bias",
}
TOP = {
    ("wte", "embedding"): "wte.weight", ("wpe", "embedding"): "wpe.weight",
    ("ln_f", "scale"): "ln_f.weight", ("ln_f", "bias"): "ln_f.bias",
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a GPT-2 directory says about the model's shape."""

    vocab: int
    positions: int
    layers: int
    width: int
    heads: int


def hf_names(layers: int) -> dict[tuple, str]:
    """dpax's parameter path -> GPT-2's name (without the `transformer.` prefix)."""
    names = dict(TOP)
    for i in range(layers):
        names.update({("blocks", i, *path): f"h.{i}.{name}" for path, name in BLOCK.items()})
    return names


def hf_config(model: GPT, dropout: float = 0.0) -> dict:
    """The `GPT2Config` of `model`, as `config.json` holds it."""
    width = model.wte.embedding.shape[1]
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": int(model.wte.embedding.shape[0]), "n_positions": int(model.seq_len),
        "n_embd": int(width), "n_layer": len(model.blocks), "n_head": int(model.blocks[0].heads),
        "n_inner": None, "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPSILON, "resid_pdrop": dropout,
        "embd_pdrop": dropout, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
        "dtype": "float32",
    }


def save(model: GPT, directory: str, dropout: float = 0.0) -> None:
    """Write `model` as a Hugging Face GPT-2 directory (`directory` must exist)."""
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    hf_files.write(directory, hf_config(model, dropout),
                   {f"transformer.{name}": np.asarray(params[path][...], np.float32)
                    for path, name in hf_names(len(model.blocks)).items()})


def read_config(directory: str) -> dict:
    """`config.json` of a GPT-2 directory, checked to describe a model dpax's
    GPT computes exactly."""
    config = hf_files.read_config(directory, "gpt2", "dpax's GPT imports GPT-2")
    path = os.path.join(directory, hf_files.CONFIG)
    width = config.get("n_embd", 768)
    rules = [
        (config.get("activation_function", "gelu_new") in TANH_GELU,
         f"activation {config.get('activation_function')!r} (dpax's GPT uses the tanh GELU, "
         "gelu_new)"),
        (config.get("n_inner") in (None, 4 * width), f"n_inner {config.get('n_inner')} "
         f"(dpax's GPT uses 4 x n_embd = {4 * width})"),
        (abs(config.get("layer_norm_epsilon", 1e-5) - LAYER_NORM_EPSILON) < 1e-12,
         f"layer_norm_epsilon {config.get('layer_norm_epsilon')} (dpax's GPT uses "
         f"GPT-2's {LAYER_NORM_EPSILON})"),
        (config.get("scale_attn_weights", True), "scale_attn_weights false"),
        (not config.get("scale_attn_by_inverse_layer_idx", False),
         "scale_attn_by_inverse_layer_idx true"),
        (config.get("tie_word_embeddings", True), "an output layer not tied to wte"),
        (not config.get("add_cross_attention", False), "cross-attention"),
    ]
    for ok, what in rules:
        if not ok:
            raise DpaxError(f"{path}: {what}; dpax's GPT cannot compute it exactly")
    return config


def shape(config: dict) -> Shape:
    return Shape(vocab=config.get("vocab_size", 50257), positions=config.get("n_positions", 1024),
                 layers=config.get("n_layer", 12), width=config.get("n_embd", 768),
                 heads=config.get("n_head", 12))


def check_flags(directory: str, layers: int, width: int, heads: int) -> Shape:
    """The directory's shape, refused in one line when the GPT flags differ."""
    s = shape(read_config(directory))
    if (s.layers, s.width, s.heads) != (layers, width, heads):
        raise DpaxError(f"{directory} holds a GPT-2 of {s.layers} layers, width {s.width} and "
                        f"{s.heads} heads; give `layers={s.layers}` `width={s.width}` "
                        f"`heads={s.heads}`")
    return s


def load_into(model: GPT, directory: str) -> None:
    """Set `model`'s params to a GPT-2 directory's weights. Its shape must
    match the model's (`check_flags`), its vocabulary the data's, and it must
    have at least the model's positions (extra ones are cut, as nanoGPT's
    `crop_block_size` does)."""
    s = shape(read_config(directory))
    vocab = model.wte.embedding.shape[0]
    if s.vocab != vocab:
        raise DpaxError(f"{directory} has a vocabulary of {s.vocab} tokens, the data's "
                        f"tokenizer {vocab}; train with the tokenizer the model was made with")
    if s.positions < model.seq_len:
        raise DpaxError(f"{directory} has {s.positions} positions, fewer than "
                        f"`seq_len={model.seq_len}`; give `seq_len={s.positions}` or less")
    # GPT2LMHeadModel's names start with `transformer.`; GPT2Model's do not.
    tensors = hf_files.tensors(directory, "transformer.")
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, tensors.get("wte.weight")):
        raise DpaxError(f"{directory}: lm_head.weight differs from wte.weight; dpax's GPT ties "
                        "them")
    shapes = {path: var[...].shape
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    new = {}
    for path, name in hf_names(len(model.blocks)).items():
        if name not in tensors:
            raise DpaxError(f"{directory} lacks the weight {name}")
        value = np.asarray(tensors[name], np.float32)
        if path == ("wpe", "embedding"):
            value = value[: model.seq_len]
        if value.shape != shapes[path]:
            raise DpaxError(f"{directory}: {name} has shape {value.shape}, the model's is "
                            f"{shapes[path]}")
        new[path] = value
    nnx.update(model, nnx.from_flat_state(new))
