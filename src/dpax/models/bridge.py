"""Models that are not NNX modules, as NNX modules dpax trains exactly.

- `from_linen(module, *example_args)`: a Flax Linen module. Its variables
  become NNX variables (through `nnx.bridge.ToNNX`); `model.train()` and
  `model.eval()` pass its training flag and make its non-param collections
  (`batch_stats`) mutable in training. Inside a dpax step its `nn.BatchNorm`
  layers normalize with the statistics of the GLOBAL batch (padding never
  counts) and its `nn.Dropout` layers draw each example's mask from (seed,
  step, the example's global index), as dpax does for `nnx.BatchNorm` and
  `nnx.Dropout`: the result does not depend on the device count.
- `from_function(apply, params)`: a plain function of a params pytree, as
  hand-written JAX, Equinox or Haiku code has it (`apply(params, *inputs)`);
  `model.pytree()` gives the params back in the pytree's own type (after
  `fit`, the trained ones). `dpax.models.layers.example_dropout` is its
  N-independent dropout.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import linen, nnx
from flax.linen import normalization
from flax.nnx.bridge import variables as bridge_variables

from dpax.errors import DpaxError
from dpax.models.layers import current, example_dropout, global_moments


class LinenModel(nnx.Module):
    """A Linen module with its variables, called like the module.

    `train_kwarg` names the module's training flag (e.g. `train`), passed as
    `not self.deterministic`; None: the module takes none."""

    def __init__(self, wrapped: nnx.bridge.ToNNX, train_kwarg: str | None):
        self.wrapped = wrapped
        self.train_kwarg = train_kwarg
        # nnx's `train()`/`eval()` set these, as on nnx.Dropout and nnx.BatchNorm.
        self.deterministic = False
        self.use_running_average = False
        attrs = {k: v for k, v in vars(wrapped).items()
                 if not k.startswith(("to_nnx__", "_pytree__"))}
        collections = bridge_variables.nnx_attrs_to_linen_vars(attrs)
        self.mutable = tuple(sorted(set(collections) - {"params"}))  # e.g. batch_stats

    def __call__(self, *args, **kwargs):
        training = not self.deterministic
        if self.train_kwarg is not None:
            kwargs.setdefault(self.train_kwarg, training)
        mutable = list(self.mutable) if training and self.mutable else False
        ctx = current()
        if ctx is None:
            return self.wrapped(*args, mutable=mutable, **kwargs)
        # In a dpax step: each random stream keyed by the step's key, the same
        # on every device (nn.Dropout draws per example instead, below).
        names = sorted(name for name, _ in self.wrapped.to_nnx__rngs.items())
        key = ctx.key if ctx.key is not None else jax.random.key(0)
        rngs = nnx.Rngs(**{n: jax.random.fold_in(key, i) for i, n in enumerate(names)})
        with linen.intercept_methods(_intercept):
            return self.wrapped(*args, mutable=mutable, rngs=rngs, **kwargs)


def _intercept(next_fun, args, kwargs, context):
    """Linen method interceptor in a dpax step: `nn.BatchNorm` and `nn.Dropout`
    (their own classes, not subclasses) computed the N-independent way."""
    module, ctx = context.module, current()
    if context.method_name != "__call__" or module.is_initializing() or ctx is None:
        return next_fun(*args, **kwargs)
    if ctx.sync_batchnorm and type(module) is linen.BatchNorm:
        return _batchnorm(module, ctx, next_fun, *args, **kwargs)
    if type(module) is linen.Dropout:
        return _dropout(module, ctx, next_fun, *args, **kwargs)
    return next_fun(*args, **kwargs)


def _batchnorm(m: linen.BatchNorm, ctx, next_fun, x, use_running_average=None, *, mask=None):
    """Linen's BatchNorm.__call__ with the global batch's statistics."""
    use_ra = linen.module.merge_param("use_running_average", m.use_running_average,
                                      use_running_average)
    if use_ra:
        return next_fun(x, use_running_average, mask=mask)
    feature_axes = normalization._canonicalize_axes(x.ndim, m.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    feature_shape = [x.shape[a] for a in feature_axes]
    stat_dtype = jax.numpy.float32 if m.force_float32_reductions else m.param_dtype
    ra_mean = m.variable("batch_stats", "mean", lambda s: jax.numpy.zeros(s, stat_dtype),
                         feature_shape)
    ra_var = m.variable("batch_stats", "var", lambda s: jax.numpy.ones(s, stat_dtype),
                        feature_shape)
    (mean, var), (running_mean, running_var) = global_moments(x, feature_axes, ctx, mask)
    ra_mean.value = m.momentum * ra_mean.value + (1 - m.momentum) * running_mean
    ra_var.value = m.momentum * ra_var.value + (1 - m.momentum) * running_var
    return normalization._normalize(
        m, x, mean, var, reduction_axes, feature_axes, m.dtype, m.param_dtype, m.epsilon,
        m.use_bias, m.use_scale, m.bias_init, m.scale_init, m.force_float32_reductions)


def _dropout(m: linen.Dropout, ctx, next_fun, inputs, deterministic=None, rng=None):
    """Linen's Dropout.__call__ with masks independent of the device count."""
    det = linen.module.merge_param("deterministic", m.deterministic, deterministic)
    if det or ctx.key is None or m.rate == 0.0:
        return next_fun(inputs, deterministic, rng)
    return example_dropout(inputs, m.rate, m.broadcast_dims, ctx)


