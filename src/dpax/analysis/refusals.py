"""The refusals a step's analyses give before training: what N devices would
compute differently from one device, and no average mends.

`refuse` reads one trace of a step's forward on one device's rows: a random
draw shaped by the rows from a key every device holds alike
(`PerDeviceRandom`), numeric model state computed from each device's rows
while `sync_batchnorm` asks for one device's numbers or when it is a count
(`PerDeviceState`), a loss or layer that mixes the examples a device holds
(`MixesExamples`), and one that computes with how many rows it holds
(`ReadsBatchSize`, from one more trace: `dpax.analysis.batch_size`). It
returns the state that is averaged instead.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from dpax.analysis.batch_size import uses_rows_count
from dpax.analysis.live import live
from dpax.analysis.propagate import COLLECTIVES, PER_DEVICE, axes, leaf_flags, trace, user_line
from dpax.analysis.rows import UNKNOWN, first_mixed, mixing
from dpax.analysis.varying import analyze, varying
from dpax.errors import (
    DpaxError,
    DpaxWarning,
    MixesExamples,
    PerDeviceRandom,
    PerDeviceState,
    ReadsBatchSize,
)

# forward(params, model_state, rows): the params and the state are alike on
# every device, the rows (one device's micro-batch) are its own.
ON_ROWS = (False, False, True)


@dataclasses.dataclass(frozen=True)
class Asks:
    """What the step asks of the analyses (`dpax.training.step.StepOptions`'s)."""

    own_random: bool = False  # the model draws from RNG streams of its own
    average_state: bool = False  # find the model state that differs per device
    sync_batchnorm: bool = True  # off: the user asked for per-device batch statistics


def refuse(forward: Callable, args: tuple, axis: str | tuple[str, ...],
           size: int | tuple[int, ...], asks: Asks,
           jaxpr: jcore.ClosedJaxpr | None = None) -> dict[int, str]:
    """{leaf index: path} of the numeric model state (`args[1]`) that a step
    leaves different on each of `size` devices of `axis` (several axes:
    `size[i]` along each), which is averaged; raises what no average mends.
    The new state's leaves are the last of `forward`'s outputs. `jaxpr`:
    `forward`'s on `args` with its constants, where the caller traced it
    already (its inputs the leaves of `args`; the random draws' check
    traces `forward` again)."""
    if math.prod(size if isinstance(size, tuple) else (size,)) == 1:
        return {}
    jaxpr = None if jaxpr is None else live(jaxpr)
    kinds = None if jaxpr is None else _mixing(jaxpr, args)
    if kinds is not None and UNKNOWN in kinds:
        # The caller's trace (a gradient's forward part) holds derivative
        # forms the analysis cannot read (cummax's or a product's JVP): read
        # the forward's own ops instead, at the cost of one more trace of it.
        jaxpr = kinds = None
    if jaxpr is None:
        jaxpr = trace(forward, args, axis, size)
    if isinstance(axis, tuple):
        _refuse_partial_sums(jaxpr.jaxpr, args, axis)
    per_device = {}
    if asks.own_random or asks.average_state:
        per_device = _state_per_device(forward, args, jaxpr.jaxpr, axis, size, asks)
    devices = math.prod(size) if isinstance(size, tuple) else size  # for messages
    # With sync_batchnorm off the user asked for per-device batch statistics:
    # a mean over a device's rows mixes them and divides by their number.
    if not asks.sync_batchnorm:
        return per_device
    if kinds is None:
        kinds = _mixing(jaxpr, args)
    mixed = first_mixed(kinds)
    if mixed:
        raise MixesExamples(
            f"an example's loss or prediction depends on the other examples in its batch "
            f"({mixed.where}), "
            f"so {devices} devices, each holding only its own rows, would not train what one "
            "device trains: compute each example's loss from that example alone; for batch "
            "statistics use nnx.BatchNorm or Linen's nn.BatchNorm (dpax synchronizes them); "
            "for a loss over the whole batch (contrastive) take the other examples from "
            "dpax.models.layers.global_rows", mixed.where)
    counted = uses_rows_count(forward, args, ON_ROWS, axis, size,
                              not_judged=lambda error: _warn_not_judged(error, devices))
    if counted:
        raise ReadsBatchSize(
            f"the loss or the model computes with the number of rows a device holds or a "
            f"row's position among them, at {counted} (e.g. / x.shape[0], "
            f"jnp.arange(x.shape[0]), noise[:x.shape[0]]); on {devices} devices that is a "
            "device's share of the batch, so they would not train what one device trains: "
            "return each example's own loss (dpax takes the mean over the global batch; "
            "weights go in loss_fn's third output), and take an example's position in the "
            "batch from batch['index']", counted)
    return per_device


def _warn_not_judged(error: BaseException, devices: int) -> None:
    """The batch-size refusal could not read the forward: say so, naming the
    line its trace failed at, rather than train what may differ in silence."""
    at = user_line(error)
    lines = str(error).strip().splitlines()
    warnings.warn(
        f"dpax cannot check whether the loss or the model computes with the number of rows a "
        f"device holds: it does not trace with that number as a symbol"
        f"{f' (at {at}: ' if at else ' ('}{type(error).__name__}: "
        f"{lines[0][:120] if lines else ''}), and its traces at a device's rows and at one "
        f"device's cannot be compared. If it does, {devices} devices do not compute what one "
        "device computes: return each example's own loss, or compare with one device by "
        "`dpax check` (dpax.check_equivalence)", DpaxWarning, stacklevel=2)


def _mixing(closed: jcore.ClosedJaxpr, args: tuple) -> list:
    return mixing(closed.jaxpr, leaf_flags(args, ON_ROWS), closed.consts)


# Primitives that name mesh axes: what they compute over a part of the
# devices is not what one device computes.
_NAMED = COLLECTIVES | PER_DEVICE | {"pmean"}


def _refuse_partial_sums(jaxpr, args: tuple, axis: tuple[str, ...]) -> None:
    """With hybrid sharding's groups the devices span several mesh axes:
    refuse a model or loss that combines what the rows give over some of
    them only (`psum(x, "data")`: one group's devices). dpax's own gathers of
    the params (alike on every device) are not refused, nor a device's index
    along one axis: JAX computes the index over several axes from those."""
    found = []

    def observe(eqn, flags):
        named = set(axes(eqn.params)) if eqn.primitive.name in _NAMED else set()
        if (named & set(axis) and not set(axis) <= named and any(flags)
                and eqn.primitive.name != "axis_index"):
            found.append(f"{eqn.primitive.name} over {', '.join(sorted(named))}")

    varying(jaxpr, leaf_flags(args, ON_ROWS), axis, observe=observe)
    if found:
        raise DpaxError(
            f"the model or loss computes {found[0]}, which with `replicas` spans one group of "
            "the devices, not all of them, so they would not train what one device trains: "
            "combine over the batch context's axis (`dpax.models.layers.current().axis`, "
            "every device) or leave `replicas` out")


def _state_per_device(forward, args, jaxpr, axis, size, asks: Asks) -> dict[int, str]:
    flags, shared = analyze(forward, args, ON_ROWS, axis, size, draws=asks.own_random,
                            jaxpr=jaxpr)
    size = math.prod(size) if isinstance(size, tuple) else size  # the devices, for messages
    if shared:
        raise PerDeviceRandom(
            f"the model draws random numbers shaped {shared[0]} by a device's rows from a key "
            f"of its own, the same on every device, so {size} devices would not train what "
            "one device trains: use nnx.Dropout or dpax.models.layers.example_dropout "
            "(`broadcast_dims` for a drop-path mask), whose masks follow each example's index")
    if not asks.average_state:
        return {}
    paths = jax.tree_util.tree_flatten_with_path(args[1])[0]
    per_device = {i: jax.tree_util.keystr(path, simple=True, separator=".")
                  for i, ((path, leaf), d) in enumerate(zip(paths, flags[-len(paths):]))
                  if d and numeric(leaf)}
    # Counts and other integers: an average of them means nothing.
    whole = any(not jnp.issubdtype(paths[i][1].dtype, jnp.floating) for i in per_device)
    if per_device and (asks.sync_batchnorm or whole):
        hint = ("" if whole else ", or pass `sync_batchnorm=False` to average it across "
                "devices (not equivalent)")
        raise PerDeviceState(
            f"the model's state {', '.join(per_device.values())} is computed from each "
            f"device's own rows by a layer dpax does not synchronize, so {size} devices "
            "would not train what one device trains: for batch statistics use nnx.BatchNorm "
            f"or Linen's nn.BatchNorm (dpax synchronizes them){hint}",
            list(per_device.values()))
    return per_device


def numeric(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.number)
