"""`Trainer`: data-parallel training, evaluation and prediction of one NNX model.

The model, loss and optimizer are written for one device; the Trainer
replicates the state, splits each global batch over its devices, and runs one
compiled, donated step per batch. The step folds its metrics into running sums
on the device; the host reads them only at log boundaries.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpax import losses as losses_mod
from dpax.backends import make_backend
from dpax.devices import select_devices
from dpax.errors import DpaxError
from dpax.layers import has_per_device_state, synchronize
from dpax.pipeline import BatchPlan, eval_batches, local_part, train_batches
from dpax.sharding import is_key, padded_size
from dpax.step import (
    AXIS,
    LossFn,
    StepOptions,
    TrainState,
    init_state,
    make_eval_step,
    make_multi_step,
    make_predict_step,
    make_train_step,
    sharded_opt_init,
)

# XLA:CPU's cross-device rendezvous aborts ("Termination timeout for all
# reduce") when too many multi-device steps are queued; two in flight keep the
# device busy while the host prepares the next batch. (One device needs no cap:
# the metrics fetched at each log step bound how far the host runs ahead.)
MAX_IN_FLIGHT = 2
# Batches made ready this many calls ahead of the step that uses them: stacked
# for steps-per-call, and with several processes already placed on the devices,
# so that work for batch i+1 overlaps step i. (One process hands host arrays to
# the step, whose own transfer is cheaper than placing them first.)
PREFETCH = 2
SCALARS = "_scalars"  # the packed scalar metrics of a training step
# Steps summed on the device before the host takes the sums over in float64
# (without a sync: it keeps the array and reads it at the next log). f32 counts
# stay exact for 256 steps of global batches up to 65,536 examples.
STEPS_PER_SUM = 256


@contextlib.contextmanager
def _gc_frozen():
    """Keep the objects that exist before the loop (JAX's caches, the model, the
    data) out of Python's cyclic collector while it runs: a full collection
    walks all of them and paused the tiny MLP's loop for ~100 ms at a time
    (steps/s over 1024-step runs: median 14.9k, min 4.3k; frozen 17.1k, 12.8k).
    Cycles made during the loop are still collected."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:  # someone else's freeze is theirs to undo
            gc.unfreeze()


def _prefetch(items: Iterator, depth: int) -> Iterator:
    """Yield from `items` while keeping `depth` more already produced (placed)."""
    queue: collections.deque = collections.deque()
    for item in items:
        queue.append(item)
        if len(queue) > depth:
            yield queue.popleft()
    while queue:
        yield queue.popleft()


