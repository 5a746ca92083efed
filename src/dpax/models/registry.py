"""The models the command line can name, and their config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from dpax import config as cfg
from dpax.errors import DpaxError
from dpax.models import gpt, hf_gpt2
from dpax.models.simple import CNN, CNNBN, MLP, Linear, deep_mlp


def _gpt(in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs, **options) -> gpt.GPT:
    """`dpax.models.gpt.GPT` for text windows of `in_shape = (seq_len + 1,)` tokens
    (`dpax.data.text`) and a vocabulary of `n_out`."""
    return gpt.GPT(n_out, in_shape[0] - 1, rngs=rngs, **options)


MODELS: dict[str, Callable[..., nnx.Module]] = {
    "linear": Linear, "mlp": MLP, "cnn": CNN, "cnn-bn": CNNBN, "deep-mlp": deep_mlp, "gpt": _gpt}
# Learning rates of models that the default (`dpax.training.optim.DEFAULT_LR`)
# does not train: Adam moves every weight by about lr a step, so a layer's
# output moves by about lr x its fan-in; 3e-3 x 4096 diverges.
MODEL_LR = {"deep-mlp": 1e-4}
# The models that take text windows (task "lm"), and only those.
TEXT_MODELS = ("gpt",)


@dataclasses.dataclass
class ModelConfig:
    """Which model, and the shape of those that take options (gpt)."""

    name: str = cfg.field("cnn", "model: linear, mlp, cnn, cnn-bn (BatchNorm + dropout), "
                          "deep-mlp (~100M params), or gpt (a transformer, for text data)",
                          flag="model")
    layers: int = cfg.field(4, "gpt: transformer blocks")
    width: int = cfg.field(128, "gpt: embedding width")
    heads: int = cfg.field(4, "gpt: attention heads (a divisor of `width`)")
    dropout: float = cfg.field(0.0, "gpt: dropout rate (masks independent of the device "
                               "count)")
    remat: str = cfg.field("none", "gpt: activation checkpointing per block: none, block "
                           "(keep only block inputs) or dots (keep matmul outputs)", how=True)
    init_from: str | None = cfg.field(
        None, "gpt: start from a Hugging Face GPT-2 directory (config.json + "
              "model.safetensors, e.g. from dpax export); its shape must match the flags",
        metavar="DIR")

    def check(self) -> None:
        cfg.one_of(self, "name", MODELS)
        for name in ("layers", "width", "heads"):
            cfg.whole(self, name)
        cfg.number(self, "dropout", 0, 1)
        gpt.check_shape(self.width, self.heads, self.remat)
        if self.init_from is not None:
            if not self.takes_text:
                raise DpaxError(f"`init_from` starts a GPT from Hugging Face weights; "
                                f"`model={self.name}` takes none")
            hf_gpt2.check_flags(self.init_from, self.layers, self.width, self.heads)

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
        return {"layers": self.layers, "width": self.width, "heads": self.heads,
                "dropout": self.dropout, "remat": self.remat}

    def flops_per_token(self, param_count: int, seq_len: int) -> float | None:
        """Training FLOPs per token of the text model this config builds, with
        `param_count` params, on windows of `seq_len` (None for other models)."""
        if not self.takes_text:
            return None
        n = param_count - seq_len * self.width  # the position table only adds
        return gpt.flops_per_token(n, self.layers, self.width, seq_len)

    def build(self, in_shape: tuple[int, ...], n_out: int, seed: int,
              task: str | None = None) -> nnx.Module:
        """The model, with `init_from`'s weights if given."""
        model = make_model(self.name, in_shape, n_out, seed, task, **self.options())
        if self.init_from is not None:
            hf_gpt2.load_into(model, self.init_from)
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
