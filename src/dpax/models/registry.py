"""The models the command line can name, and their config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from dpax import config as cfg
from dpax.errors import DpaxError
from dpax.models import gpt, hf_gpt2, hf_llama, llama
from dpax.models.simple import CNN, CNNBN, MLP, Linear, deep_mlp


def _gpt(in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs, **options) -> gpt.GPT:
    """`dpax.models.gpt.GPT` for text windows of `in_shape = (seq_len + 1,)` tokens
    (`dpax.data.text`) and a vocabulary of `n_out`."""
    return gpt.GPT(n_out, in_shape[0] - 1, rngs=rngs, **options)


def _llama(in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs,
           **options) -> llama.Llama:
    """`dpax.models.llama.Llama` for text windows, as `_gpt`; options left
    None take Llama's defaults."""
    return llama.Llama(n_out, in_shape[0] - 1, rngs=rngs,
                       **{k: v for k, v in options.items() if v is not None})


MODELS: dict[str, Callable[..., nnx.Module]] = {
    "linear": Linear, "mlp": MLP, "cnn": CNN, "cnn-bn": CNNBN, "deep-mlp": deep_mlp, "gpt": _gpt,
    "llama": _llama}
# Each text model's Hugging Face module: its directory format in and out.
HF = {"gpt": hf_gpt2, "llama": hf_llama}
# The options only Llama takes (None: its default, or its init_from directory's).
LLAMA_OPTIONS = ("kv_heads", "mlp_width", "tie_embeddings", "rope_theta", "norm_eps")
# Learning rates of models that the default (`dpax.training.optim.DEFAULT_LR`)
# does not train: Adam moves every weight by about lr a step, so a layer's
# output moves by about lr x its fan-in; 3e-3 x 4096 diverges.
MODEL_LR = {"deep-mlp": 1e-4}
# The models that take text windows (task "lm"), and only those.
TEXT_MODELS = ("gpt", "llama")


