"""Seconds to the first step through the Python API, dpax's `Trainer` against
a hand-written `jit` loop (the batch sharded by `NamedSharding`, the state
replicated; `masked`: the same keeping dpax's masks and weighted mean,
`Workload.masked_loss`; `smap`: that step per device under `jax.shard_map`,
its gradients pmeaned), in a fresh process with an empty compilation
cache, on a bench workload (`dpax.bench.workloads`). The model is made
before the clock; then dpax builds its `Trainer` and `fit`s one step, or
the hand loop splits the model, runs `tx.init`, places the state and calls
its step; both end with the loss on the host. JAX's monitoring events split
the time into tracing, lowering and XLA's compile.

    python scripts/first_call_time.py 2 dpax gpt
    python scripts/first_call_time.py 2 hand gpt
    python scripts/first_call_time.py 2 pmap gpt   # the seeds' pmap loop
    python scripts/first_call_time.py 2 masked gpt # jit, with a mask over the rows
    python scripts/first_call_time.py 2 smap gpt   # the same math per device (shard_map)
    python scripts/first_call_time.py 2 dpax gpt DIR  # compiled programs kept in DIR

Without DIR, dpax keeps its programs in an empty directory (its default
cache) and the hand loops in none (JAX's default). With DIR, that is the
cache of both (dpax's `compile_cache`; for the hand loops JAX's own, of
programs of 0.1 s and more, as dpax keeps them): a second run with the
same DIR times a rerun's first step.

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

WHOS = ("dpax", "hand", "masked", "smap", "pmap")
if len(sys.argv) not in (4, 5) or not sys.argv[1].isdigit() or not 1 <= int(sys.argv[1]) <= 8:
    sys.exit("usage: first_call_time.py N WHO WORKLOAD [CACHE_DIR]  (N: 1-8 devices)")
N, WHO, WORKLOAD = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# Without CACHE_DIR: dpax's default cache in an empty directory, the hand loops none.
CACHE = sys.argv[4] if len(sys.argv) == 5 else None
if WHO not in WHOS:
    sys.exit(f"WHO is one of {', '.join(WHOS)}, got {WHO!r}")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["DPAX_CACHE_DIR"] = CACHE or tempfile.mkdtemp()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import monitoring  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from dpax.bench.workloads import WORKLOADS, synthetic  # noqa: E402
from dpax.training.trainer import Trainer  # noqa: E402

if WORKLOAD not in WORKLOADS:
    sys.exit(f"WORKLOAD is one of {', '.join(WORKLOADS)}, got {WORKLOAD!r}")
if CACHE and WHO != "dpax":  # dpax sets its own (`compile_cache`); the hand loops, JAX's
    jax.config.update("jax_compilation_cache_dir", CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)

events: dict = collections.defaultdict(float)
timing = [False]


def listen(name, seconds, **kwargs):
    if timing[0]:
        events[name.rsplit("/", 1)[-1]] += seconds


def hand_loop(w, model, x, y, masked=False, per_device=False):
    """`masked`: the step takes a batch with a mask over its rows and
    minimizes `Workload.masked_loss` (dpax's per-example loss, weighted as
    dpax weights it); no dpax code runs but the loss function. `per_device`
    (with `masked`): that step per device under `jax.shard_map`, each
    device's mean loss and gradients pmeaned (the global mean where every
    device holds as many examples and tokens, as in the bench's batches)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = w.tx()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
    state = jax.device_put((params, tx.init(params)), NamedSharding(mesh, P()))
    rows = NamedSharding(mesh, P("data"))

    def loss(p, *batch):
        model = nnx.merge(graphdef, p, rest)
        return w.masked_loss(model, *batch) if masked else w.mean_loss(model, *batch)

    def step(params, opt_state, *batch):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, *batch)
        if per_device:
            grads, value, metrics = jax.lax.pmean((grads, value, metrics), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, metrics

    if per_device:
        step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("data")),
                             out_specs=(P(), P(), P(), P()))
    train_step = functools.partial(jax.jit, donate_argnums=(0, 1))(step)

    b = w.batch_size
    batch = (x[:b], y[:b])
    if masked:  # `per_device` is the masked step per device
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
        t = Trainer(model, w.loss(), w.tx(), devices=N, xla_cpu_tuning=False,
                    compile_cache=CACHE or "default")
        t.fit(x, y, batch_size=w.batch_size, until_step=1, log_every=10**9)
        jax.block_until_ready(t.state.params)
    elif WHO == "pmap":
        pmap_loop(w, model, x, y)
    else:
        hand_loop(w, model, x, y, masked=WHO in ("masked", "smap"), per_device=WHO == "smap")
    seconds = time.perf_counter() - start
    parts = {k: round(v, 2) for k, v in sorted(events.items()) if v > 0.05}  # the rest: < 0.05 s
    print(f"{WHO} {WORKLOAD} N={N}: first step {seconds:.2f} s {parts}")


if __name__ == "__main__":
    main()
