"""dpax's Llama as a Hugging Face `LlamaForCausalLM` directory, and back.

The directory is `config.json` (a `LlamaConfig`), safetensors weights (one
file, or shards an index lists) and, when it has one, the tokenizer's files,
whose BPE dpax trains with. dpax's `Llama` computes what `LlamaForCausalLM`
does for the configs this module accepts: SiLU MLP, no biases, RoPE without
scaling, heads of `hidden_size / num_attention_heads` features. A Linear's
weight is (out, in) in PyTorch and (in, out) in Flax: kernels are transposed
both ways. Weights only: the dropout rate is the model's own.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from dpax.errors import DpaxError
from dpax.models import hf_files
from dpax.models.llama import Llama

MODEL_TYPE = "llama"
# Each block's parameters: dpax's path inside the block -> Llama's name, and
# whether the tensor is a Linear's (transposed).
BLOCK = {
    ("attn_norm", "scale"): ("input_layernorm.weight", False),
    ("q", "kernel"): ("self_attn.q_proj.weight", True),
    ("k", "kernel"): ("self_attn.k_proj.weight", True),
    ("v", "kernel"): ("self_attn.v_proj.weight", True),
    ("o", "kernel"): ("self_attn.o_proj.weight", True),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("gate", "kernel"): ("mlp.gate_proj.weight", True),
    ("up", "kernel"): ("mlp.up_proj.weight", True),
    ("down", "kernel"): ("mlp.down_proj.weight", True),
}
TOP = {("embed", "embedding"): ("model.embed_tokens.weight", False),
       ("norm", "scale"): ("model.norm.weight", False)}
HEAD = {("head", "kernel"): ("lm_head.weight", True)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a Llama directory says about the model's shape."""

    vocab: int
    positions: int
    layers: int
    width: int
    heads: int
    kv_heads: int
    mlp_width: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float

    def options(self) -> dict:
        """`Llama`'s keyword options for this shape."""
        return {"layers": self.layers, "width": self.width, "heads": self.heads,
                "kv_heads": self.kv_heads, "mlp_width": self.mlp_width,
                "tie_embeddings": self.tie_embeddings, "rope_theta": self.rope_theta,
                "norm_eps": self.norm_eps}


def hf_names(layers: int, tied: bool) -> dict[tuple, tuple[str, bool]]:
    """dpax's parameter path -> (Llama's name, transposed)."""
    names = {**TOP, **({} if tied else HEAD)}
    for i in range(layers):
        names.update({("blocks", i, *path): (f"model.layers.{i}.{name}", t)
                      for path, (name, t) in BLOCK.items()})
    return names


def shape_of(model: Llama) -> Shape:
    block = model.blocks[0]
    vocab, width = model.embed.embedding.shape
    return Shape(int(vocab), int(model.seq_len), len(model.blocks), int(width),
                 int(block.heads), int(block.kv_heads), int(block.gate.out_features),
                 bool(model.tie_embeddings), float(block.theta),
                 float(block.attn_norm.epsilon))


def hf_config(model: Llama) -> dict:
    """The `LlamaConfig` of `model`, as `config.json` holds it."""
    s = shape_of(model)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": s.vocab, "max_position_embeddings": s.positions,
        "hidden_size": s.width, "intermediate_size": s.mlp_width,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.width // s.heads,
        # RoPE as transformers 5 spells it, and as earlier versions did.
        "hidden_act": "silu", "rms_norm_eps": s.norm_eps, "rope_theta": s.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": s.tie_embeddings,
        "pretraining_tp": 1, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "dtype": "float32",
    }


def save(model: Llama, directory: str) -> None:
    """Write `model` as a Hugging Face Llama directory (`directory` must exist)."""
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    weights = {}
    for path, (name, transposed) in hf_names(len(model.blocks), model.tie_embeddings).items():
        value = np.asarray(params[path][...], np.float32)
        weights[name] = value.T if transposed else value
    hf_files.write(directory, hf_config(model), weights)


