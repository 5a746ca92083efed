"""The loops dpax is measured against, and dpax's own `Trainer.fit` path.

  dpax/shard_map, dpax/pmap   the real `Trainer.fit` path (host batches, masks, metrics),
                              as a user gets it: the generic path GPUs and TPUs take
  dpax/k=K                    the same with K steps per compiled call
  dpax/optimizer, dpax/full   the shard_map path with ZeRO-1 or FSDP state (`dpax.parallel.layout`)
  dpax/tuned                  the shard_map path with the opt-in XLA:CPU tuning (CPU only,
                              `dpax.parallel.platform`)
  dpax/guard                  dpax/shard_map with `skip_nonfinite=True`: the opt-in skip of a
                              non-finite step, and its gradient norm (its price is the
                              difference)
  pmap loop                   the jax.pmap tutorials' loop: pmap + pmean, batches reshaped
                              on the host
  jit 1 device                a plain jit loop on one device with the whole batch
  jit sharded                 jit with the batch sharded by NamedSharding over N devices and
                              the state replicated: XLA partitions the whole step itself
                              (the path JAX's docs recommend)
  jit masked                  jit sharded (jit 1 device at N = 1) keeping what dpax promises
                              of a batch: the per-example loss dpax trains with, a mask over
                              the rows, the mean weighted as dpax weights it
                              (`Workload.masked_loss`); a reference for what the promise
                              costs a hand loop, not a "best hand loop"

Every method trains with the workload's optimizer (`Workload.tx`) and, as the
seeds' loop does, computes the loss and the accuracy of every step
(`Workload.mean_loss`, `jit masked` `Workload.masked_loss`; dpax's built-in
losses report both).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpax.bench.timing import Method, first_call
from dpax.bench.workloads import synthetic
from dpax.parallel import comms
from dpax.parallel.arrays import replicate
from dpax.parallel.layout import Split
from dpax.training.trainer import Trainer


def bench_dpax(w, n, backend, batch_size, steps_per_call=1, name=None,
               sharding="replicated", **options) -> Method:
    """`Trainer.fit` on the workload; `options`: more of `Trainer`'s
    (`xla_cpu_tuning`, `skip_nonfinite`). The default path unless
    `xla_cpu_tuning=True`, whatever the environment says."""
    options.setdefault("xla_cpu_tuning", False)
    x, y = synthetic(w, batch_size)
    t = Trainer(w.make(), w.loss(), w.tx(), devices=n, backend=backend,
                steps_per_call=steps_per_call, sharding=sharding, **options)
    done = [0]

    def run(k):  # fit trains until the step counter reaches the total
        done[0] += k
        t.fit(x, y, batch_size=batch_size, until_step=done[0], log_every=10**9)

    method = first_call(name or f"dpax/{backend}", run, steps_per_call)
    compiled = compiled_step(t, batch_size, w)  # after: compiling is not timed
    method.memory = step_memory(compiled)
    method.comms = step_comms(t, compiled)
    method.state = state_bytes(t)
    return method


def state_bytes(t: Trainer) -> int:
    """Bytes of params + optimizer state at rest on the first device, from the
    arrays' own shards."""
    first = t.backend.devices[0]
    return sum(s.data.nbytes for x in jax.tree.leaves((t.state.params, t.state.opt_state))
               for s in x.addressable_shards if s.device == first)


def compiled_step(t: Trainer, batch_size: int, w):
    """The Trainer's training step compiled for a full batch of `w`'s shapes."""
    size = t.padded(batch_size)
    x, y = synthetic(w, size, 1)
    host = {"x": x, "y": y, "mask": np.ones(size, bool)}
    return t.lower_train_step(host, size).compile()


def step_memory(compiled) -> float:
    """Bytes one device needs for the step: arguments + temporaries, from XLA."""
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
            - m.alias_size_in_bytes)


