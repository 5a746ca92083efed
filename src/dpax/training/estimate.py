"""What a training step will need before it runs: memory per device, FLOPs,
collective bytes and a predicted step time, from abstract shapes only (no
array of the model is ever made, so a model far bigger than this machine can
be estimated).

  params, optimizer state   `nnx.eval_shape` of the model, `jax.eval_shape` of
                            the optimizer's init; per device by layout
  gradients                 the params' bytes where the layout holds them whole
  activations               what the backward pass keeps: JAX's own list of the
                            residuals a `vjp` saves (`saved_residuals`), for one
                            device's micro-batch, in the compute dtype, under
                            the model's remat policy. An upper bound: XLA's
                            fusion recomputes some elementwise results instead
                            of keeping them (docs/speed.md compares the two)
  FLOPs                     XLA's cost analysis of the lowered gradient step
  collectives               the least the layout moves (`Layout.step_collectives`),
                            which tests/test_comms.py holds the compiled step to

The step time is a model, stated as such: compute at `mfu` of the devices'
peak, plus the collectives' ring traffic over the links, not overlapped (an
upper bound; perfect overlap would give the larger of the two). A
collective whose devices are all in one host runs at `link_gbps`; one that
spans hosts at `host_link_gbps`, each device's share of the network between
hosts, which bounds the whole ring. Hybrid sharding (`replicas`) keeps the
gathers and scatters inside a group and sends only the all-reduce of each
device's gradient slice across the groups.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # JAX's list behind print_saved_residuals

from dpax.parallel import comms
from dpax.parallel.comms import ACROSS
from dpax.parallel.layout import Layout, layout_class, tree_bytes
from dpax.parallel.mesh import replica_count
from dpax.training.compute import model_in


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the user rents: per-device peak, link and memory (None: unknown)."""

    tflops: float | None = None  # dense peak per device in the compute dtype, TFLOP/s
    link_gbps: float | None = None  # per-device collective bandwidth inside a host, Gbit/s
    memory_gb: float | None = None  # per device, GB (1e9 bytes)
    mfu: float = 0.5  # the fraction of peak the step's compute reaches
    devices_per_host: int | None = None  # None: every device in one host
    host_link_gbps: float | None = None  # per device, between hosts (None: `link_gbps`)


@dataclasses.dataclass
class Estimate:
    devices: int
    layout: str
    grad_accum: int
    micro_batch: int  # examples per device per micro-batch
    params: int  # count
    memory: dict[str, float]  # bytes per device by part, and "total"
    flops_per_step: float  # the whole global batch, forward + backward
    collectives: dict[str, int]  # kind -> logical bytes per step
    wire_bytes: float  # per device per step, ring algorithms
    # Of `wire_bytes`, sent over each link: INSIDE a host, BETWEEN hosts.
    links: dict[str, float] = dataclasses.field(default_factory=dict)
    replicas: int = 1
    tokens_per_example: int = 1
    batch_size: int = 0
    compute_s: float | None = None
    comm_s: float | None = None
    fits: bool | None = None

    @property
    def step_s(self) -> float | None:
        if self.compute_s is None:
            return None
        return self.compute_s + (self.comm_s or 0.0)

    @property
    def tokens_per_s(self) -> float | None:
        step = self.step_s
        return None if not step else self.batch_size * self.tokens_per_example / step


INSIDE, BETWEEN = "inside a host", "between hosts"


def link_bytes(moved: dict[str, int], n: int, replicas: int,
               devices_per_host: int | None) -> dict[str, float]:
    """Bytes each device sends per step over each link, ring algorithms, for
    `moved` (`Layout.step_collectives`) on n devices in `replicas` groups of
    consecutive devices, `devices_per_host` to a host (None: one host)."""
    per_host, g = devices_per_host or n, n // replicas
    out: dict[str, float] = {}
    for kind, nbytes in moved.items():
        across = kind.startswith(ACROSS)
        # A group's devices are consecutive: inside one host only when its
        # hosts hold whole groups. The devices one slice is summed over are a
        # group apart, one per group, in as many hosts as all n.
        members = replicas if across else g
        inside = n <= per_host if across else per_host % g == 0
        link = INSIDE if inside else BETWEEN
        out[link] = out.get(link, 0.0) + comms.wire_bytes(kind.removeprefix(ACROSS), nbytes,
                                                          members)
    return out