@dataclasses.dataclass
class ModelConfig:
    """Which model, and the shape of those that take options (gpt)."""

    name: str = cfg.field("cnn", "model: linear, mlp, cnn, cnn-bn (BatchNorm + dropout), "
                          "deep-mlp (~100M params), gpt (GPT-2's transformer) or llama "
                          "(RoPE, RMSNorm, SwiGLU, grouped-query attention); the last two "
                          "for text data", flag="model")
    layers: int = cfg.field(4, "gpt, llama: transformer blocks")
    width: int = cfg.field(128, "gpt, llama: embedding width")
    heads: int = cfg.field(4, "gpt, llama: attention heads (a divisor of `width`)")
    kv_heads: int | None = cfg.field(None, "llama: key/value heads, a divisor of `heads` "
                                     "(default: `heads`; fewer: grouped-query attention)")
    mlp_width: int | None = cfg.field(None, "llama: the SwiGLU MLP's width (default: 8/3 x "
                                      "`width`, rounded up to a multiple of 64)")
    tie_embeddings: bool | None = cfg.field(None, "llama: the output layer is the token "
                                            "embedding (default: its own)")
    rope_theta: float | None = cfg.field(None, "llama: RoPE's base (default 10000)",
                                         metavar="X")
    norm_eps: float | None = cfg.field(None, "llama: RMSNorm's epsilon (default 1e-5)",
                                       metavar="X")
    dropout: float = cfg.field(0.0, "gpt, llama: dropout rate (masks independent of the "
                               "device count)")
    remat: str = cfg.field("none", "gpt, llama: activation checkpointing per block: none, "
                           "block (keep only block inputs) or dots (keep matmul outputs)",
                           how=True)
    init_from: str | None = cfg.field(
        None, "gpt, llama: start from a Hugging Face directory (config.json + safetensors, "
              "e.g. from dpax export): GPT-2 for gpt, Llama for llama; its shape must match "
              "the flags (llama: options not given are the directory's)", metavar="DIR")

    def check(self) -> None:
        cfg.one_of(self, "name", MODELS)
        for name in ("layers", "width", "heads", "kv_heads", "mlp_width"):
            cfg.whole(self, name)
        cfg.number(self, "dropout", 0, 1)
        for name in ("rope_theta", "norm_eps"):
            if getattr(self, name) is not None:
                cfg.number(self, name, 0, low_open=True)
        if self.init_from is not None and not self.takes_text:
            raise DpaxError(f"`init_from` starts a language model from Hugging Face "
                            f"weights; `model={self.name}` takes none")
        if self.takes_text:  # other models take no shape (`ignored`)
            gpt.check_shape(self.width, self.heads, self.remat)
        given = [n for n in LLAMA_OPTIONS if getattr(self, n) is not None]
        if self.name != "llama" and given:
            raise DpaxError(f"`{given[0]}` is an option of `model=llama`, not of "
                            f"`model={self.name}`")
        if self.name == "llama":
            llama.check_shape(self.width, self.heads, self.kv_heads)
        if self.init_from is not None:
            if self.name == "gpt":
                hf_gpt2.check_flags(self.init_from, self.layers, self.width, self.heads)
            else:  # the directory's shape fills in the options not given
                found = hf_llama.resolve(self.init_from, {
                    n: getattr(self, n) for n in ("layers", "width", "heads", *LLAMA_OPTIONS)})
                for n in LLAMA_OPTIONS:
                    setattr(self, n, getattr(found, n))

    def ignored(self) -> str | None:
        """The refusal of an option set away from its default that this model
        ignores (a new run would train silently without it), or None. Not
        part of `check`: a run saved with one still loads and resumes."""
        if not self.takes_text:
            for name in ("layers", "width", "heads", "dropout", "remat"):
                if cfg.changed(self, name):
                    return (f"`{name}` is an option of `model=gpt` and `model=llama`, not of "
                            f"`model={self.name}`")
        return None

    @property
    def lr(self) -> float | None:
        """The learning rate a run of this model takes unless told otherwise
        (None: the optimizer's default)."""
        return MODEL_LR.get(self.name)

    @property
    def takes_text(self) -> bool:
        return self.name in TEXT_MODELS

    def options(self) -> dict:
        """The keyword options of the models that take them."""
        if not self.takes_text:
            return {}
        own = {n: getattr(self, n) for n in LLAMA_OPTIONS} if self.name == "llama" else {}
        return {"layers": self.layers, "width": self.width, "heads": self.heads,
                "dropout": self.dropout, "remat": self.remat, **own}

    def flops_per_token(self, param_count: int, seq_len: int, vocab: int = 0) -> float | None:
        """Training FLOPs per token of the text model this config builds, with
        `param_count` params, on windows of `seq_len` and a vocabulary of
        `vocab` (None for other models)."""
        if not self.takes_text:
            return None
        # What only adds or looks up does no matmul: GPT's position table,
        # and Llama's token embedding when it has an output layer of its own.
        lookups = seq_len * self.width if self.name == "gpt" else (
            0 if self.tie_embeddings else vocab * self.width)
        return gpt.flops_per_token(param_count - lookups, self.layers, self.width, seq_len)

    def build(self, in_shape: tuple[int, ...], n_out: int, seed: int,
              task: str | None = None) -> nnx.Module:
        """The model, with `init_from`'s weights if given."""
        model = make_model(self.name, in_shape, n_out, seed, task, **self.options())
        if self.init_from is not None:
            HF[self.name].load_into(model, self.init_from)
        return model


def make_model(name: str, in_shape: tuple[int, ...], n_out: int, seed: int,
               task: str | None = None, **options) -> nnx.Module:
    """Build a registered model for inputs of `in_shape` (no batch axis).

    Args:
      name: one of `MODELS`: "linear", "mlp", "cnn", "cnn-bn", "deep-mlp" or
        "gpt".
      in_shape: one example's shape, without the batch axis (NHWC images for
        the CNNs; a window length for "gpt").
      n_out: outputs per example (classes, targets, or the vocabulary size).
      seed: the key the parameters are initialized from.
      task: the data's task, if known ("lm" for text windows), to refuse a
        model that does not fit it; None: not checked.
      **options: for the models that take them (gpt: `layers`, `width`,
        `heads`, `dropout`, `remat`).

    Returns:
      The `nnx.Module`, initialized.

    Raises:
      DpaxError: an unknown `name`, a CNN for examples that are not images,
        or a model that does not fit `task`.
    """
    if name not in MODELS:
        raise DpaxError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if name in ("cnn", "cnn-bn") and len(in_shape) != 3:
        raise DpaxError(
            f"{name} needs NHWC images, the data has examples of shape {in_shape}; "
            "use `model=mlp` or linear"
        )
    if task is not None and (task == "lm") != (name in TEXT_MODELS):
        raise DpaxError(f"{name} does not fit {task} data; use `model=gpt` with `data=text` "
                        "(or text:PATH), and other models with other data")
    return MODELS[name](tuple(in_shape), n_out, rngs=nnx.Rngs(seed), **options)
