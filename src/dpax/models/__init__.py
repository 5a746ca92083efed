"""Models: dpax's own (`simple`, `gpt`), by name for the CLI; other models
brought in (`bridge`); losses and N-independent layers.

  simple     linear, mlp, cnn, cnn-bn, deep-mlp: small models written for ONE device
  gpt        a GPT for byte-token text, with remat policies
  losses     per-example losses and predictions of each task
  layers     SyncBatchNorm, per-example dropout: what makes them N-independent
  bridge     Linen modules and plain functions as NNX modules
  generate   a language model's continuation of a prompt
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from dpax._submodules import lazy_submodules
from dpax.errors import DpaxError
from dpax.models.gpt import GPT
from dpax.models.simple import CNN, CNNBN, MLP, Linear, deep_mlp

__all__ = ["CNN", "CNNBN", "GPT", "MLP", "MODELS", "TEXT_MODELS", "Linear", "deep_mlp",
           "make_model"]


def _gpt(in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs, **options) -> GPT:
    """`dpax.models.gpt.GPT` for text windows of `in_shape = (seq_len + 1,)` tokens
    (`dpax.data.text`) and a vocabulary of `n_out`."""
    return GPT(n_out, in_shape[0] - 1, rngs=rngs, **options)


MODELS: dict[str, Callable[..., nnx.Module]] = {
    "linear": Linear, "mlp": MLP, "cnn": CNN, "cnn-bn": CNNBN, "deep-mlp": deep_mlp, "gpt": _gpt}
# The models that take text windows (task "lm"), and only those.
TEXT_MODELS = ("gpt",)


def make_model(name: str, in_shape: tuple[int, ...], n_out: int, seed: int,
               task: str | None = None, **options) -> nnx.Module:
    """Build a registered model for inputs of `in_shape` (no batch axis);
    `options` go to the models that take them (gpt: layers, width, heads,
    dropout, remat)."""
    if name not in MODELS:
        raise DpaxError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    if name in ("cnn", "cnn-bn") and len(in_shape) != 3:
        raise DpaxError(
            f"{name} needs NHWC images, the data has examples of shape {in_shape}; "
            "use --model mlp or linear"
        )
    if task is not None and (task == "lm") != (name in TEXT_MODELS):
        raise DpaxError(f"{name} does not fit {task} data; use --model gpt with --data text "
                        "(or text:PATH), and other models with other data")
    kwargs = options if name in TEXT_MODELS else {}
    return MODELS[name](tuple(in_shape), n_out, rngs=nnx.Rngs(seed), **kwargs)


__getattr__ = lazy_submodules(__name__)  # e.g. `dpax.models.layers`