def from_linen(module: linen.Module, *example_args, train_kwarg: str | None = "train",
               seed: int = 0, **example_kwargs) -> LinenModel:
    """A Linen module as an NNX module for `dpax.Trainer`.

    Args:
      module: the Linen module, written for one device.
      example_args, example_kwargs: inputs to initialise its variables with
        (one example is enough: e.g. `x[:1]`).
      train_kwarg: the keyword of the module's training flag (`train: bool`),
        given `True` in training and `False` in evaluation; None: it has none.
      seed: the key of the variables' initialisation (stream "params"; random
        streams outside a dpax step, e.g. "dropout", derive from it too).

    Returns:
      The model (a `LinenModel`), its variables initialised.

    Raises:
      DpaxError: `module` is not a Linen module, or its `__call__` takes no
        `train_kwarg`.
    """
    if not isinstance(module, linen.Module):
        raise DpaxError(f"from_linen takes a flax.linen Module, got {type(module).__name__}")
    if train_kwarg is not None and not takes(module, train_kwarg):
        raise DpaxError(f"{type(module).__name__}.__call__ takes no `{train_kwarg}`; name its "
                        "training flag with `train_kwarg=...`, or `train_kwarg=None`")
    init_kwargs = dict(example_kwargs)
    if train_kwarg is not None:
        init_kwargs.setdefault(train_kwarg, False)
    wrapped = nnx.bridge.ToNNX(module, rngs=nnx.Rngs(seed, dropout=seed + 1))
    nnx.bridge.lazy_init(wrapped, *example_args, **init_kwargs)
    return LinenModel(wrapped, train_kwarg)


def takes(module: linen.Module, name: str) -> bool:
    """Whether the module's `__call__` takes keyword `name`."""
    params = inspect.signature(type(module).__call__).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


class FunctionModel(nnx.Module):
    """`apply(params, *inputs)` with its params as NNX parameters: each leaf
    of the params pytree becomes an `nnx.Param` in the same place, so the
    pytree keeps its own type (an Equinox module stays one)."""

    def __init__(self, apply: Callable, params: Any):
        self.apply = apply
        self.params = nnx.data(jax.tree.map(nnx.Param, params))

    def __call__(self, *args, **kwargs):
        return self.apply(self.pytree(), *args, **kwargs)

    def pytree(self) -> Any:
        """The params in the type and structure given to `from_function` (a
        dict, an Equinox module, Haiku's params), holding this model's
        arrays: after `Trainer.fit`, the trained ones (the model given to the
        Trainer is updated in place; `Trainer.model()` is a trained copy)."""
        return jax.tree.map(lambda v: v[...], self.params,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def from_function(apply: Callable, params: Any) -> FunctionModel:
    """A model written as a plain function of a params pytree as an NNX
    module for `dpax.Trainer`: `model(*inputs)` is `apply(params, *inputs)`.

    `Trainer.params` holds the params as an `nnx.State` (nested dicts under
    `params`), as for every model; `model.pytree()` gives them back in the
    pytree's own type.

    Args:
      apply: `apply(params, *inputs) -> outputs`, e.g. hand-written JAX,
        `lambda p, x: jax.vmap(eqx.combine(p, static))(x)` for Equinox's
        `eqx.partition` halves, or a Haiku `transform`'s `apply` without
        its rng (`hk.without_apply_rng`).
      params: the pytree of arrays to train.

    Returns:
      The model (a `FunctionModel`).

    Raises:
      DpaxError: `apply` is not callable, or `params` holds no arrays or a
        leaf that is not an array.
    """
    if not callable(apply):
        raise DpaxError(f"from_function takes apply(params, *inputs), got {type(apply).__name__}")
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise DpaxError("from_function needs params: a pytree of arrays")
    for path, leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise DpaxError(
                f"from_function's params hold a {type(leaf).__name__} at "
                f"params{jax.tree_util.keystr(path)}; give a pytree of arrays only (an "
                "Equinox module: its arrays from `eqx.partition(model, eqx.is_array)`)")
    return FunctionModel(apply, params)
