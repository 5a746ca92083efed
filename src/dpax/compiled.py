"""The compiled steps of one Trainer: step.py's per-device functions, wrapped
by the backend, as functions of the state's flat list of arrays.

A `TrainState` holds nnx Variables, which JAX flattens in Python on every
call; a flat list of arrays in and out keeps that cost out of the step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dpax import metrics
from dpax.step import (
    StepOptions,
    TrainState,
    make_eval_step,
    make_multi_step,
    make_predict_step,
    make_train_step,
)


class CompiledSteps:
    """`train`, `train_multi`, `eval` and `predict` over flat state leaves.

    `train(leaves, sums, batch) -> (leaves, sums)` folds the step's metrics into
    packed running sums on the device (`dpax.metrics`); `traces` counts the
    traces (compilations) of each kind.
    """

    def __init__(self, backend, graphdef, state: TrainState, state_specs, loss_fn, tx,
                 schedule, options: StepOptions, predict_fn: Callable | None):
        self.backend = backend
        self.state_def = jax.tree.structure(state)
        self.traces: collections.Counter = collections.Counter()
        leaf_specs = None if state_specs is None else _leaf_specs(state_specs, state)
        train_step = make_train_step(graphdef, loss_fn, tx, schedule, options)

        def summing(state, sums, batch):
            state, step_metrics = train_step(state, batch)
            return state, metrics.accumulate(step_metrics, sums)

        self.train = backend.train(self._flat("train", summing, True), leaf_specs)
        self.train_multi = backend.train_multi(
            self._flat("train_multi", make_multi_step(summing), True), leaf_specs)
        # Traced (never compiled), for the shapes of the metrics.
        self._metrics_only = backend.reduce(
            self._flat("metrics_only", lambda state, batch: train_step(state, batch)[1]),
            leaf_specs)
        self.packing: metrics.Packing | None = None
        self._zero_sums = None
        eval_step = make_eval_step(graphdef, loss_fn, options.layout)
        self.eval = backend.reduce(self._flat("eval", eval_step), leaf_specs)
        self.predict = None
        if predict_fn is not None:
            predict_step = make_predict_step(graphdef, predict_fn, options.layout)
            self.predict = backend.per_example(self._flat("predict", predict_step), leaf_specs)

    def _flat(self, kind: str, fn: Callable, returns_state: bool = False) -> Callable:
        """`fn(state, *args)` as a function of the state's leaves (returning new
        leaves if it returns a state); counts its traces."""
        def flat(leaves, *args):
            self.traces[kind] += 1  # runs once per trace, i.e. per compilation
            out = fn(jax.tree.unflatten(self.state_def, leaves), *args)
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


def _leaf_specs(specs: Any, state: TrainState) -> list:
    """One PartitionSpec per leaf of `state` from a tree prefix of specs."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    full = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), specs, state,
                        is_leaf=is_spec)
    return jax.tree.leaves(full, is_leaf=is_spec)
