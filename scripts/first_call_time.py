"""Seconds to the first step through the Python API, dpax's `Trainer` against
a hand-written `jit` loop (the batch sharded by `NamedSharding`, the state
replicated; `masked`: the same keeping dpax's masks and weighted mean,
`Workload.masked_loss`), in a fresh process with an empty compilation
cache, on a bench workload (`dpax.bench.workloads`). The model is made
before the clock; then dpax builds its `Trainer` and `fit`s one step, or
the hand loop splits the model, runs `tx.init`, places the state and calls
its step; both end with the loss on the host. JAX's monitoring events split
the time into tracing, lowering and XLA's compile.

    python scripts/first_call_time.py 2 dpax gpt
    python scripts/first_call_time.py 2 hand gpt
    python scripts/first_call_time.py 2 pmap gpt   # the seeds' pmap loop
    python scripts/first_call_time.py 2 masked gpt # jit, with a mask over the rows

Run each side in its own process, alternating, several times: the first
call in a process pays its warm-ups. benchmarks/README.md ("First steps")
keeps the measured rows.
"""

import collections
import functools
import os
import sys
import tempfile
import time

N, WHO, WORKLOAD = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if WHO not in ("dpax", "hand", "masked", "pmap"):
    sys.exit(f"WHO is one of dpax, hand, masked, pmap, got {WHO!r}")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["DPAX_CACHE_DIR"] = tempfile.mkdtemp()  # an empty compilation cache

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import monitoring  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dpax.bench.workloads import WORKLOADS, synthetic  # noqa: E402
from dpax.training.trainer import Trainer  # noqa: E402

events: dict = collections.defaultdict(float)
timing = [False]


def listen(name, seconds, **kwargs):
    if timing[0]:
        events[name.rsplit("/", 1)[-1]] += seconds


def hand_loop(w, model, x, y, masked=False):
    """`masked`: the step takes a batch with a mask over its rows and
    minimizes `Workload.masked_loss` (dpax's per-example loss, weighted as
    dpax weights it); no dpax code runs but the loss function."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = w.tx()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
    state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P("data"))

    def loss(p, *batch):
        model = nnx.merge(graphdef, p, rest)
        return w.masked_loss(model, *batch) if masked else w.mean_loss(model, *batch)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, *batch):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    b = w.batch_size
    batch = (x[:b], y[:b])
    if masked:
        batch = ({"x": x[:b], "y": y[:b], "mask": np.ones(b, bool)},)
    params, _, value, _ = train_step(*state, *jax.device_put(batch, rows))
    float(value)
    jax.block_until_ready(params)


def pmap_loop(w, model, x, y):
    """The seeds' loop: replicas stacked on the host, the batch reshaped to
    (N, rows / N, ...), a pmapped step that pmeans the gradients and metrics."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = w.tx()
    state = jax.tree.map(lambda a: np.stack([np.asarray(a)] * N), (params, tx.init(params)))

    def loss(p, xb, yb):
        return w.mean_loss(nnx.merge(graphdef, p, rest), xb, yb)

    @functools.partial(jax.pmap, axis_name="devices", devices=jax.devices()[:N],
                       donate_argnums=(0, 1))
    def train_step(params, opt_state, xb, yb):
        (value, accuracy), grads = jax.value_and_grad(loss, has_aux=True)(params, xb, yb)
        grads, value, accuracy = jax.lax.pmean((grads, value, accuracy), "devices")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, accuracy

    b = w.batch_size
    xb, yb = x[:b].reshape((N, b // N) + x.shape[1:]), y[:b].reshape((N, b // N) + y.shape[1:])
    params, _, value, _ = train_step(*state, xb, yb)
    float(value[0])
    jax.block_until_ready(params)


def main() -> None:
    monitoring.register_event_duration_secs_listener(listen)
    w = WORKLOADS[WORKLOAD]
    x, y = synthetic(w, w.batch_size)
    model = w.make()
    timing[0] = True
    start = time.perf_counter()
    if WHO == "dpax":
        t = Trainer(model, w.loss(), w.tx(), devices=N, xla_cpu_tuning=False)
        t.fit(x, y, batch_size=w.batch_size, until_step=1, log_every=10**9)
        jax.block_until_ready(t.state.params)
    elif WHO == "pmap":
        pmap_loop(w, model, x, y)
    else:
        hand_loop(w, model, x, y, masked=WHO == "masked")
    seconds = time.perf_counter() - start
    parts = {k: round(v, 2) for k, v in sorted(events.items()) if v > 0.05}  # the rest: < 0.05 s
    print(f"{WHO} {WORKLOAD} N={N}: first step {seconds:.2f} s {parts}")


if __name__ == "__main__":
    main()
