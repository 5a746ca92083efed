"""`Trainer`: data-parallel training, evaluation and prediction of one NNX model.

The model, loss and optimizer are written for one device; the Trainer
replicates the state (or lays it out, `dpax.parallel.layout`), splits each global
batch over its devices, and runs one compiled, donated step per batch
(`dpax.training.loop`). The step folds its metrics into running sums on the device;
the host reads them only at log boundaries.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpax import config as cfg
from dpax.data import checks, resident
from dpax.data.augment import Augment
from dpax.data.batches import MASK, batch_rows, padded_size
from dpax.data.pipeline import (
    EVAL_BATCH,
    BatchPlan,
    bucketed,
    eval_batches,
    examples,
    train_input,
)
from dpax.errors import BadExamplesElsewhere, DpaxError, DpaxWarning, TooManyBadSteps
from dpax.models.layers import draws_own_random, has_per_device_state, synchronize
from dpax.parallel import compile_cache, distributed, platform, watchdog
from dpax.parallel import layout as layouts
from dpax.parallel.arrays import all_finite, is_key
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend, make_backend
from dpax.parallel.layout import check_sharding, make_layout
from dpax.parallel.mesh import MAX_SIMULATED_DEVICES, replica_count, select_devices
from dpax.training import blame, loop, metrics, optim
from dpax.training.compiled import CompiledSteps
from dpax.training.compute import cast_floats
from dpax.training.handback import ModelHandback
from dpax.training.state import SOWN, TrainState, field_spans, init_state
from dpax.training.step import StepOptions
from dpax.training.sums import LossFn
from dpax.training.update import check_optimizer

PRECISIONS = {"fp32": None, "bf16": jnp.bfloat16}  # name -> compute dtype (None: as stored)


@dataclasses.dataclass
class TrainerConfig:
    """How a `Trainer` trains: its devices, where the state lives, and what its
    step computes besides the mean gradient. The fields are `Trainer`'s
    keyword arguments of the same names."""

    devices: int | None = cfg.field(
        None, "devices per process (default: all local accelerators; on CPU, 8 simulated)",
        how=True)
    backend: str = cfg.field(DEFAULT_BACKEND, "shard_map (jit + shard_map) or pmap", how=True)
    # A name, or in Python a layout class (`dpax.parallel.layout.Layout`).
    sharding: str | type = cfg.field(
        "replicated", "where the state lives: replicated; optimizer (ZeRO-1: optimizer state "
        "1/N per device); full (FSDP: params, gradients and optimizer state 1/N per device); "
        "shard_map backend (with replicas R: N is a group's devices)", how=True)
    replicas: str | int = cfg.field(
        1, "hybrid sharding: the devices form this many groups (or 'processes': one per "
        "process, i.e. per host); a sharded state is split inside each group and "
        "replicated across the groups, whose gradients are summed after the scatter "
        "(a replicated state has no groups)", how=True, metavar="R")
    grad_accum: int = cfg.field(1, "micro-batches per device, accumulated in the step",
                                how=True)
    precision: str = cfg.field("fp32", "fp32, or bf16 compute on fp32 master params")
    allreduce_dtype: str = cfg.field("fp32", "dtype of the gradient all-reduce: fp32 or bf16")
    param_dtype: str = cfg.field(
        "fp32", "dtype the params are stored and updated in: fp32 (as the model made them), "
        "or bf16 (half their memory; no fp32 master copy: each update rounds to bf16, and "
        "one smaller than half a bf16 unit of its weight is lost)")
    opt_state_dtype: str = cfg.field(
        "fp32", "dtype the optimizer's state (Adam's moments) is kept in between steps: fp32, "
        "or bf16 (half its memory; each update computes in the params' dtype)")
    clip_norm: float | None = cfg.field(None, "clip the reduced gradient to this global norm")
    ema_decay: float | None = cfg.field(
        None, "keep an EMA of the params with this decay (e.g. 0.999); eval uses it")
    max_bad_steps: int | None = cfg.field(
        10, "stop (TooManyBadSteps) after this many non-finite steps in a row, checked at "
        "log steps",
        how=True)
    skip_nonfinite: bool = cfg.field(
        False, "skip a step whose loss or gradient is not finite, or whose batch weighs "
               "nothing (the state stays), and log grad_norm: a pass over the gradient and "
               "an update that waits for all of it (docs/speed.md). Off, every step is "
               "applied as a hand-written loop applies it: a NaN step is counted "
               "(`max_bad_steps`) and ruins the params",
        # A finite step is the same either way: a resume may turn it on to get
        # past the batch that stopped a run.
        how=True)
    sync_batchnorm: bool = cfg.field(
        True, "BatchNorm statistics over the global batch (`sync_batchnorm=False`: per "
              "device, not equivalent to one device)")
    steps_per_call: int = cfg.field(
        1, "training steps per compiled call (a scan over batches on the device)", how=True)
    xla_cpu_tuning: bool | None = cfg.field(
        None, "on CPU devices, opt into dpax's XLA:CPU tuning: faster steps there, whose "
        "timed choices may change the last bits of results (default off, or "
        f"{platform.ENV}=0/1); GPUs and TPUs never take it", how=True)
    compile_cache: str | None = cfg.field(
        compile_cache.DEFAULT, "where compiled programs are kept for later runs, resumes and "
        "restarts: 'default' (JAX's own setting, else a per-user, per-machine directory "
        "under ~/.cache/dpax/xla), a directory, or 'none' (docs/speed.md)", how=True,
        metavar="DIR")

    def check(self) -> None:
        for name in ("devices", "grad_accum", "max_bad_steps", "steps_per_call"):
            cfg.whole(self, name)
        if self.devices is not None and self.devices > MAX_SIMULATED_DEVICES:
            raise DpaxError(f"`devices={self.devices}` is over the cap of "
                            f"{MAX_SIMULATED_DEVICES}; use fewer devices")
        check_backend(self.backend, 1)
        check_sharding(self.sharding, self.backend)
        if isinstance(self.replicas, str) and self.replicas.isdigit():  # from a flag
            self.replicas = int(self.replicas)
        if self.replicas != "processes" and (isinstance(self.replicas, bool) or not isinstance(
                self.replicas, int) or self.replicas < 1):
            raise DpaxError("`replicas` must be a whole number >= 1 or 'processes', "
                            f"got {self.replicas!r}")
        cfg.one_of(self, "precision", PRECISIONS)
        cfg.one_of(self, "allreduce_dtype", PRECISIONS)
        cfg.one_of(self, "opt_state_dtype", PRECISIONS)
        cfg.one_of(self, "param_dtype", PRECISIONS)
        cfg.number(self, "clip_norm", 0, low_open=True)
        cfg.number(self, "ema_decay", 0, 1, low_open=True)
        if self.compile_cache == "":
            raise DpaxError("`compile_cache` is empty: give a directory, 'default' or 'none'")


class Trainer:
    """Data-parallel trainer for one Flax NNX model.

    Args:
      model: an `nnx.Module` written for one device (`dpax.from_linen` and
        `dpax.from_function` bring other models). dpax trains a copy whose
        BatchNorm and Dropout layers it makes N-independent; after each `fit`
        the model given here holds the trained params and state.
      loss_fn: `loss_fn(model, batch) -> per-example losses` or
        `(losses, {name: per-example metric})`, on one device's shard;
        `batch` has every key of the examples (`x`, `y` when given as arrays)
        and the boolean `mask` of real rows.
      optimizer: an Optax transformation (its schedule lives in its state).
      devices: a device count, a list of devices, or None for all local ones.
      backend: "shard_map" (default) or "pmap"; both give the same numbers.
      predict_fn: `predict_fn(model, batch) -> one output per example`.
      schedule: the learning-rate schedule, only to report the LR as a metric.
      seed: the key behind dropout masks (with the step and each example's
        global index, so masks do not depend on the device count).
      grad_accum: micro-batches per device shard, accumulated inside the step.
      precision: "fp32", or "bf16" for bf16 forward/backward on fp32 params.
      allreduce_dtype: "fp32" or "bf16" for the gradient all-reduce.
      param_dtype: "fp32" (the model's own dtypes), or "bf16" to store and
        update the model's floating-point params in bf16, with no fp32
        master copy: an update smaller than half a bf16 unit of its weight
        is lost, and N devices agree with one to bf16's rounding
        (docs/exactness.md). Their gradients are all-reduced in fp32 unless
        `allreduce_dtype` says bf16; the EMA stays in fp32. The model given
        here gets bf16 params after `fit`.
      opt_state_dtype: "fp32", or "bf16" to keep the optimizer's
        floating-point state (Adam's moments) in bf16 between steps
        (`dpax.training.optim.state_stored_in`): half its memory, each
        update computed in the params' dtype from the rounded state.
      max_bad_steps: stop with `TooManyBadSteps` after this many non-finite
        steps in a row (applied, or skipped with `skip_nonfinite`), checked at
        log boundaries; None: never.
      skip_nonfinite: skip a step whose loss or gradient is not finite, or
        whose batch weighs nothing, and log `grad_norm`; it costs a pass over
        the gradient and an update that waits for all of it. False (the
        default) applies every step, as a hand-written loop does, and
        computes no gradient norm (no `grad_norm` metric unless `clip_norm`):
        one NaN step leaves non-finite params (counted for `max_bad_steps` by
        the loss: a non-finite gradient shows in the next step's loss).
      steps_per_call: run this many steps in one compiled call (a scan over
        batches already on the device): fewer launches for small models.
      sync_batchnorm: convert `nnx.BatchNorm` layers to `SyncBatchNorm`, and
        compute Linen `nn.BatchNorm` layers (`dpax.from_linen`) the same way
        (global masked statistics). False keeps per-device statistics (the
        running averages are then averaged across devices): not equivalent.
        With True, any other layer that computes state from each device's
        rows (a BatchNorm subclass, a custom running mean or count) is
        refused before training on several devices (`PerDeviceState`); False
        averages such float state too (a count is refused either way).
      replicas: hybrid sharding: the devices form this many groups of
        consecutive devices, or "processes" for one group per process (per
        host). A sharded layout splits the state over the devices of a group
        and replicates it across the groups; each gradient is
        reduce-scattered inside its group, then its slice summed across the
        groups. It must divide the device count; a replicated state ignores
        it. A resume may change it.
      sharding: where the state lives (`dpax.parallel.layout`): "replicated" (every
        device holds all of it), "optimizer" (ZeRO-1: the optimizer state 1/N
        per device) or "full" (FSDP: params, gradients and optimizer state 1/N
        per device, params all-gathered where the model uses it), or a layout
        class (`dpax.parallel.layout.Layout`; `LAYOUTS` maps each name to its
        class), which the Trainer makes for its state and devices. Any N, and
        any optax transformation: the sharded modes run the optimizer on the
        logical params and gradients under jit (shard_map backend).
        Checkpoints resume in any mode.
      clip_norm: clip the mean gradient to this global norm (the same as
        `optax.clip_by_global_norm` first in the chain).
      ema_decay: keep an exponential moving average of the params with this
        decay (in (0, 1); it ramps up from 0.1 over the first steps), laid out
        like the params, in checkpoints, and used by `evaluate` and `predict`.
      compile_cache: JAX's persistent compilation cache for this process
        (`dpax.parallel.compile_cache`): "default" (what JAX was set to,
        else a directory per user and machine under ~/.cache/dpax/xla), a
        directory, or None / "none" for none. A program read back is the
        executable an earlier run compiled: a warm run repeats its numbers.
      xla_cpu_tuning: on CPU devices, opt into dpax's XLA:CPU tuning
        (`dpax.parallel.platform`): steps built from choices timed on this
        machine, which can round a dot's or a sum's last bits differently
        from the generic path (kept per machine). None: off, unless the
        environment sets `DPAX_XLA_CPU_TUNING=1`. GPU and TPU devices never
        take it.

    Raises:
      DpaxError: an option the Trainer does not take, a value out of its
        range (the message names it), more devices than JAX has, or an
        optimizer the step cannot call (one whose update wants a loss
        function, as a line search does).
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        devices: int | Sequence[jax.Device] | None = None,
        predict_fn: Callable | None = None,
        schedule: optax.Schedule | None = None,
        seed: int = 0,
        **options: Any,
    ):
        _check_arguments(model, loss_fn, optimizer, predict_fn)
        listed = isinstance(devices, (list, tuple))
        _check_devices(devices, listed)
        if "sharding" in options:  # before the type check, whose message lists no names
            layouts.layout_class(options["sharding"])
        try:
            config = TrainerConfig(devices=None if listed else devices, **options)
        except TypeError:
            known = [f.name for f in dataclasses.fields(TrainerConfig)]
            unknown = sorted(set(options) - set(known))
            raise DpaxError(f"Trainer takes no argument {', '.join(unknown)}; its options "
                            f"are {', '.join(known)}") from None
        cfg.validate(config)
        self.config = config
        devs = list(devices) if listed else select_devices(devices)
        self.compile_cache = compile_cache.use(config.compile_cache, devs[0])
        self.platform = platform.for_devices(devs, config.xla_cpu_tuning)
        self.backend = make_backend(config.backend, devs, self.platform,
                                    _groups(config, len(devs)))
        self.n_devices = self.backend.n
        self.grad_accum = config.grad_accum
        self.max_bad_steps = config.max_bad_steps
        self.steps_per_call = config.steps_per_call
        self._user_model = model
        self._handback = ModelHandback(model)
        # dpax's own copy, its BatchNorm and Dropout layers made N-independent:
        # the user's model keeps its classes (and gets the trained state after `fit`).
        model = nnx.clone(model)
        nnx.pop(model, SOWN)  # what an earlier call sowed: `dpax.training.state.SOWN`
        synchronize(model, batchnorm=config.sync_batchnorm)
        if PRECISIONS[config.param_dtype] is not None:
            _store_params_in(model, PRECISIONS[config.param_dtype])
        self.param_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        allreduce = PRECISIONS[config.allreduce_dtype]
        if allreduce is None and PRECISIONS[config.param_dtype] is not None:
            allreduce = jnp.float32  # bf16 params' gradients are summed in fp32 unless asked
        step_options = StepOptions(
            grad_accum=config.grad_accum, compute_dtype=PRECISIONS[config.precision],
            allreduce_dtype=allreduce,
            average_state=has_per_device_state(model), own_random=draws_own_random(model),
            sync_batchnorm=config.sync_batchnorm,
            clip_norm=config.clip_norm, ema_decay=config.ema_decay,
            skip_nonfinite=config.skip_nonfinite,
            backward=self.platform.backward, pack=self.platform.pack_collectives)
        ema = config.ema_decay is not None
        if PRECISIONS[config.opt_state_dtype] is not None:
            optimizer = optim.state_stored_in(optimizer, PRECISIONS[config.opt_state_dtype])
        owned = _buffers(jax.live_arrays())
        self._graphdef, state = init_state(model, optimizer, seed, ema=ema)
        state = _unshared(state, owned)
        optimizer = check_optimizer(optimizer, state)
        # The model's shapes alone: the checks read its number of outputs from them.
        self._model_specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                         (state.params, state.model_state))
        self._output_specs: dict = {}  # (example shape, dtype) -> the model's output
        self._warned_idle: set = set()  # the batches `_warn_idle` warned of: once each
        self._rule = checks.rule_of(loss_fn)
        self._predict_rule = checks.rule_of(predict_fn) if predict_fn is not None else None
        self.layout = make_layout(config.sharding, self.backend, state, config.grad_accum)
        self._specs = layouts.specs(self.layout)
        self.state = self.backend.put_state(layouts.stored(self.layout, state), self._specs)
        self._steps = CompiledSteps(self.backend, self._graphdef, state, self.layout, loss_fn,
                                    optimizer, schedule, step_options, predict_fn)
        self.traces = self._steps.traces  # compilations per step kind

    # The state lives as a flat list of arrays (`dpax.training.compiled`).
    @property
    def state(self) -> TrainState:
        """The training state, laid out on the devices by `layout`."""
        return jax.tree.unflatten(self._state_def, self._leaves)

    @state.setter
    def state(self, state: TrainState) -> None:
        self._leaves, self._state_def = jax.tree.flatten(state)
        self._fields = field_spans(state, self._leaves)

    def _field(self, name: str) -> Any:
        """One field of the state, rebuilt from its own leaves: unflattening the
        whole state makes an NNX Variable per leaf of the optimizer state too,
        Python work a caller that wants only the params should not pay."""
        start, stop, treedef = self._fields[name]
        return treedef.unflatten(self._leaves[start:stop])

    @property
    def step(self) -> int:
        """Steps trained so far (a device-to-host sync: not for the hot loop)."""
        return int(self.backend.host(self._field("step")))

    def padded(self, batch_size: int) -> int:
        """Rows a global batch is padded to: a multiple of devices x micro-batches."""
        return padded_size(batch_size, self.n_devices * self.grad_accum)

    # -- training ----------------------------------------------------------------------
    def train_step(self, host_batch: dict, size: int | None = None) -> dict:
        """One step on this process's rows of a padded, masked global batch.

        Args:
          host_batch: this process's rows of the batch, padded, with `mask`.
          size: the global batch's padded rows (default: all of them).

        Returns:
          The step's metrics row (a device-to-host sync).
        """
        self._check_step_batch(host_batch, size)
        sums = self._run(1, self._input(host_batch, size), self._zero_sums(size, host_batch))
        return self._read([sums])

    def _check_step_batch(self, host_batch: dict, size: int | None) -> None:
        """A batch given to `train_step` or `lower_train_step` is masked and
        splits evenly over the devices and micro-batches (else JAX's own error
        came from inside the step)."""
        rows = batch_rows(host_batch)
        total = size if size is not None else rows * jax.process_count()
        if MASK not in host_batch or total % (self.n_devices * self.grad_accum):
            raise DpaxError(
                f"`host_batch` must carry a `mask` and be padded to a multiple of "
                f"{self.n_devices} device(s) x {self.grad_accum} micro-batch(es), got {total} "
                f"rows: dpax.data.batches.pad_batch(batch, trainer.padded({total})) makes "
                f"{self.padded(total)} such rows")
        lo, hi = self.backend.local_rows(total)
        if rows != hi - lo:
            raise DpaxError(f"`host_batch` has {rows} rows; this process holds {hi - lo} of "
                            f"a global batch of {total} (`size`)")

    def lower_train_step(self, host_batch: dict, size: int | None = None) -> jax.stages.Lowered:
        """The training step lowered for this batch layout, without running it.

        Args:
          host_batch: a batch as `train_step` takes it (only its shapes and
            dtypes matter).
          size: the global batch's padded rows (default: all of them).

        Returns:
          A `jax.stages.Lowered`: its `.as_text()` is the StableHLO dpax
          emits, `.compile()` gives XLA's HLO and memory use.
        """
        self._check_step_batch(host_batch, size)
        placed = self._input(host_batch, size)
        return self._steps.train.lower(self._leaves, self._zero_sums(size, host_batch), placed)

    def fit(
        self,
        data: Any,
        y: Any = None,
        *,
        batch_size: int,
        until_step: int | None = None,
        epochs: int | None = None,
        seed: int = 0,
        log_every: int = 10,
        hooks: Iterable[loop.Hook] = (),
        batches: Iterator[dict] | None = None,
        augment: Augment | None = None,
        data_workers: int = 0,
        data_on_device: bool | None = None,
    ) -> list[dict]:
        """Train with global batches of `batch_size` until the step counter
        reaches `until_step` (or `epochs` passes); returns the log rows. The
        model given to the Trainer then holds the trained params and state.

        Batches come from `BatchPlan`: their order depends on `seed` and the step
        only, so any device count sees the same global batches.

        Args:
          data: the examples: a dict of arrays that share a leading example axis
            (the loss sees every key, plus `mask`), or an array of inputs `x`
            with `y` its targets. Arrays may be `dpax.data.sources` columns on disk.
          y: the targets, when `data` is an array of inputs.
          batch_size: the global batch, over all devices and processes; any
            size (a batch is padded and masked to fit the devices).
          until_step: train until the step counter reaches it (a resumed
            Trainer continues from its step).
          epochs: or train this many passes over the examples.
          seed: the key of the batches' order (not of the model).
          log_every: steps between log rows (the metrics' device-to-host sync).
          hooks: host-side work at log steps and after each step (`dpax.training.loop.Hook`:
            checkpoints, evaluation, preemption checks; `loop.OnLog(fn)` for a callback).
          batches: this process's host batches from the current step on (from
            `pipeline.train_input`, e.g. restored from a checkpoint); default: made here.
          augment: random image augmentation of `x` (`dpax.data.augment.parse("crop,flip")`),
            the same for any device count; only with batches made here.
          data_workers: Grain worker processes that make the batches (0: this thread).
          data_on_device: copy the examples to every device once and gather
            each batch there, the host sending only its example indices
            (`dpax.data.resident`; the same batches). None: where they take at
            most 1/8 of an accelerator's free memory, not on CPU devices;
            always with `batches` from `train_input(..., indices=True)`.

        Returns:
          The log rows, one dict of metrics per log step.

        Raises:
          DpaxError: arguments or examples no step can train on (`BadArgument`,
            `BadExamples`; `FailsOnExamples` where the loss or the model
            raises on them), or a model that would not train on N devices as
            on one (`PerDeviceState`, `PerDeviceRandom`, `MixesExamples`,
            `ReadsBatchSize`), all before the first step.
          TooManyBadSteps: `max_bad_steps` non-finite steps in a row.
          Preempted: a preemption hook saved and stopped the run.
          RunFailed: a checkpoint hook could not save or read a step.
        """
        data, given = self._checked(data, y, batch_size)
        plan = BatchPlan(batch_rows(data), batch_size, seed)
        total = plan.total_steps(until_step, epochs, steps_name="until_step")
        start = self.step
        if total <= start:
            reach = (f"`until_step={until_step}`" if until_step is not None else
                     f"`epochs={epochs}` (step {total}; epochs count from step 0)")
            warnings.warn(f"this Trainer is at step {start}, which {reach} has reached: nothing "
                          f"to train; pass a larger `until_step`", DpaxWarning, stacklevel=2)
        size = self.padded(batch_size)
        self._warn_idle(batch_size, batch_rows(data), size)
        made_here = batches is None
        indices_given = getattr(batches, "holds_indices", False)  # e.g. the CLI's
        if indices_given and data_on_device is False:
            raise DpaxError("`batches` hold example indices (`train_input(..., indices=True)`), "
                            "which need the examples on the devices; leave out "
                            "`data_on_device=False`")
        on_device = resident.choose(True if indices_given else data_on_device, data,
                                    self.backend.devices, self.platform.name,
                                    jax.process_count(),
                                    batches_given=not made_here and not indices_given,
                                    augment=augment is not None, workers=data_workers)
        placed = None
        if on_device:  # batches of example indices, gathered on the devices
            placed = self.backend.put_state(data)
            if made_here:
                batches = train_input(data, plan, self.backend.local_rows(size), start, total,
                                      indices=True)
        elif made_here:
            if augment is not None:
                if "x" not in data:
                    raise DpaxError("`augment` changes the images under the key 'x'; the "
                                    f"examples have {', '.join(map(str, data))}")
                augment.check(data["x"].shape[1:])
            batches = train_input(data, plan, self.backend.local_rows(size), start, total,
                                  augment, data_workers)
        if on_device:  # batches of example indices: the examples were checked above
            feed = batches
        elif made_here:
            feed = self._rest_checked(batches, given)
        else:  # `data`'s batches made elsewhere (`train_input`, the CLI's): the first
            feed = self._first_checked(batches, given)
        sized = ((size, b) for b in itertools.islice(feed, max(total - start, 0)))
        try:
            return self._train(sized, start, total, log_every, hooks, plan.steps_per_epoch,
                               self._resident(data, placed) if on_device else None)
        finally:
            if made_here:
                batches.close()  # stops Grain worker processes, if any

    def fit_stream(
        self,
        batches: Iterable[dict],
        *,
        buckets: Sequence[int] | None = None,
        log_every: int = 10,
        hooks: Iterable[loop.Hook] = (),
    ) -> list[dict]:
        """Train on host batches of ANY size, one step each.

        Each batch (a dict of arrays of b >= 1 rows, as `fit` takes) is padded
        to the smallest bucket that holds it and masked, so the step compiles
        at most once per bucket, however many sizes arrive. Default buckets:
        N*K times powers of two (N devices, K micro-batches).

        Args:
          batches: host batches, each a dict of arrays as `fit` takes them.
          buckets: the padded sizes to compile for; default as above.
          log_every: steps between log rows.
          hooks: as `fit` takes them.

        Returns:
          The log rows.

        Raises:
          DpaxError, TooManyBadSteps, Preempted, RunFailed: as `fit`.
        """
        def check_first(batch):
            batch = examples(batch, argument="batches")
            checks.check(self._examples(batch, argument="batches", first_batch=True),
                         self._rule)

        sized = bucketed(checks.first_checked(batches, check_first),
                         self.n_devices * self.grad_accum, buckets, self.backend.local_rows)
        return self._train(sized, self.step, None, log_every, hooks)

    def check(self, data: Any, y: Any = None, batch_size: int = EVAL_BATCH) -> None:
        """The checks `fit` and `evaluate` make before their first step, alone:
        raises the `DpaxError` they would (`dpax.data.checks`). Arrays read
        per batch (columns on disk) are checked on their first `batch_size`
        examples, the same ones in every process; e.g. before a run writes
        its files."""
        data, given = self._checked(data, y, batch_size)
        if not given.read_whole:
            first = min(batch_size, batch_rows(data))
            next(self._first_checked(eval_batches(data, batch_size, (0, first)), given))

    def _train(self, sized, start, total, log_every, hooks, steps_per_epoch=None,
               steps: loop.Steps | None = None) -> list[dict]:
        try:
            return loop.run(steps or self._loop_steps(), sized, start=start, total=total,
                              log_every=log_every, hooks=hooks, steps_per_epoch=steps_per_epoch)
        finally:
            self._update_model()

    def _update_model(self) -> None:
        """Leave the trained params and state in the model the user gave (NNX's
        in-place convention), each array where the user's was (`handback`).

        Copied from device to device, never through the host: a host copy
        waits for every step in flight and then for each leaf, a sync per
        leaf at the end of every `fit` call."""
        failing = sys.exc_info()[0] is not None
        try:
            params = self.backend.local(self._logical(self._field("params")))
            rest = self.backend.local(self._field("model_state"))
        except Exception:  # a step failed mid-call: its donated state is gone
            if failing:
                return  # the step's own error is the one to see
            raise
        self._handback.write(nnx.merge_state(params, rest))

    def _in_flight(self) -> int | None:
        """Calls that may queue before the host waits (`dpax.parallel.platform`)."""
        return self.platform.max_in_flight

    def _loop_steps(self) -> loop.Steps:
        return loop.Steps(
            run=self._run, zero_sums=self._zero_sums, read=self._read,
            place=lambda sized: loop.device_calls(sized, self._input, self.backend.put_batches,
                                                  self.steps_per_call),
            in_flight=self._in_flight())

    def _resident(self, data: dict, placed: Any) -> loop.Steps:
        """The loop's steps on batches of example indices (`dpax.data.resident`):
        each call gathers its batch from `placed`, `data` on the devices."""
        train, multi = self._steps.train_rows, self._steps.train_multi_rows

        def run(n_steps, rows, sums):
            self._leaves, sums = (train if n_steps == 1 else multi)(self._leaves, sums,
                                                                     (placed, rows))
            return sums

        def zero_sums(size, rows):  # the metrics' shapes: from a batch of zeros
            local = len(rows[MASK])
            return self._zero_sums(size, {**jax.tree.map(
                lambda a: np.zeros((local,) + a.shape[1:], a.dtype), data), MASK: rows[MASK]})

        return dataclasses.replace(self._loop_steps(), run=run, zero_sums=zero_sums)

    def _input(self, host_batch: dict, size: int | None) -> dict:
        return self.backend.step_input(host_batch, size)

    def _run(self, n_steps: int, batch: dict, sums: dict) -> dict:
        train = self._steps.train if n_steps == 1 else self._steps.train_multi
        self._leaves, sums = train(self._leaves, sums, batch)
        return sums

    def _zero_sums(self, size: int | None, host_batch: dict) -> dict:
        # The step's first trace: the user's code meets the examples here.
        with blame.on_examples(host_batch):
            return self._steps.zero_sums(self._leaves, self._input(host_batch, size))

    # -- checks of the examples, before the first step (`dpax.data.checks`) -------------
    def _checked(self, data: Any, y: Any, batch_size: Any,
                 rule: bool = True) -> tuple[dict, checks.Examples]:
        """The examples of `data` (and `y`) as `examples` makes them, and how
        they were given, after the checks of `batch_size` and of every array
        read here (in memory); `rule`: the loss's rule too (False: the
        `predict_fn`'s, to predict)."""
        checks.batch_size(batch_size)
        positional = not isinstance(data, Mapping)
        data = examples(data, y)
        given = self._examples(data, positional=positional)
        checks.check(given, self._rule if rule else self._predict_rule)
        return data, given

    def _examples(self, data: dict, argument: str = "data", positional: bool = False,
                  first_batch: bool = False) -> checks.Examples:
        return checks.Examples(data, argument, positional, first_batch=first_batch,
                               outputs=self._model_output)

    def _rest_checked(self, batches: Iterable[dict], given: checks.Examples,
                      rule: bool = True) -> Iterable[dict]:
        """`batches` made of `given`, the first checked if `given` holds
        arrays not read yet (read per batch: `checks.in_memory`)."""
        return batches if given.read_whole else self._first_checked(batches, given, rule)

    def _first_checked(self, batches: Iterable[dict], named: checks.Examples,
                       rule: bool = True) -> Iterator[dict]:
        """`batches` (this process's padded host batches) with the real rows
        of the first one checked whole, its arrays named as `named` names
        them; `rule`: the loss's too (False: the `predict_fn`'s). Each
        process checks its own rows, and all of them refuse when one does
        (`distributed.refuse_together`)."""
        def check_first(batch):
            mask = np.asarray(batch[MASK])
            arrays = {k: v for k, v in batch.items() if k != MASK}
            if not mask.all():  # padding copies an example, checked where it is real
                arrays = jax.tree.map(lambda a: a[mask], arrays)
            first = dataclasses.replace(named, arrays=arrays, first_batch=True)
            distributed.refuse_together(
                lambda: checks.check(first, self._rule if rule else self._predict_rule),
                lambda process: _found_elsewhere(first, process))

        return checks.first_checked(batches, check_first)

    def _model_output(self, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
        """The model's output for a batch of one example of `shape` and
        `dtype`, in eval mode, from shapes alone: traced once per input shape."""
        key = (tuple(shape), np.dtype(dtype))
        if key not in self._output_specs:
            graphdef = self._graphdef

            def call(params, rest, x):
                model = nnx.merge(graphdef, params, rest)
                model.eval()
                return model(x)

            example = jax.ShapeDtypeStruct((1, *shape), dtype)
            self._output_specs[key] = jax.eval_shape(call, *self._model_specs, example)
        return self._output_specs[key]

    def _warn_idle(self, batch_size: int, n_examples: int, size: int) -> None:
        """Padding fills the devices after the real rows: warn when some
        devices hold no real row at all (their compute is wasted), once per
        Trainer and batch (`dpax check` fits one step at a time)."""
        real = min(batch_size, n_examples)
        idle = self.n_devices - -(-real // (size // self.n_devices))
        if idle <= 0 or (real, n_examples < batch_size) in self._warned_idle:
            return
        self._warned_idle.add((real, n_examples < batch_size))
        fix = (f"the data holds only {n_examples} examples" if n_examples < batch_size
               else f"use a `batch_size` that is a multiple of {self.n_devices}")
        warnings.warn(f"batches of {real} examples on {self.n_devices} devices: {idle} of "
                      f"them {'sees' if idle == 1 else 'see'} only padding every step; {fix}",
                      DpaxWarning, stacklevel=3)

    def _read(self, pending: list) -> dict:
        host = self.backend.host(pending)  # sync point (timed): once per log
        row = metrics.summarize([self._steps.packing.unpack(h) for h in host])
        bad = int(row.pop("bad_in_a_row", 0))
        if self.max_bad_steps is not None and bad >= self.max_bad_steps:
            raise self._too_many_bad_steps(bad, row)
        return row

    def _too_many_bad_steps(self, bad: int, row: dict) -> TooManyBadSteps:
        """The error of `bad` bad steps in a row, saying what was not finite:
        from the row (the loss since the last log, the last step's gradient
        norm where the step computes one) and the params, reduced on the
        devices as stored (a split leaf's padding is zeros): one scalar comes
        back, where a host copy would gather a split state onto each host."""
        skipped = self.config.skip_nonfinite
        norm = row.get("grad_norm")
        gradient = None if norm is None else bool(np.isfinite(norm))
        # A skipped step's loss is not in the row; a finite norm (its sum of
        # squares over a weight > 0) leaves the loss as what was not finite.
        loss = (False if gradient else None) if skipped else bool(np.isfinite(row["loss"]))
        params = all_finite(self._field("params"))
        if loss is False:
            found = "the loss was not finite"
        elif gradient is False:
            found = "the gradient was not finite, or the batch weighed nothing"
        else:  # a finite loss (and gradient): the step's batch weighed nothing
            found = "the batch weighed nothing (0/0)"
        if skipped:
            happened = "were skipped"
        else:
            happened = "were applied (skip_nonfinite=False)"
        state = ("the params are the last good ones" if skipped and params
                 else f"the params are {'' if params else 'not '}finite")
        fixes = ("lower the learning rate, clip gradients (`clip_norm`) or check the data for "
                 "NaNs and for batches with nothing to learn from")
        if not params:
            fixes = ("resume from the last checkpoint with `skip_nonfinite=True`, which skips "
                     f"such steps, or {fixes}")
        elif not skipped and loss is False:
            fixes = ("check the data for NaNs and for values the loss cannot take (labels the "
                     "model has no output for), or skip such steps with `skip_nonfinite=True`")
        return TooManyBadSteps(
            f"{bad} bad steps in a row (limit {self.max_bad_steps}) {happened}: {found}; "
            f"{state}. To go on, {fixes}", steps=bad, limit=self.max_bad_steps,
            skipped=skipped, loss_finite=loss, gradient_finite=gradient, params_finite=params)

    # -- evaluation and prediction --------------------------------------------------
    def evaluate(self, data: Any, y: Any = None, batch_size: int = EVAL_BATCH) -> dict:
        """Mean loss and metrics over every example, each counted once.

        Args:
          data, y: the examples, as `fit` takes them.
          batch_size: the global batch of each evaluation step.

        Returns:
          {name: mean} of the loss and the loss function's metrics.

        Raises:
          DpaxError: examples the loss cannot read (`BadExamples`), or that
            the loss or the model raises on (`FailsOnExamples`).
        """
        data, given = self._checked(data, y, batch_size)
        size = self.padded(batch_size)
        rows = self.backend.local_rows(size)
        sums, queue, compiled = [], loop.InFlight(self._in_flight()), set()
        for b in self._rest_checked(eval_batches(data, batch_size, rows), given):
            with watchdog.calling(compiled, self._steps.eval), blame.on_examples(b):
                sums.append(self._steps.eval(self._leaves, self._input(b, size)))
            queue.add(sums[-1])
        return metrics.summarize(self.backend.host(sums))  # sync point (timed)

    def predict(self, data: Any, batch_size: int = EVAL_BATCH) -> Any:
        """One prediction per example of `data`, in order.

        Args:
          data: an array of inputs `x`, or a dict as `fit` takes it.
          batch_size: the global batch of each prediction step.

        Returns:
          Whatever structure `predict_fn` returns, each array with a leading
          example axis of `data`'s length (padding cut off), on the host.

        Raises:
          DpaxError: the Trainer has no `predict_fn`, or `data` holds no
            examples a step can read (`FailsOnExamples`: `predict_fn` or the
            model raises on them).
        """
        if self._steps.predict is None:
            raise DpaxError("this Trainer was built without `predict_fn`; pass one to Trainer, "
                            "e.g. `predict_fn=dpax.classification_predict`")
        # No loss runs: `predict_fn` reads what it reads (dpax's declare it).
        data, given = self._checked(data, None, batch_size, rule=False)
        size = self.padded(batch_size)
        rows = self.backend.local_rows(size)
        outs, queue, compiled = [], loop.InFlight(self._in_flight()), set()
        for b in self._rest_checked(eval_batches(data, batch_size, rows), given, rule=False):
            with (watchdog.calling(compiled, self._steps.predict),
                  blame.on_examples(b, "`predict_fn` or the model", added="mask")):
                outs.append(self._steps.predict(self._leaves, self._input(b, size)))
            queue.add(outs[-1])
        with watchdog.waiting():
            flat = [self.backend.host_examples(o) for o in outs]  # sync point
        # Batch i holds examples i*batch_size.. in order, then padding: cut it off.
        n = batch_rows(data)
        sizes = [min(batch_size, n - lo) for lo in range(0, n, batch_size)]
        return jax.tree.map(lambda *parts: np.concatenate([p[:k] for p, k in zip(parts, sizes)]),
                            *flat)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state as {path: array}, one logical copy whatever the device count.

        Returns:
          {path: array} of every field of the `TrainState` (params, model
          and optimizer state, step, ...), which `load_state_dict` of a
          Trainer on any device count and layout takes.
        """
        return layouts.state_dict(self.layout, self.backend.logical(self.state),
                                  self.backend.mesh)

    def state_template(self) -> dict[str, Any]:
        """The restore target of `state_dict()`, from shapes alone: unfilled host
        arrays, and for each leaf the layout splits evenly a
        `jax.ShapeDtypeStruct` with its sharding, which Orbax reads onto the
        devices, each process its own shards (`layout.template`). So a state
        split because it does not fit one device, or one host, never is whole
        on one."""
        return layouts.template(self.layout, self.state)

    def load_state_dict(self, flat: dict[str, Any]) -> None:
        """Replace the state with one from `state_dict()` (of any device count).
        The current state is dropped before the new one is placed: if placing
        fails (out of memory), this Trainer holds none.

        Args:
          flat: {path: array}, as `state_dict()` gives it.
        """
        self._load(flat, self._skeleton(), adopt=False)

    def restore(self, checkpointer, data=None, step: int | None = None,
                check: Callable[[dict], None] | None = None) -> tuple[int, dict]:
        """Replace the state with a checkpoint's (`Checkpointer.restore`: `step`,
        else the newest intact one; `data`: a `train_input` to restore too;
        `check`: called with its meta first). Returns (step, meta).

        The current state is freed once the checkpoint is accepted (`check`,
        the shapes), before it is read: its evenly split leaves are read
        straight onto the devices, and a resume never holds two states there.
        A refused checkpoint leaves this Trainer as it was; if an accepted one
        cannot be read (a `RunFailed`), it holds no state.

        Args:
          checkpointer: a `dpax.training.checkpoint.Checkpointer`.
          data: a `train_input` whose position is restored too, or None.
          step: the step to restore; None: the newest intact one.
          check: called with the checkpoint's meta before anything is read;
            it refuses the checkpoint by raising.

        Returns:
          (step, meta): the step restored and its meta.

        Raises:
          DpaxError: no such checkpoint, none intact, or one whose shapes do
            not fit this Trainer's state.
          RunFailed: an accepted checkpoint could not be read.
        """
        template, skeleton = self.state_template(), self._skeleton()
        step, flat, meta = checkpointer.restore(template, data, step, check=check,
                                                before_read=self._drop_state)
        self._load(flat, skeleton, adopt=True)
        return step, meta

    def _skeleton(self) -> TrainState:
        """The stored state's tree of shapes, dtypes and shardings (a PRNG key
        kept itself: its implementation is part of its dtype)."""
        return jax.tree.unflatten(self._state_def, [
            x if is_key(x) else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            for x in self._leaves])

    def _load(self, flat: dict[str, Any], skeleton: TrainState, adopt: bool) -> None:
        state = layouts.from_state_dict(self.layout, flat, skeleton, adopt)
        # The split leaves are placed now, the others on the host: the current
        # device arrays go before the placed ones come, or a resume held the
        # state three times on the devices (this one, the restored `flat`, the
        # placed one).
        self._drop_state()
        self.state = self.backend.put_state(state, self._specs)

    def _drop_state(self) -> None:
        """Free the state's device arrays (once: a restore frees it before reading)."""
        self.__dict__.pop("_leaves", None)

    # -- results ---------------------------------------------------------------------
    @property
    def params(self) -> nnx.State:
        """Host copy of the parameters in their model shapes (whatever the layout)."""
        return self.backend.host(self._logical(self._field("params")))

    @property
    def ema_params(self) -> nnx.State | None:
        """Host copy of the EMA of the params (None without `ema_decay`)."""
        if self.state.ema is None:
            return None
        return self.backend.host(self._logical(self.state.ema))

    def _logical(self, params):
        """The params (or EMA) as stored, in their model shapes (`layout.host_params`)."""
        return layouts.host_params(self.layout, params, self.backend.mesh)

    def model(self, ema: bool | None = None) -> nnx.Module:
        """The trained model, ready for single-device use: its arrays on the
        default device.

        Args:
          ema: with the EMA params; None: when the Trainer keeps an EMA, as
            `evaluate` does.

        Returns:
          A new `nnx.Module` (the model given to the Trainer is not it).

        Raises:
          DpaxError: `ema=True` and the Trainer keeps no EMA.
        """
        use_ema = self.state.ema is not None if ema is None else ema
        if use_ema and self.state.ema is None:
            raise DpaxError("this Trainer keeps no EMA; give it `ema_decay` to have one")
        params = self.ema_params if use_ema else self.params
        # JAX arrays on the default device, not the host's read-only copies:
        # a layer that updates its state in place (BatchNorm in train mode) writes them.
        state = jax.device_put((params, self.backend.host(self.state.model_state)))
        return nnx.merge(self._graphdef, *state)


def _found_elsewhere(first: checks.Examples, process: int) -> BadExamplesElsewhere:
    """The error of a process whose rows of a first batch were good, where
    `process` found bad ones in its rows."""
    return BadExamplesElsewhere(
        f"process {process} found bad examples in its rows of {first.name()} (each process "
        "checks its own); its error names them and the fix", first.argument_of(None), process)


def _buffers(arrays) -> set:
    """The device buffers `arrays` hold (typed PRNG keys left out)."""
    return {shard.data.unsafe_buffer_pointer() for x in arrays if not is_key(x)
            for shard in x.addressable_shards}


def _unshared(state: TrainState, owned: set) -> TrainState:
    """`state` with host copies of the leaves whose buffers are not its own:
    one in `owned` (the buffers alive before the state was made: the user's
    model's params and state, an array optax's init keeps, such as a learning
    rate given as an array), one another leaf holds too, and typed PRNG keys
    (an nnx.Rngs' state). The step donates the state: a shared buffer would
    be donated twice, or taken from its owner. The rest, made fresh on the
    host by `init_state` (Adam's moments), is placed as it is: copying it
    would cost the time and host memory of twice the params. (A process
    without a CPU device makes it on an accelerator: copied to the host, so
    that it does not stay there whole while a layout splits it.)"""
    seen = set(owned)

    def own(x):
        if is_key(x):
            return jax.random.wrap_key_data(np.array(jax.random.key_data(x)),
                                            impl=jax.random.key_impl(x))
        if (not isinstance(x, jax.Array) or len(x.addressable_shards) != 1
                or x.addressable_shards[0].device.platform != "cpu"):
            return np.array(x)
        buffer = x.unsafe_buffer_pointer()
        if buffer in seen:
            return np.array(x)
        seen.add(buffer)
        return x

    return jax.tree.map(own, state)


def _store_params_in(model: nnx.Module, dtype) -> None:
    """Cast `model`'s floating-point params to `dtype`, in place."""
    nnx.update(model, cast_floats(nnx.state(model, nnx.Param), dtype))


def _check_arguments(model: Any, loss_fn: Any, optimizer: Any, predict_fn: Any) -> None:
    """What the model, the loss and the optimizer must be, named where they
    are not (the errors came from deep inside Flax, optax or the first step)."""
    if not isinstance(model, nnx.Module):
        raise DpaxError(f"`model` must be a Flax NNX module, got {type(model).__name__}: "
                        "wrap a Linen module with dpax.from_linen, a function of a params "
                        "tree with dpax.from_function")
    for name, fn in (("loss_fn", loss_fn), ("predict_fn", predict_fn)):
        if fn is not None and not callable(fn):
            raise DpaxError(f"`{name}` must be a function (model, batch) -> per-example "
                            f"values, got {_kind(fn)}")
        if fn is not None and not _takes_model_and_batch(fn):
            raise DpaxError(f"`{name}` must take (model, batch), but "
                            f"{getattr(fn, '__name__', _kind(fn))}{inspect.signature(fn)} "
                            "cannot be called with two arguments")
    if not (callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))):
        wraps = (": pass the optax transformation it wraps, its `.tx`"
                 if isinstance(optimizer, nnx.Optimizer) else "")
        raise DpaxError(f"`optimizer` must be an optax GradientTransformation (e.g. "
                        f"optax.adam(1e-3)), got {_kind(optimizer)}{wraps}")


