"""The compiled steps of one Trainer: step.py's per-device functions, wrapped
by the backend, as functions of the state's flat list of arrays.

A `TrainState` holds nnx Variables, which JAX flattens in Python on every
call; a flat list of arrays in and out keeps that cost out of the step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dpax.data.batches import gather_rows
from dpax.parallel.backends import Backend
from dpax.parallel.layout import Layout, specs
from dpax.training import metrics
from dpax.training.state import TrainState
from dpax.training.step import (
    StepOptions,
    make_eval_step,
    make_multi_step,
    make_predict_step,
    make_train_step,
)


class CompiledSteps:
    """`train`, `train_multi`, `eval` and `predict` over flat state leaves;
    `train_rows` and `train_multi_rows` take `(examples on the devices, batch
    of their indices)` as the batch (`dpax.data.resident`).

    `train(leaves, sums, batch) -> (leaves, sums)` folds the step's metrics into
    packed running sums on the device (`dpax.training.metrics`); `traces` counts the
    traces (compilations) of each kind.
    """

    def __init__(self, backend: Backend, graphdef, state: TrainState, layout: Layout, loss_fn, tx,
                 schedule, options: StepOptions, predict_fn: Callable | None):
        self.backend = backend
        self.state_def = jax.tree.structure(state)
        self.traces: collections.Counter = collections.Counter()
        leaf_specs = None if layout.whole_state else jax.tree.leaves(
            specs(layout), is_leaf=lambda x: isinstance(x, P))
        train_step = make_train_step(graphdef, loss_fn, tx, layout, schedule, options,
                                     backend.per_device)

        def summing(state, sums, batch):
            state, step_metrics = train_step(state, batch)
            return state, metrics.accumulate(step_metrics, sums)

        def metrics_only(state, batch):  # traced (never compiled), for the metrics' shapes
            return train_step(state, batch)[1]

        multi = make_multi_step(summing, unroll=backend.platform.unroll_steps)

        def gathered(step):
            """`step` on (examples on the devices, batch of their indices): the
            batch (or a call's stacked batches) gathered inside the step."""
            return lambda state, sums, data_rows: step(state, sums, gather_rows(*data_rows))

        train_rows = self._flat("train", gathered(summing), True)
        multi_rows = self._flat("train_multi", gathered(multi), True)
        train, multi = self._flat("train", summing, True), self._flat("train_multi", multi, True)
        metrics_only = self._flat("metrics_only", metrics_only)
        if layout.per_device_update:  # the whole step runs per device
            self.train = backend.stepper(train, leaf_specs)
            self.train_multi = backend.multi_stepper(multi, leaf_specs)
            self.train_rows = backend.stepper(train_rows, leaf_specs, with_data=True)
            self.train_multi_rows = backend.multi_stepper(multi_rows, leaf_specs, with_data=True)
            self._metrics_only = backend.reduce(metrics_only, leaf_specs)
        else:  # the update runs on the logical state under jit
            self.train = backend.global_stepper(train, leaf_specs)
            self.train_multi = backend.global_stepper(multi, leaf_specs, steps_axis=True)
            self.train_rows = backend.global_stepper(train_rows, leaf_specs, with_data=True)
            self.train_multi_rows = backend.global_stepper(multi_rows, leaf_specs,
                                                           steps_axis=True, with_data=True)
            self._metrics_only = metrics_only
        self.packing: metrics.Packing | None = None
        self._zero_sums = None
        eval_step = make_eval_step(graphdef, loss_fn, layout, options)
        self.eval = backend.reduce(self._flat("eval", eval_step), leaf_specs)
        self.predict = None
        if predict_fn is not None:
            predict_step = make_predict_step(graphdef, predict_fn, layout, options)
            self.predict = backend.per_example(self._flat("predict", predict_step), leaf_specs)

    def _flat(self, kind: str, fn: Callable, returns_state: bool = False) -> Callable:
        """`fn(state, *args)` as a function of the state's leaves (returning new
        leaves if it returns a state); counts its traces. It holds no reference
        to `self`: the compiled functions must not keep their owner (and its
        executables) alive in a reference cycle until a full collection."""
        traces, state_def = self.traces, self.state_def

        def flat(leaves, *args):
            traces[kind] += 1  # runs once per trace, i.e. per compilation
            out = fn(jax.tree.unflatten(state_def, leaves), *args)
            if returns_state:
                state, step_metrics = out
                return jax.tree.leaves(state), step_metrics
            return out

        return flat

    def zero_sums(self, leaves: list, placed: dict) -> dict:
        """Zero metric sums, placed like the step's; the shapes come from one
        trace of the step on `placed` (one step's batch, as the backend places it)."""
        if self._zero_sums is None:
            shapes = jax.eval_shape(self._metrics_only, leaves, placed)
            # `host` of the backend's layout gives the logical (per-replica) shapes.
            self.packing = metrics.Packing(
                self.backend.host(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)))
            self._zero_sums = self.backend.put_state(self.packing.zeros())
        return self._zero_sums