def read_config(directory: str) -> dict:
    """`config.json` of a Llama directory, checked to describe a model dpax's
    Llama computes exactly."""
    config = hf_files.read_config(directory, MODEL_TYPE, "dpax's llama imports Llama")
    width, heads = config.get("hidden_size", 4096), config.get("num_attention_heads", 32)
    rope = _rope(config)
    rules = [
        (config.get("hidden_act", "silu") == "silu",
         f"activation {config.get('hidden_act')!r} (dpax's llama uses silu)"),
        (rope.get("rope_type", rope.get("type", "default")) == "default",
         f"rope_scaling {rope} (dpax's llama rotates without scaling)"),
        (not config.get("attention_bias", False), "attention biases"),
        (not config.get("mlp_bias", False), "MLP biases"),
        (config.get("head_dim") in (None, width // heads),
         f"head_dim {config.get('head_dim')} (dpax's llama uses hidden_size / "
         f"num_attention_heads = {width // heads})"),
        (config.get("pretraining_tp", 1) == 1, "pretraining_tp > 1"),
    ]
    for ok, what in rules:
        if not ok:
            raise DpaxError(f"{directory}/{hf_files.CONFIG}: {what}; dpax's llama cannot "
                            "compute it exactly")
    return config


def _rope(config: dict) -> dict:
    """RoPE's settings: transformers 5's `rope_parameters`, or the
    `rope_theta` and `rope_scaling` of earlier configs."""
    return {"rope_theta": config.get("rope_theta", 10000.0),
            **(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def shape(config: dict) -> Shape:
    heads = config.get("num_attention_heads", 32)
    return Shape(vocab=config.get("vocab_size", 32000),
                 positions=config.get("max_position_embeddings", 2048),
                 layers=config.get("num_hidden_layers", 32),
                 width=config.get("hidden_size", 4096), heads=heads,
                 kv_heads=config.get("num_key_value_heads") or heads,
                 mlp_width=config.get("intermediate_size", 11008),
                 tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                 rope_theta=float(_rope(config)["rope_theta"]),
                 norm_eps=float(config.get("rms_norm_eps", 1e-6)))


def resolve(directory: str, given: dict) -> Shape:
    """The directory's shape; `given` (option -> value, None: not given)
    must agree with it, else one line names the option to change."""
    s = shape(read_config(directory))
    theirs = s.options()
    for name, value in given.items():
        if value is not None and value != theirs[name]:
            raise DpaxError(f"{directory} holds a Llama with `{name}={theirs[name]}`, not "
                            f"{value}; give `{name}={theirs[name]}` or leave it out")
    return s


def load_into(model: Llama, directory: str) -> None:
    """Set `model`'s params to a Llama directory's weights. Its shape must
    be the model's (`resolve`), its vocabulary the data's, and it must
    handle at least the model's positions."""
    s = shape(read_config(directory))
    ours = shape_of(model)
    if s.vocab != ours.vocab:
        raise DpaxError(f"{directory} has a vocabulary of {s.vocab} tokens, the data's "
                        f"tokenizer {ours.vocab}; train with the tokenizer the model was made "
                        "with")
    if s.positions < model.seq_len:
        raise DpaxError(f"{directory} handles {s.positions} positions, fewer than "
                        f"`seq_len={model.seq_len}`; give `seq_len={s.positions}` or less")
    tensors = hf_files.tensors(directory)
    shapes = {path: var[...].shape
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    new = {}
    for path, (name, transposed) in hf_names(ours.layers, ours.tie_embeddings).items():
        if name not in tensors:
            raise DpaxError(f"{directory} lacks the weight {name}")
        value = np.asarray(tensors[name], np.float32)
        value = value.T if transposed else value
        if value.shape != shapes[path]:
            raise DpaxError(f"{directory}: {name} has shape {value.shape}, the model's is "
                            f"{shapes[path]}")
        new[path] = value
    nnx.update(model, nnx.from_flat_state(new))