def step_comms(t: Trainer, compiled) -> dict:
    """The step's collectives from its optimized HLO (`dpax.parallel.comms`),
    the least its layout needs (from the params' logical bytes), and what that
    least is in the padded shapes a sharded layout splits."""
    groups = t.backend.replicas
    group = t.n_devices // groups if groups > 1 else None
    found = comms.summary(comms.collectives(compiled.as_text(), t.n_devices, group))
    if t.n_devices == 1:
        return {"found": found, "minimum": {}, "padded": {}}
    # Each param's bytes from its split (its logical shape whatever the
    # backend: a pmap leaf also has a device axis).
    stored = jax.tree.leaves(t.state.params)
    splits = jax.tree.leaves(t.layout.grad_splits, is_leaf=lambda s: isinstance(s, Split))
    logical, padded = (sum(math.prod(getattr(s, shape)) * x.dtype.itemsize
                           for x, s in zip(stored, splits))
                       for shape in ("shape", "padded_shape"))
    least = t.layout.least_collectives
    minimum, padded = least(logical, logical), least(padded, padded)
    if groups > 1:  # each device's slice of the gradients, summed across the groups
        minimum[comms.ACROSS + "all-reduce"] = logical // group
        padded[comms.ACROSS + "all-reduce"] = padded["reduce-scatter"] // group
    return {"found": found, "minimum": minimum, "padded": padded}


def _split(w, masked=False):
    """((loss, metrics) of (params, x, y), params), or with `masked` of
    (params, batch) (`Workload.masked_loss`): the model's other state (e.g.
    RNG counters of dropout layers, unused at rate 0) held fixed."""
    graphdef, params, rest = nnx.split(w.make(), nnx.Param, ...)

    def loss(params, *batch):
        model = nnx.merge(graphdef, params, rest)
        return w.masked_loss(model, *batch) if masked else w.mean_loss(model, *batch)

    return loss, params


def bench_pmap_loop(w, n, batch_size) -> Method:
    """The pmap tutorials' loop: replicate params, reshape each batch to (n, b/n, ...),
    pmap a step that pmeans the gradients, the loss and the accuracy, read the
    loss only at the end."""
    x, y = synthetic(w, batch_size)
    mean_loss, params = _split(w)
    tx = w.tx()
    devices = jax.local_devices()[:n]

    @functools.partial(jax.pmap, axis_name="devices", devices=devices, donate_argnums=(0, 1))
    def train_step(params, opt_state, xb, yb):
        (loss, accuracy), grads = jax.value_and_grad(mean_loss, has_aux=True)(params, xb, yb)
        grads, loss, accuracy = jax.lax.pmean((grads, loss, accuracy), "devices")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accuracy

    # Replicas stacked on the host; the first call places them.
    state = [replicate(params, n), replicate(tx.init(params), n)]
    per = batch_size // n
    n_batches = len(x) // batch_size

    def run(k):
        loss = None
        for i in range(k):
            j = i % n_batches
            xb = x[j * batch_size:(j + 1) * batch_size].reshape((n, per) + x.shape[1:])
            yb = y[j * batch_size:(j + 1) * batch_size].reshape(n, per)
            state[0], state[1], loss, _ = train_step(state[0], state[1], xb, yb)
            if i % 2 == 1:  # XLA:CPU aborts if too many multi-device steps queue up
                loss.block_until_ready()
        float(loss[0])  # the seed's log line: one sync at the end

    return first_call("pmap loop", run)


def bench_jit(w, batch_size, n=None, masked=False) -> Method:
    """A jit loop: on one device (`n` None), or with the batch sharded over
    `n` devices by NamedSharding and the state replicated; each step returns
    the loss and the accuracy, the loss read only at the end. `masked`: the
    step takes a batch with a mask, and minimizes `Workload.masked_loss`."""
    x, y = synthetic(w, batch_size)
    loss_fn, params = _split(w, masked)
    tx = w.tx()
    state = [params, tx.init(params)]
    put = None
    if n is not None:
        mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:n]), ("data",))
        state = jax.device_put(state, NamedSharding(mesh, P()))
        rows = NamedSharding(mesh, P("data"))
        put = functools.partial(jax.device_put, device=rows)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, *batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    n_batches = len(x) // batch_size
    mask = np.ones(batch_size, bool)  # every row real: the bench's batches are full

    def run(k):
        loss = None
        for i in range(k):
            j = i % n_batches
            batch = (x[j * batch_size:(j + 1) * batch_size], y[j * batch_size:(j + 1) * batch_size])
            if masked:
                batch = ({"x": batch[0], "y": batch[1], "mask": mask},)
            if put is not None:
                batch = put(batch)
            state[0], state[1], loss, _ = train_step(state[0], state[1], *batch)
            if put is not None and i % 2 == 1:  # XLA:CPU: bound the multi-device queue
                state[0] = jax.block_until_ready(state[0])
        jax.block_until_ready(state)
        float(loss)  # the log line: one sync at the end

    name = "jit masked" if masked else "jit 1 device" if n is None else "jit sharded"
    return first_call(name, run)