def _takes_model_and_batch(fn: Callable) -> bool:
    """Can `fn(model, batch)` be called? True where Python cannot say (a
    builtin or an extension without a signature)."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _kind(value: Any) -> str:
    """A value named in one line: its type, and itself where that is a short string."""
    short = isinstance(value, str) and len(value) <= 40 and "\n" not in value
    return f"{type(value).__name__} {value!r}" if short else type(value).__name__


def _check_devices(devices: Any, listed: bool) -> None:
    """`devices` is a count (checked with the other options), None, or a
    list of distinct JAX devices."""
    fix = "give a device count, a list of distinct devices (e.g. jax.devices()[:2]) or None"
    if listed:
        if not devices:
            raise DpaxError(f"`devices` is an empty list; {fix}")
        if not all(isinstance(d, jax.Device) for d in devices):
            raise DpaxError(f"`devices` lists {devices!r}, not JAX devices; {fix}")
        if len(set(devices)) < len(devices):
            raise DpaxError(f"`devices` lists a device twice; {fix}")
    elif devices is not None and (not isinstance(devices, int) or isinstance(devices, bool)):
        raise DpaxError(f"`devices` must be a device count, got {devices!r}; {fix}")


def _groups(config: TrainerConfig, devices: int) -> int:
    """Hybrid sharding's groups on `devices` devices (over every process);
    one for a layout that holds the whole state on every device."""
    groups = replica_count(config.replicas, devices, jax.process_count())
    if groups > 1 and layouts.layout_class(config.sharding).whole_state:
        warnings.warn(f"`replicas={config.replicas}` changes nothing with "
                      f"`sharding={layouts.layout_class(config.sharding).name}` (every device "
                      "holds the whole state); groups split a sharded state: pass "
                      "`sharding=full` or `sharding=optimizer`", DpaxWarning, stacklevel=3)
        return 1
    return groups