def _concrete(rest):
    """The model's small non-param state (RNG keys and counters, batch
    statistics) as real arrays: the traced loss reads them as constants."""
    def make(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.split(jax.random.key(0), x.shape) if x.shape else \
                jax.random.key(0)
        return jnp.zeros(x.shape, x.dtype)

    return jax.tree.map(make, rest)


def activation_bytes(graphdef, params, rest, loss_fn: Callable, batch: dict,
                     compute_dtype) -> int:
    """Bytes the backward pass keeps for one micro-batch (`batch`: abstract
    arrays), params cast to the compute dtype as the step casts them."""

    def total_loss(params, rest, batch):
        # Fresh Variables at this trace level (as the step makes them): NNX
        # refuses to update Variables of an outer trace (a remat's RNG counts).
        out = loss_fn(model_in(graphdef, params, jax.tree.map(lambda a: a, rest),
                               compute_dtype), batch)
        return jnp.sum(out[0] if isinstance(out, tuple) else out)

    kept = saved_residuals(total_loss, params, rest, batch)
    # The arguments (params, batch) are counted where they live, not twice.
    return sum(math.prod(a.shape) * a.dtype.itemsize for a, why in kept
               if not why.startswith("from the argument"))


def estimate(make_model: Callable[[], nnx.Module], loss_fn: Callable, tx, example: dict,
             batch_size: int, devices: int, layout: str | type[Layout] = "replicated",
             grad_accum: int = 1,
             compute_dtype=None, ema: bool = False, tokens_per_example: int = 1,
             hardware: Hardware = Hardware(), without_remat: Callable | None = None,
             blocks: int = 1, param_dtype=None, replicas: int | str = 1) -> Estimate:
    """The estimate of one step. `example`: one example's abstract arrays
    (`jax.ShapeDtypeStruct` without the batch axis), e.g. {"x": (785,) uint8,
    "y": () int32}; `batch_size`: global. For a model that rematerializes its
    `blocks` blocks, `without_remat` makes it without: the backward pass
    recomputes one block's activations at a time, and those are added.
    `param_dtype`: the dtype the params are stored in (None: the model's).
    `replicas`: hybrid sharding's groups (a divisor of `devices`, or
    "processes": one per host of `hardware.devices_per_host`; a layout that
    holds the whole state everywhere has none)."""
    n, k = devices, grad_accum
    layout_type = layout_class(layout)  # its memory and bytes models
    replicas = replica_count(replicas, n, n // (hardware.devices_per_host or n))
    if layout_type.whole_state:
        replicas = 1
    micro = -(-batch_size // (n * k))  # dpax pads the global batch to a multiple of n*k
    model = nnx.eval_shape(make_model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if param_dtype is not None:
        params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, param_dtype)
                              if jnp.issubdtype(s.dtype, jnp.floating) else s, params)
    rest = _concrete(rest)
    opt = jax.eval_shape(tx.init, params)
    p = tree_bytes(params)

    def batch_of(b):
        return {key: jax.ShapeDtypeStruct((b, *s.shape), s.dtype) for key, s in example.items()}

    acts = activation_bytes(graphdef, params, rest, loss_fn, batch_of(micro), compute_dtype)
    recompute = 0.0
    if without_remat is not None:
        g0, p0, r0 = nnx.split(nnx.eval_shape(without_remat), nnx.Param, ...)
        recompute = activation_bytes(g0, p0, _concrete(r0), loss_fn, batch_of(micro),
                                     compute_dtype) / blocks
    compute_bytes = jnp.dtype(compute_dtype).itemsize if compute_dtype is not None else None
    # The model as built: the user's model object keeps its arrays on the
    # device it was made on (the first), and `fit` leaves the trained state in
    # it. On one H100 that device's peak was XLA's need plus this. `dpax train`
    # builds a split layout's model in host memory (`cli.job.make_trainer`),
    # which the layout's memory model counts as nothing.
    built = p + sum(x.nbytes for x in jax.tree.leaves(rest))
    # A split state is split over one group's devices.
    state = layout_type.memory(params, opt, n // replicas, k, compute_bytes, ema, built)
    memory = {**state, "activations": acts + recompute,
              "batch": tree_bytes(batch_of(micro * k))}
    memory["total"] = sum(memory.values())

    # FLOPs of one micro-batch's forward + backward on one device, from XLA.
    def grad_step(params, rest, batch):
        def loss(q):
            model = nnx.merge(graphdef, q, jax.tree.map(lambda a: a, rest))
            return jnp.sum(loss_fn(model, batch)[0])
        return jax.grad(loss)(params)

    # Counted on the host's CPU backend, whatever the machine: the count is the
    # model's, and GPU plugins do not analyse a lowered module (on an H100 the
    # count came back empty).
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        cost = jax.jit(grad_step).lower(params, rest, batch_of(micro)).cost_analysis() or {}
    flops = float(cost.get("flops", 0.0)) * n * k

    h = hardware
    moved = layout_type.step_collectives(params, n, k, compute_bytes, replicas)
    links = link_bytes(moved, n, replicas, h.devices_per_host)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    est = Estimate(n, layout_type.name, k, micro, count, memory, flops, moved,
                   sum(links.values()), links, replicas, tokens_per_example, micro * n * k)
    if h.tflops:
        est.compute_s = flops / n / (h.tflops * 1e12 * h.mfu)
    if h.link_gbps:
        rate = {INSIDE: h.link_gbps, BETWEEN: h.host_link_gbps or h.link_gbps}
        est.comm_s = sum(b / (rate[link] * 1e9 / 8) for link, b in links.items())
    if h.memory_gb:
        est.fits = memory["total"] <= h.memory_gb * 1e9
    return est
