"""`dpax estimate`: memory per device, FLOPs, collective bytes and a predicted
step time for a model and flags on hardware the user names, before renting
it; from abstract shapes only (`dpax.training.estimate`). When the run does
not fit, the layouts, remat and micro-batches that would make it fit."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp

from dpax import config as cfg
from dpax.cli import devices
from dpax.cli.flags import add_flags, config_from_args
from dpax.data import tokenizer
from dpax.data.datasets import DataConfig
from dpax.errors import DpaxError
from dpax.models import losses
from dpax.models.registry import ModelConfig, make_model
from dpax.parallel.layout import SHARDINGS
from dpax.parallel.mesh import replica_count
from dpax.training.estimate import Estimate, Hardware, estimate
from dpax.training.optim import OptimizerConfig, state_stored_in
from dpax.training.trainer import PRECISIONS

NAME = "estimate"


@dataclasses.dataclass
class EstimateConfig:
    """`dpax estimate`: the flags of `dpax train` that shape a step, and the hardware."""

    batch_size: int = cfg.field(128, "GLOBAL batch size, split over the devices")
    devices: int = cfg.field(8, "devices of the run (any count: none are used here)")
    sharding: str = cfg.field("replicated", "where the state lives: replicated, optimizer "
                              "(ZeRO-1) or full (FSDP)")
    replicas: str | int = cfg.field(
        1, "hybrid sharding's groups: a divisor of --devices, or 'processes' (one per host, "
        "--devices-per-host)", metavar="R")
    grad_accum: int = cfg.field(1, "micro-batches per device, accumulated in the step")
    precision: str = cfg.field("fp32", "fp32, or bf16 compute on fp32 master params")
    param_dtype: str = cfg.field("fp32", "dtype the params are stored in: fp32 or bf16")
    opt_state_dtype: str = cfg.field("fp32", "dtype the optimizer's state is kept in: fp32 "
                                     "or bf16")
    ema_decay: float | None = cfg.field(None, "an EMA of the params is kept (its size counts)")
    device_tflops: float | None = cfg.field(
        None, "peak TFLOP/s per device in the compute dtype (e.g. 989 for an H100's bf16)",
        metavar="X")
    link_gbps: float | None = cfg.field(
        None, "collective bandwidth per device, Gbit/s (e.g. 3600 for NVLink 4)", metavar="X")
    devices_per_host: int | None = cfg.field(
        None, "devices in one host (default: all --devices in one)")
    host_link_gbps: float | None = cfg.field(
        None, "bandwidth per device between hosts, Gbit/s (e.g. 400 for one 400G NIC per "
        "GPU; default: --link-gbps)", metavar="X")
    device_memory_gb: float | None = cfg.field(None, "memory per device, GB", metavar="X")
    mfu: float = cfg.field(0.5, "fraction of the peak the step's compute reaches")
    model: ModelConfig = cfg.group(ModelConfig)
    data: DataConfig = cfg.group(DataConfig)
    optimizer: OptimizerConfig = cfg.group(OptimizerConfig)

    def check(self) -> None:
        for name in ("batch_size", "devices", "grad_accum", "devices_per_host"):
            cfg.whole(self, name)
        if self.devices_per_host is not None and self.devices % self.devices_per_host:
            raise DpaxError(f"--devices {self.devices} is not a whole number of hosts of "
                            f"--devices-per-host {self.devices_per_host}")
        if self.replicas == "processes" and self.devices_per_host is None:
            raise DpaxError("--replicas processes makes one group per host: give "
                            "--devices-per-host")
        hosts = self.devices // (self.devices_per_host or self.devices)
        self.replicas = replica_count(int(self.replicas) if str(self.replicas).isdigit()
                                      else self.replicas, self.devices, hosts)
        cfg.one_of(self, "sharding", SHARDINGS)
        cfg.one_of(self, "precision", PRECISIONS)
        cfg.one_of(self, "opt_state_dtype", PRECISIONS)
        cfg.one_of(self, "param_dtype", PRECISIONS)
        for name in ("device_tflops", "link_gbps", "host_link_gbps", "device_memory_gb"):
            cfg.number(self, name, 0, low_open=True)
        cfg.number(self, "mfu", 0, 1, low_open=True, high_open=False)
        if self.model.takes_text != self.data.is_text:
            raise DpaxError(f"--model {self.model.name} does not fit --data {self.data.name}")

    @property
    def hardware(self) -> Hardware:
        return Hardware(self.device_tflops, self.link_gbps, self.device_memory_gb, self.mfu,
                        self.devices_per_host, self.host_link_gbps)


def add_parser(sub) -> None:
    parser = sub.add_parser(NAME, help="memory, FLOPs, bytes and step time before a run",
                            description="Estimate a training step on hardware you name: "
                            "memory per device, FLOPs, collective bytes, step time.")
    add_flags(parser, EstimateConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, EstimateConfig))
    devices.backend_started()  # no devices of its own: it traces shapes only
    ignored = config.model.ignored() or config.optimizer.ignored()
    if ignored:
        raise DpaxError(ignored)
    est = estimate_config(config)
    print(report(config, est))
    if est.fits is False:
        for line in suggestions(config):
            print(line)
    return 0


def _shapes(config: EstimateConfig):
    """(task, one example's abstract arrays, n_out, tokens per example): for
    text from the flags alone; other data is read for its shapes."""
    if config.data.is_text:
        vocab = tokenizer.check_spec(config.data.tokenizer) or 256
        seq = config.data.seq_len
        return "lm", {"x": jax.ShapeDtypeStruct((seq + 1,), jnp.uint8 if vocab <= 256
                                                else jnp.int32),
                      "y": jax.ShapeDtypeStruct((), jnp.int32)}, vocab, seq
    ds = config.data.load()
    x = jax.ShapeDtypeStruct(ds.input_shape, ds.x_train.dtype)
    return ds.task, {"x": x, "y": jax.ShapeDtypeStruct((), ds.y_train.dtype)}, ds.n_out, 1


def estimate_config(config: EstimateConfig, **changes) -> Estimate:
    """The estimate of `config`, with `changes` (sharding, grad_accum, remat) applied."""
    model_cfg = dataclasses.replace(config.model, remat=changes.get("remat", config.model.remat),
                                    init_from=None)  # its shape is what the flags say
    task, example, n_out, tokens = _shapes(config)
    tx, _ = config.optimizer.build(config.batch_size, 1000, model_cfg.lr)
    if PRECISIONS[config.opt_state_dtype] is not None:
        tx = state_stored_in(tx, PRECISIONS[config.opt_state_dtype])
    return estimate_model(model_cfg.name, model_cfg.options(), example, n_out, task, tx,
                          config.batch_size, config.devices,
                          changes.get("sharding", config.sharding),
                          changes.get("grad_accum", config.grad_accum), config.precision,
                          config.ema_decay is not None, tokens, config.hardware,
                          param_dtype=config.param_dtype, replicas=config.replicas)


def estimate_model(name: str, options: dict, example: dict, n_out: int, task: str, tx,
                   batch_size: int, devices: int, layout: str = "replicated",
                   grad_accum: int = 1, precision: str = "fp32", ema: bool = False,
                   tokens_per_example: int = 1, hardware: Hardware | None = None,
                   param_dtype: str = "fp32", replicas: int = 1) -> Estimate:
    """The estimate of the registered model `name` (`options`: `make_model`'s,
    `remat` among them) on `example`'s shapes, with its built-in loss. With
    remat, the same model without it gives the one block recomputed at a time."""
    in_shape = tuple(example["x"].shape)

    def build(**change):
        return lambda: make_model(name, in_shape, n_out, 0, task, **{**options, **change})

    remat = options.get("remat", "none") != "none"
    return estimate(build(), losses.for_task(task)[0], tx, example, batch_size, devices, layout,
                    grad_accum, PRECISIONS[precision], ema, tokens_per_example,
                    hardware or Hardware(),
                    without_remat=build(remat="none") if remat else None,
                    blocks=options.get("layers", 1) if remat else 1,
                    param_dtype=PRECISIONS[param_dtype], replicas=replicas)


def _size(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def report(config: EstimateConfig, e: Estimate) -> str:
    m = e.memory
    parts = ", ".join(f"{k} {_size(v)}" for k, v in m.items() if k != "total")
    lines = [f"dpax estimate: {config.model.name} ({e.params / 1e6:.1f}M params) on "
             f"{e.devices} device{'s' * (e.devices != 1)}, --sharding {e.layout}"
             + (f" in {e.replicas} replica groups of {e.devices // e.replicas}"
                if e.replicas > 1 else "")
             + f", global batch {e.batch_size} = "
             f"{e.devices} x {e.grad_accum} x {e.micro_batch}, {config.precision}"
             + "".join(f", {what} {dtype}" for what, dtype in (
                 ("params", config.param_dtype), ("optimizer state", config.opt_state_dtype))
                       if dtype != "fp32"),
             f"memory per device: {_size(m['total'])} ({parts}); activations are an upper "
             "bound (JAX's saved residuals; XLA's fusion keeps less)"]
    if e.fits is not None:
        lines[-1] += (f"; fits in {config.device_memory_gb:g} GB: "
                      f"{'yes' if e.fits else 'NO'}")
    lines.append(f"FLOPs per step: {e.flops_per_step:.3g} (XLA's cost analysis), "
                 f"{e.flops_per_step / e.devices:.3g} per device")
    moved = ", ".join(f"{k} {_size(v)}" for k, v in e.collectives.items()) or "none"
    sent = " and ".join(f"{_size(b)} {link}" for link, b in e.links.items()
                        if config.devices_per_host) or _size(e.wire_bytes)
    lines.append(f"collectives per step: {moved}; {sent} sent per device (ring)")
    if e.step_s is not None:
        comm = " (no --link-gbps: its collectives not timed)" if e.collectives else ""
        if e.comm_s is not None:
            rates = f"{config.link_gbps:g} Gbit/s" + (
                f" inside a host, {config.host_link_gbps:g} between hosts"
                if config.host_link_gbps and config.devices_per_host else "")
            comm = f" + {1e3 * e.comm_s:.1f} ms collectives at {rates}, not overlapped"
        unit = "tokens" if e.tokens_per_example > 1 else "examples"
        lines.append(f"predicted step: {1e3 * e.step_s:.1f} ms = {1e3 * e.compute_s:.1f} ms "
                     f"compute at {config.mfu:g} of {config.device_tflops:g} TFLOP/s{comm}; "
                     f"{e.tokens_per_s:,.0f} {unit}/s")
    return "\n".join(lines)


def suggestions(config: EstimateConfig, limit: int = 3) -> list[str]:
    """Changes that make the run fit: for each layout (from the given one up)
    and remat choice, the fewest micro-batches that fit."""
    per_device = -(-config.batch_size // config.devices)
    remats = ["none", "block"] if config.model.takes_text else [config.model.remat]
    accums = [k for k in (1, 2, 4, 8, 16) if config.grad_accum <= k <= per_device]
    layouts = SHARDINGS[SHARDINGS.index(config.sharding):]
    found = []
    for sharding, remat in itertools.product(layouts, remats):
        for k in accums:
            e = estimate_config(config, sharding=sharding, remat=remat, grad_accum=k)
            if e.fits:
                flags = (f"--sharding {sharding}" + (f" --remat {remat}" if remat != "none"
                                                     else "")
                         + (f" --grad-accum {k}" if k > 1 else ""))
                found.append(f"fits: {flags} ({_size(e.memory['total'])} per device"
                             + (f", {1e3 * e.step_s:.1f} ms per step)" if e.step_s else ")"))
                break
        if len(found) == limit:
            break
    return found or ["nothing tried fits (layouts, --remat block, --grad-accum up to 16): "
                     "more devices, a smaller model or a smaller batch"]