class Trainer:
    """Data-parallel trainer for one Flax NNX model.

    Args:
      model: an `nnx.Module` written for one device.
      loss_fn: `loss_fn(model, batch) -> per-example losses` or
        `(losses, {name: per-example metric})`, on one device's shard;
        `batch` has `x`, `y` and the boolean `mask` of real rows.
      optimizer: an Optax transformation (its schedule lives in its state).
      devices: a device count, a list of devices, or None for all local ones.
      backend: "shard_map" (default) or "pmap"; both give the same numbers.
      predict_fn: `predict_fn(model, batch) -> one output per example`.
      schedule: the learning-rate schedule, only to report the LR as a metric.
      grad_accum: micro-batches per device shard, accumulated inside the step.
      precision: "fp32", or "bf16" for bf16 forward/backward on fp32 params.
      allreduce_dtype: "fp32" or "bf16" for the gradient all-reduce.
      max_bad_steps: stop with `TooManyBadSteps` after this many skipped
        (non-finite) steps in a row, checked at log boundaries; None: never.
      steps_per_call: run this many steps in one compiled call (a scan over
        batches already on the device): fewer launches for small models.
      seed: the key behind dropout masks (with the step and each example's
        global index, so masks do not depend on the device count).
      sync_batchnorm: convert `nnx.BatchNorm` layers to `SyncBatchNorm`
        (global masked statistics). False keeps per-device statistics (the
        running averages are then averaged across devices): not equivalent.
      shard_optimizer_state: ZeRO-1 (shard_map backend): each device keeps and
        updates 1/N of the optimizer state after a reduce-scatter of the
        gradients, then the params are all-gathered. Exact for elementwise
        optimizers (SGD, momentum, Adam); not for a global-norm clip.
      compile_options: XLA options for every compiled step (shard_map backend),
        e.g. `{}` for XLA's defaults; None: dpax's per-step choice
        (`dpax.compile_options`: XLA:CPU's older emitters for steps that pool).
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        devices: int | Sequence[jax.Device] | None = None,
        backend: str = "shard_map",
        predict_fn: Callable | None = None,
        schedule: optax.Schedule | None = None,
        grad_accum: int = 1,
        precision: str = "fp32",
        allreduce_dtype: str = "fp32",
        max_bad_steps: int | None = 10,
        steps_per_call: int = 1,
        seed: int = 0,
        sync_batchnorm: bool = True,
        shard_optimizer_state: bool = False,
        compile_options: dict[str, Any] | None = None,
    ):
        devs = devices if isinstance(devices, (list, tuple)) else select_devices(devices)
        self.backend = make_backend(backend, devs, compile_options)
        self.n_devices = self.backend.n
        self.loss_fn = loss_fn
        self.grad_accum = grad_accum
        self.max_bad_steps = max_bad_steps
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise DpaxError(f"`steps_per_call` must be >= 1, got {steps_per_call!r}")
        self.steps_per_call = steps_per_call
        self.converted = synchronize(model, batchnorm=sync_batchnorm)
        options = StepOptions(grad_accum=grad_accum, compute_dtype=_dtype(precision),
                              allreduce_dtype=_dtype(allreduce_dtype),
                              average_state=has_per_device_state(model),
                              shard_optimizer=shard_optimizer_state)
        self._graphdef, state = init_state(model, optimizer, seed)
        self._state_spec = None  # replicated
        if shard_optimizer_state:
            if self.backend.name != "shard_map" or steps_per_call != 1:
                raise DpaxError("`shard_optimizer_state` needs `backend=shard_map` and "
                                "`steps_per_call=1`")
            state = state.replace(opt_state=sharded_opt_init(optimizer, state.params,
                                                             self.n_devices))
            # Vectors of the optimizer state are split over the devices; scalars
            # (step counts) stay replicated.
            self._state_spec = state.replace(
                step=P(), params=P(), rest=P(), bad_in_a_row=P(), rng=P(),
                opt_state=jax.tree.map(lambda x: P(AXIS) if np.ndim(x) else P(),
                                       state.opt_state))
        # ZeRO-1 optimizer vectors are padded to a multiple of N; checkpoints hold
        # the unpadded (logical) length so they resume on any device count.
        n_params = sum(np.size(x) for x in jax.tree.leaves(state.params))
        self._zero_sizes = ((n_params, -(-n_params // self.n_devices) * self.n_devices)
                            if shard_optimizer_state else None)
        self.state = self.backend.put_state(state, self._state_spec)
        leaf_specs = None if self._state_spec is None else _leaf_specs(self._state_spec, state)
        self.traces = collections.Counter()  # compilations per step kind
        train_step = self._pack_metrics(
            make_train_step(self._graphdef, loss_fn, optimizer, schedule, options))
        summing_step = self._summing(train_step)
        self._train = self.backend.train(self._flat("train", summing_step, True), leaf_specs)
        self._train_multi = self.backend.train_multi(
            self._flat("train_multi", make_multi_step(summing_step), True))
        # Traced (never compiled) once, for the shapes of the metric sums.
        self._metric_shapes = self.backend.reduce(
            self._flat("metric_shapes", lambda state, batch: train_step(state, batch)[1]),
            leaf_specs)
        self._zero_sums = None  # placed zeros shaped like the metric sums
        self._eval = self.backend.reduce(self._flat("eval", make_eval_step(
            self._graphdef, loss_fn)), leaf_specs)
        self._predict = None
        if predict_fn is not None:
            self._predict = self.backend.per_example(self._flat("predict", make_predict_step(
                self._graphdef, predict_fn)), leaf_specs)

    # The state lives as a flat list of arrays, and the compiled steps take and
    # return that list: a TrainState holds nnx Variables, which JAX flattens in
    # Python on every call (~10 us a step on a dispatch-bound model).
    @property
    def state(self) -> TrainState:
        """The training state (every field replicated, or laid out by ZeRO-1)."""
        return jax.tree.unflatten(self._state_def, self._leaves)

    @state.setter
    def state(self, state: TrainState) -> None:
        self._leaves, self._state_def = jax.tree.flatten(state)

    def _flat(self, kind: str, fn: Callable, returns_state: bool = False) -> Callable:
        """`fn(state, *args)` as a function of the state's leaves (returning new
        leaves if it returns a state); counts its traces."""
        def flat(leaves, *args):
            self.traces[kind] += 1  # runs once per trace, i.e. per compilation
            out = fn(jax.tree.unflatten(self._state_def, leaves), *args)
            if returns_state:
                state, metrics = out
                return jax.tree.leaves(state), metrics
            return out

        return flat

    def _pack_metrics(self, train_step: Callable) -> Callable:
        """Return the scalar metrics as ONE array: every output of a compiled call
        costs dispatch time, and on a small model 7 scalars cost as much as the
        step (tiny MLP, 1 device: 95 -> 51 us a call)."""
        def packed(state, batch):
            state, metrics = train_step(state, batch)
            keys = sorted(k for k, v in metrics.items() if jnp.ndim(v) == 0)
            self._metric_keys = keys  # set while tracing; fixed for the compiled step
            rest = {k: v for k, v in metrics.items() if k not in keys}
            return state, {SCALARS: jnp.stack([jnp.asarray(metrics[k], jnp.float32)
                                               for k in keys]), **rest}

        return packed

    def _summing(self, train_step: Callable) -> Callable:
        """`(state, sums, batch) -> (state, sums + this step's metrics)`: sums
        and counts add up, other metrics keep the latest value. Fetching each
        step's metrics at the log cost ~6 us a step on the host (tiny MLP, one
        device: a quarter of its step); now a log fetches one array."""
        def step(state, sums, batch):
            state, metrics = train_step(state, batch)
            added = np.array([_summed(k) for k in self._metric_keys])
            new = {SCALARS: jnp.where(added, sums[SCALARS] + metrics[SCALARS],
                                      metrics[SCALARS])}
            new.update({k: sums[k] + v if _summed(k) else v
                        for k, v in metrics.items() if k != SCALARS})
            return state, new

        return step

    def _zeros(self, placed: dict) -> dict:
        """Zero metric sums, placed like the step's (shapes from one trace of a
        step on `placed`, a batch as `put_batch` gives it)."""
        if self._zero_sums is None:
            shapes = jax.eval_shape(self._metric_shapes, self._leaves, placed)
            # `host` of the backend's layout gives the logical (per-replica) shapes.
            logical = self.backend.host(
                jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
            self._zero_sums = self.backend.put_state(logical)
        return self._zero_sums

    def _unpack(self, metrics: dict) -> dict:
        out = dict(metrics)
        out.update(zip(self._metric_keys, out.pop(SCALARS)))
        return out

    # -- one step --------------------------------------------------------------------
    def padded(self, batch_size: int) -> int:
        """Rows a global batch is padded to: a multiple of devices x micro-batches."""
        return padded_size(batch_size, self.n_devices * self.grad_accum)

    def train_step(self, host_batch: dict, size: int | None = None) -> dict:
        """One step on this process's rows of a padded, masked global batch of
        `size` rows (default: all of them); returns device-side metric sums."""
        placed = self.backend.put_batch(host_batch, size)
        self._leaves, metrics = self._train(self._leaves, self._zeros(placed), placed)
        return self._unpack(metrics)

    def lower_train_step(self, host_batch: dict, size: int | None = None) -> jax.stages.Lowered:
        """The training step lowered for this batch layout: its `.as_text()` is
        the StableHLO dpax emits, `.compile()` gives XLA's HLO and memory use."""
        placed = self.backend.put_batch(host_batch, size)
        return self._train.lower(self._leaves, self._zeros(placed), placed)

    # -- loops -----------------------------------------------------------------------
    def fit(
        self,
        x: np.ndarray,
        y: np.ndarray,
        *,
        batch_size: int,
        steps: int | None = None,
        epochs: int | None = None,
        seed: int = 0,
        log_every: int = 10,
        on_log: Callable[[int, dict], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        batches: Iterator[dict] | None = None,
    ) -> list[dict]:
        """Train on (x, y) with global batches of `batch_size` until the step
        counter reaches the total; returns the log rows.

        Batches come from `BatchPlan`: their order depends on `seed` and the step
        only, so any device count sees the same global batches.

        Args:
          on_log: called with (step, row) at every log step.
          on_step: called with the step count after every step (host-side only:
            checkpoints and preemption checks hang here).
          batches: this process's host batches from the current step on (a
            restored `train_batches` iterator); default: made here.
        """
        plan = BatchPlan(len(x), batch_size, seed)
        total = resolve_steps(steps, epochs, plan.steps_per_epoch)
        start = self.step
        size = self.padded(batch_size)
        if batches is None:
            batches = iter(train_batches(x, y, plan, self.backend.local_rows(size), start, total))
        sized = ((size, b) for b in itertools.islice(batches, max(total - start, 0)))
        return self._loop(sized, start, total, log_every, on_log, on_step,
                          plan.steps_per_epoch)

    @property
    def step(self) -> int:
        """Steps trained so far (a device-to-host sync: not for the hot loop)."""
        return int(self.backend.host(self.state.step))

    def _loop(self, sized_batches, start, total, log_every, on_log, on_step,
              steps_per_epoch=None) -> list[dict]:
        with _gc_frozen():
            return self._loop_steps(sized_batches, start, total, log_every, on_log, on_step,
                                    steps_per_epoch)

    def _loop_steps(self, sized_batches, start, total, log_every, on_log, on_step,
                    steps_per_epoch) -> list[dict]:
        rows: list[dict] = []
        pending: list[dict] = []  # device metric sums since the last log, read at the next
        sums, summed = None, 0  # the running sums and the steps in them
        in_flight: collections.deque = collections.deque()
        throttle = self.n_devices > 1  # one device has no rendezvous to overrun
        last = (time.perf_counter(), start)
        step = start
        for k, placed in _prefetch(self._placed(sized_batches), PREFETCH):
            prev, step = step, step + k
            if sums is None:  # set by `_placed` before its first batch
                sums = self._zero_sums
            if k == 1:
                self._leaves, sums = self._train(self._leaves, sums, placed)
            else:
                self._leaves, sums = self._train_multi(self._leaves, sums, placed)
            summed += k
            if throttle:
                in_flight.append(sums[SCALARS])
                if len(in_flight) > MAX_IN_FLIGHT:
                    in_flight.popleft().block_until_ready()  # waits, transfers nothing
            log_now = step // log_every > prev // log_every or step == total
            if log_now or summed >= STEPS_PER_SUM:
                pending.append(sums)
                sums, summed = None, 0
            if log_now:
                rows.append(self._log(pending, step, last, steps_per_epoch, on_log))
                pending, last = [], (time.perf_counter(), step)
            if on_step is not None:
                on_step(step)
        if sums is not None:
            pending.append(sums)
        if pending:
            rows.append(self._log(pending, step, last, steps_per_epoch, on_log))
        return rows

    def _placed(self, sized_batches):
        """(steps, device batch) per call: groups of `steps_per_call` batches of
        one size stacked for the scanned step; anything left runs one by one."""
        k = self.steps_per_call
        group: list = []
        for size, batch in sized_batches:
            if self._zero_sums is None:
                self._zeros(self.backend.put_batch(batch, size))
            if k == 1:
                yield 1, self.backend.put_batch(batch, size)
                continue
            if group and group[0][0] != size:
                yield from ((1, self.backend.put_batch(b, s)) for s, b in group)
                group = []
            group.append((size, batch))
            if len(group) == k:
                yield k, self.backend.put_batches([b for _, b in group], size)
                group = []
        yield from ((1, self.backend.put_batch(b, s)) for s, b in group)

    def _log(self, pending, step, last, steps_per_epoch, on_log) -> dict:
        host = self.backend.host(pending)  # sync point: once per log
        row = summarize([self._unpack(h) for h in host])  # float64 across the sums
        self._check_bad_steps(row)
        t_last, s_last = last
        row.update(step=step, steps_per_sec=(step - s_last) / (time.perf_counter() - t_last))
        if steps_per_epoch:
            row["epoch"] = step / steps_per_epoch
        if on_log is not None:
            on_log(step, row)
        return row

    def _check_bad_steps(self, row: dict) -> None:
        bad = int(row.pop("bad_in_a_row", 0))
        if self.max_bad_steps is not None and bad >= self.max_bad_steps:
            raise TooManyBadSteps(
                f"{bad} steps in a row had a non-finite loss or gradient and were skipped "
                f"(limit {self.max_bad_steps}); the params are the last good ones. Lower the "
                "learning rate, clip gradients (`clip_norm`) or check the data for NaNs"
            )

    def fit_stream(
        self,
        batches: Iterable[dict],
        *,
        buckets: Sequence[int] | None = None,
        log_every: int = 10,
        on_log: Callable[[int, dict], None] | None = None,
    ) -> list[dict]:
        """Train on host batches of ANY size, one step each.

        Each batch (arrays `x`, `y` of b >= 1 rows) is padded to the smallest
        bucket that holds it and masked, so the step compiles at most once per
        bucket, however many sizes arrive. Default buckets: N*K times powers of
        two (N devices, K micro-batches).
        """
        unit = self.n_devices * self.grad_accum
        if buckets is not None:
            buckets = sorted(buckets)
            if any(b % unit for b in buckets):
                raise DpaxError(f"every bucket must be a multiple of {unit} "
                                f"(devices x grad_accum), got {buckets}")

        def sized():
            for batch in batches:
                b = len(batch["x"])
                size = _bucket(b, unit, buckets)
                span = self.backend.local_rows(size)
                yield size, local_part(batch["x"], batch["y"], np.arange(b), span)

        return self._loop(sized(), self.step, None, log_every, on_log, None)

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 256) -> dict:
        """Mean loss and metrics over every example of (x, y), each counted once."""
        size = self.padded(batch_size)
        rows = self.backend.local_rows(size)
        sums = [self._eval(self._leaves, self.backend.put_batch(b, size))
                for b in eval_batches(x, y, batch_size, rows)]
        return summarize(self.backend.host(sums))  # sync point

    def predict(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """One prediction per row of `x`, in order; padding is cut off."""
        if self._predict is None:
            raise DpaxError("this Trainer was built without `predict_fn`; pass one to Trainer, "
                            "e.g. `predict_fn=dpax.classification_predict`")
        size = self.padded(batch_size)
        rows = self.backend.local_rows(size)
        outs = [self._predict(self._leaves, self.backend.put_batch(b, size))
                for b in eval_batches(x, np.zeros(len(x), np.int32), batch_size, rows)]
        flat = [self.backend.host_examples(o) for o in outs]  # sync point
        # Batch i holds examples i*batch_size.. in order, then padding: cut it off.
        sizes = [min(batch_size, len(x) - lo) for lo in range(0, len(x), batch_size)]
        return np.concatenate([f[:k] for f, k in zip(flat, sizes)])

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state as {path: array}, one logical copy whatever the device count."""
        flat, _ = jax.tree_util.tree_flatten_with_path(self.backend.logical(self.state))
        out = {}
        for path, leaf in flat:
            key = _key(path)
            if is_key(leaf):  # saved as raw data; load_state_dict wraps it again
                leaf = jax.random.key_data(leaf)
            elif self._zero_sizes and key.startswith("opt_state") and np.ndim(leaf) == 1:
                leaf = leaf[: self._zero_sizes[0]]  # drop the padding to a multiple of N
            out[key] = leaf
        return out

    def state_template(self) -> dict[str, Any]:
        """Shapes and dtypes of `state_dict()`, placed replicated on this Trainer's
        devices: the restore target that re-shards a checkpoint onto any mesh."""
        sharding = NamedSharding(self.backend.mesh, P())
        return {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=sharding)
                for k, v in self.state_dict().items()}

    def load_state_dict(self, flat: dict[str, Any]) -> None:
        """Replace the state with one from `state_dict()` (of any device count)."""
        template = self.backend.logical(self.state)
        paths, treedef = jax.tree_util.tree_flatten_with_path(template)
        missing = [_key(p) for p, _ in paths if _key(p) not in flat]
        if missing:
            raise DpaxError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[0]}; "
                            "it was saved for another model or optimizer")
        def leaf(path, like):
            value = flat[_key(path)]
            if is_key(like):
                return jax.random.wrap_key_data(np.asarray(value), impl=jax.random.key_impl(like))
            if self._zero_sizes and _key(path).startswith("opt_state") and np.ndim(like) == 1:
                n, padded = self._zero_sizes
                return np.pad(np.asarray(value), (0, padded - n))
            return value

        leaves = [leaf(p, t) for p, t in paths]
        self.state = self.backend.put_state(jax.tree.unflatten(treedef, leaves),
                                            self._state_spec)

    # -- results ---------------------------------------------------------------------
    @property
    def params(self) -> nnx.State:
        """Host copy of the parameters (replica 0 of this process)."""
        return self.backend.host(self.state.params)

    def model(self) -> nnx.Module:
        """The trained model on the host, ready for single-device use."""
        host = self.backend.host(self.state)
        return nnx.merge(self._graphdef, host.params, host.rest)


def _leaf_specs(specs: Any, state: TrainState) -> list:
    """One PartitionSpec per leaf of `state` from a tree prefix of specs."""
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    full = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), specs, state,
                        is_leaf=is_spec)
    return jax.tree.leaves(full, is_leaf=is_spec)


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def resolve_steps(steps: int | None, epochs: int | None, steps_per_epoch: int) -> int:
    """Total steps from exactly one of `steps` / `epochs`."""
    if (steps is None) == (epochs is None):
        raise DpaxError("give exactly one of `steps` or `epochs`")
    if steps is not None:
        if steps < 1:
            raise DpaxError(f"`steps` must be >= 1, got {steps}")
        return steps
    if epochs < 1:
        raise DpaxError(f"`epochs` must be >= 1, got {epochs}")
    return epochs * steps_per_epoch


def summarize(sums: Iterable[dict] | dict) -> dict:
    """Means over steps from host metric sums: `x_sum / count`; `x_total` is
    summed over the steps; anything else is the last step's value."""
    sums = [sums] if isinstance(sums, dict) else list(sums)
    return _means(_totals({k: np.stack([np.asarray(s[k]) for s in sums]) for k in sums[-1]}))


def _summed(key: str) -> bool:
    """Counts, `_sum`s and `_total`s add up over steps; other metrics do not."""
    return key == "count" or key.endswith(("_sum", "_total"))


def _totals(columns: dict[str, np.ndarray]) -> dict:
    """Sums over the steps (axis 0) of counts, `_sum`s and `_total`s; the last
    step's value of anything else."""
    return {k: v.sum(0, dtype=np.float64) if _summed(k) else v[-1] for k, v in columns.items()}


def _means(totals: dict) -> dict:
    count = float(totals["count"])
    out = {"examples": int(count)}
    for k, total in totals.items():
        if k.endswith("_sum"):
            name = "loss" if k == "loss_sum" else k[: -len("_sum")]
            out[name] = _scalar(total / count) if count else float("nan")
        elif k.endswith("_total"):
            out[k[: -len("_total")]] = _scalar(total)
        elif k != "count":
            out[k] = _scalar(np.asarray(total))
    return out


def _bucket(b: int, unit: int, buckets: Sequence[int] | None) -> int:
    if buckets is None:
        size = unit
        while size < b:
            size *= 2
        return size
    for size in buckets:
        if size >= b:
            return size
    raise DpaxError(f"a batch of {b} examples is larger than the largest bucket {buckets[-1]}")


def _dtype(name: str):
    if name not in ("fp32", "bf16"):
        raise DpaxError(f"unknown precision {name!r}; choose fp32 or bf16")
    return jnp.bfloat16 if name == "bf16" else None


class TooManyBadSteps(RuntimeError):
    """Too many consecutive non-finite steps; the state holds the last good params."""


def _scalar(x: np.ndarray):
    return float(x) if x.ndim == 0 else x


def default_loss(task: str) -> tuple[LossFn, Callable]:
    """The built-in (loss_fn, predict_fn) for a dataset's task."""
    if task == "classification":
        return losses_mod.classification_loss, losses_mod.classification_predict
    return losses_mod.regression_loss, losses_mod.regression_predict
