"""The typed run configuration: the single source of defaults and help texts.

The CLI is derived from these fields, so a default lives here (or in the
module that owns it, named here) and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings

from dpax.data.pipeline import EVAL_BATCH
from dpax.errors import DpaxError, DpaxWarning
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend
from dpax.parallel.distributed import DEFAULT_TIMEOUT_S

F32_MAX = 3.4028234663852886e38  # the largest finite float32

# Fields of earlier versions: old name -> what replaces it.
RENAMED = {"shard_optimizer_state": "sharding: optimizer"}

# The main job's length when neither --epochs nor --steps is given.
DEFAULT_EPOCHS = 15


def _field(default, help: str, how: bool = False, **meta):
    """A config field. `how=True`: it changes how a run executes, not what it
    computes (beyond float rounding), so a resume may change it."""
    return dataclasses.field(default=default, metadata={"help": help, "how": how, **meta})


@dataclasses.dataclass
class TrainConfig:
    """One training run. The default is the main job: the digits CNN on 8 devices."""

    model: str = _field("cnn", "model: linear, mlp, cnn, cnn-bn (BatchNorm + dropout), deep-mlp "
                      "(~100M params), or gpt (a transformer, for text data)")
    data: str = _field("digits", "data: regression, digits, random-images, a path to a .npz, "
                       "text (the Python standard library's sources) or text:PATH (a text "
                       "file or a directory of them; byte tokens), or examples streamed from "
                       "disk: a directory or glob of ArrayRecord shards (dpax prepare), "
                       "Parquet files, or a saved Hugging Face dataset")
    x_column: str = _field("x", "streamed data: the column (feature) of inputs")
    y_column: str = _field("y", "streamed data: the column (feature) of labels or targets")
    augment: str | None = _field(
        None, "images: crop, flip or crop,flip; each example's draw comes from the seed, the "
        "step and its place in the global batch, so any device count trains the same")
    data_workers: int = _field(
        0, "Grain worker processes that read and decode batches (0: the training thread)",
        how=True)
    seq_len: int = _field(128, "text: tokens per training window (gpt's context length)")
    layers: int = _field(4, "gpt: transformer blocks")
    width: int = _field(128, "gpt: embedding width")
    heads: int = _field(4, "gpt: attention heads (a divisor of --width)")
    dropout: float = _field(0.0, "gpt: dropout rate (masks independent of the device count)")
    remat: str = _field("none", "gpt: activation checkpointing per block: none, block (keep "
                        "only block inputs) or dots (keep matmul outputs)", how=True)
    ema_decay: float | None = _field(
        None, "keep an EMA of the params with this decay (e.g. 0.999); eval uses it")
    devices: int | None = _field(
        None, "devices per process (default: all local accelerators; on CPU, 8 simulated)",
        how=True)
    backend: str = _field(DEFAULT_BACKEND, "shard_map (jit + shard_map) or pmap", how=True)
    batch_size: int = _field(128, "GLOBAL batch size, split over the devices")
    epochs: int | None = _field(
        None, f"passes over the training data (default {DEFAULT_EPOCHS} unless --steps is given)",
        how=True)  # how long, not what: a finished run can be extended
    steps: int | None = _field(None, "training steps (instead of --epochs)", how=True)
    optimizer: str = _field("adam", "sgd, momentum, adam or adamw")
    lr: float = _field(3e-3, "peak learning rate")
    schedule: str = _field("constant", "constant or warmup-cosine")
    warmup_steps: int = _field(0, "linear warmup steps")
    scale_lr: bool = _field(False, "scale lr by batch-size / reference-batch (linear rule)")
    reference_batch: int = _field(128, "batch size the lr was tuned for (with --scale-lr)")
    momentum: float = _field(0.9, "momentum of the momentum optimizer")
    weight_decay: float = _field(1e-4, "weight decay of adamw")
    grad_accum: int = _field(1, "micro-batches per device, accumulated in the step", how=True)
    precision: str = _field("fp32", "fp32, or bf16 compute on fp32 master params")
    allreduce_dtype: str = _field("fp32", "dtype of the gradient all-reduce: fp32 or bf16")
    clip_norm: float | None = _field(None, "clip the reduced gradient to this global norm")
    max_bad_steps: int = _field(
        10, "stop (exit 3) after this many non-finite steps in a row, checked at log steps",
        how=True)
    sync_batchnorm: bool = _field(
        True, "BatchNorm statistics over the global batch (--no-sync-batchnorm: per "
              "device, not equivalent to one device)")
    sharding: str = _field(
        "replicated", "where the state lives: replicated; optimizer (ZeRO-1: optimizer state "
        "1/N per device); full (FSDP: params, gradients and optimizer state 1/N per device); "
        "shard_map backend", how=True)
    steps_per_call: int = _field(
        1, "training steps per compiled call (a scan over batches on the device)", how=True)
    seed: int = _field(0, "seed of the init and of the batch order")
    log_every: int = _field(10, "steps between metric logs (host syncs happen only here)",
                            how=True)
    eval_every: int = _field(0, "steps between evaluations (0: only at the end)", how=True)
    out: str | None = _field(None, "run directory for metrics.jsonl and params.npz", how=True)
    overwrite: bool = _field(False, "replace the run already in --out (default: refuse)",
                             how=True)
    checkpoint_dir: str | None = _field(None, "directory for Orbax checkpoints", how=True)
    checkpoint_every: int = _field(0, "steps between checkpoints (0: only at the end)", how=True)
    keep: int = _field(3, "checkpoints to keep", how=True)
    resume: str | None = _field(
        None, "resume from the newest checkpoint in --checkpoint-dir, or from PATH",
        nargs="?", const="latest", how=True)
    tensorboard: bool = _field(False, "also write TensorBoard event files to --out/tensorboard",
                               how=True)
    profile_steps: str | None = _field(
        None, "A:B: a JAX profiler trace of steps A..B into --out/profile (Perfetto/TensorBoard)",
        how=True)
    quiet: bool = _field(False, "no progress output, only the summary line and errors", how=True)
    verbose: bool = _field(False, "plain progress lines even on a terminal, plus run details",
                           how=True)
    coordinator: str | None = _field(
        None, "HOST:PORT of process 0, for multi-process runs (or use dpax launch)", how=True)
    num_processes: int | None = _field(None, "processes in a multi-process run", how=True)
    process_id: int | None = _field(None, "this process's rank, 0..num-processes-1", how=True)
    timeout: int = _field(
        DEFAULT_TIMEOUT_S, "seconds before an unreachable coordinator or a dead rank stops the run",
        how=True)

    def profile_range(self) -> tuple[int, int]:
        """First and last step (1-based, inclusive) of --profile-steps A:B."""
        a, sep, b = (self.profile_steps or "").partition(":")
        if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
            raise DpaxError(f"`profile_steps` must be A:B with 1 <= A <= B, e.g. 10:20; "
                            f"got {self.profile_steps!r}")
        return int(a), int(b)

    def to_yaml(self) -> str:
        """The resolved config; `dpax train --config FILE` runs it again."""
        import yaml

        fields = dict(dataclasses.asdict(self), resume=None)  # a rerun starts fresh
        return yaml.safe_dump(fields, sort_keys=False)

    @classmethod
    def yaml_fields(cls, path: str) -> dict:
        """Field values from a YAML file, checked against the dataclass."""
        import yaml

        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except OSError as e:
            raise DpaxError(f"cannot read --config {path}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise DpaxError(f"--config {path} is not a text file; give a YAML file such as a "
                            "run's config.yaml") from None
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise DpaxError(f"--config {path} is not valid YAML{where}") from None
        if not isinstance(loaded, dict):
            raise DpaxError(f"--config {path} must hold a mapping of field: value")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(loaded) - known)
        for name in unknown:
            if name in RENAMED:
                raise DpaxError(f"--config {path}: `{name}` is now `{RENAMED[name]}`")
        if unknown:
            raise DpaxError(f"--config {path}: unknown field(s) {', '.join(unknown)}; "
                            "see dpax train --help")
        return loaded

    @classmethod
    def from_saved(cls, saved: dict) -> TrainConfig:
        """The config a checkpoint's metadata holds, fields of earlier versions
        translated (`RENAMED`)."""
        saved = dict(saved)
        if saved.pop("shard_optimizer_state", False):
            saved["sharding"] = "optimizer"
        return cls(**saved)

    def what_is_trained(self) -> dict:
        """The fields that define what is trained; a resume may change only the others."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if not f.metadata["how"]}

    def validate(self) -> None:
        """Raise `DpaxError` for a value no run can use, before anything is written."""
        from dpax import data, models
        from dpax.data import augment
        from dpax.parallel.layout import check_sharding
        from dpax.parallel.mesh import MAX_SIMULATED_DEVICES
        from dpax.training import optim
        from dpax.training.trainer import compute_dtype

        check_types(self)

        def whole(name, low=1):
            check_whole(self, name, low)

        def number(name, low, high=math.inf, low_open=False, high_open=True):
            value = getattr(self, name)
            if value is None:
                return
            # Finite as the float32 the step computes in (1e39 is a Python float, not one).
            ok = abs(value) <= F32_MAX and (value > low if low_open else value >= low) and (
                value < high if high_open else value <= high)
            if not ok:
                where = f"{'>' if low_open else '>='} {low:g}" + (
                    f" and {'<' if high_open else '<='} {high:g}" if math.isfinite(high) else "")
                raise DpaxError(f"`{name}` must be a finite number {where}, got {value!r}")

        for name in ("devices", "batch_size", "reference_batch", "log_every", "epochs",
                     "steps", "grad_accum", "steps_per_call", "max_bad_steps", "keep",
                     "timeout"):
            whole(name)
        for name in ("seed", "warmup_steps", "eval_every", "checkpoint_every", "data_workers"):
            whole(name, low=0)
        number("lr", 0, low_open=True)
        number("clip_norm", 0, low_open=True)
        number("momentum", 0, 1)
        number("weight_decay", 0)
        if self.devices is not None and self.devices > MAX_SIMULATED_DEVICES:
            raise DpaxError(f"`devices={self.devices}` is over the cap of "
                            f"{MAX_SIMULATED_DEVICES}; use fewer devices")
        if self.epochs is not None and self.steps is not None:
            raise DpaxError("give exactly one of `steps` or `epochs`, not both")
        for name in ("precision", "allreduce_dtype"):
            compute_dtype(getattr(self, name), name)
        check_backend(self.backend, self.num_processes or 1)
        for name, value, choices in (("model", self.model, models.MODELS),
                                     ("optimizer", self.optimizer, optim.OPTIMIZERS),
                                     ("schedule", self.schedule, optim.SCHEDULES)):
            if value not in choices:
                raise DpaxError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
        data.check_name(self.data)
        augment.parse(self.augment)
        if data.is_text(self.data) != (self.model in models.TEXT_MODELS):
            raise DpaxError(f"--model {self.model} does not fit --data {self.data}: text data "
                            f"needs --model {' or '.join(models.TEXT_MODELS)}, and "
                            f"{' or '.join(models.TEXT_MODELS)} needs text data")
        whole("seq_len")
        whole("layers")
        whole("width")
        whole("heads")
        if self.width % self.heads:
            raise DpaxError(f"`width` {self.width} must be a multiple of `heads` {self.heads}")
        number("dropout", 0, 1)
        number("ema_decay", 0, 1, low_open=True)
        from dpax.models.gpt import REMAT_POLICIES

        if self.remat not in REMAT_POLICIES:
            raise DpaxError(f"`remat` must be one of {', '.join(REMAT_POLICIES)}, "
                            f"got {self.remat!r}")
        for name in ("out", "checkpoint_dir"):
            path = getattr(self, name)
            if path is not None and not path.strip():
                raise DpaxError(f"`{name}` is empty; give a directory path")
            if path is not None and os.path.exists(path) and not os.path.isdir(path):
                raise DpaxError(f"`{name}={path}` is a file; give a directory path")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise DpaxError("`checkpoint_every` needs `checkpoint_dir`")
        if self.resume == "latest" and self.checkpoint_dir is None:
            raise DpaxError("`resume` without a PATH needs `checkpoint_dir`")
        if self.profile_steps is not None:
            self.profile_range()
            if self.out is None:
                raise DpaxError("`profile_steps` needs `out` for the trace")
        if self.tensorboard and self.out is None:
            raise DpaxError("`tensorboard` needs `out` for the event files")
        check_sharding(self.sharding, self.backend)
        if self.quiet and self.verbose:
            raise DpaxError("give `quiet` or `verbose`, not both")
        if self.overwrite and self.resume is not None:
            raise DpaxError("give `overwrite` or `resume`, not both: a resumed run "
                            "continues the files in `out`")

    def check_length(self, total: int) -> None:
        """Checks that need the run's length in steps (known once the data is):
        refuse a profile window past the end; warn on a warmup that never ends."""
        if self.profile_steps is not None and self.profile_range()[0] > total:
            raise DpaxError(f"`profile_steps={self.profile_steps}` starts after the run's "
                            f"last step {total}; profile steps within 1..{total}")
        if self.warmup_steps >= total:
            warnings.warn(f"the warmup ({self.warmup_steps} steps) is not shorter than the "
                          f"run ({total} steps): the learning rate never reaches {self.lr:g}",
                          DpaxWarning, stacklevel=2)


def field_types(cls) -> dict[str, tuple[type, ...]]:
    """Field -> the Python types it accepts (None aside; an int is a fine float)."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        out[name] = tuple(args) + ((int,) if float in args else ())
    return out


def check_types(config) -> None:
    """Every field holds a value of its annotated type (None only where that is
    the default)."""
    types = field_types(type(config))
    for f in dataclasses.fields(config):
        value, expected = getattr(config, f.name), types[f.name]
        ok = isinstance(value, expected) and not (isinstance(value, bool)
                                                  and bool not in expected)
        if not ok and not (value is None and f.default is None):
            raise DpaxError(f"`{f.name}` must be "
                            f"{' or '.join(t.__name__ for t in expected)}, got {value!r}")


def check_whole(config, name: str, low: int = 1) -> None:
    value = getattr(config, name)
    if value is not None and value < low:
        raise DpaxError(f"`{name}` must be a whole number >= {low}, got {value!r}")


# -- the other commands ----------------------------------------------------------------
@dataclasses.dataclass
class EvalConfig:
    """`dpax eval`: a checkpoint's eval loss and metrics."""

    checkpoint: str = _field(None, "a checkpoint directory (newest step) or one step directory",
                             required=True, metavar="PATH")
    data: str | None = _field(None, "data to evaluate (default: what it trained on)",
                              metavar="NAME")
    devices: int | None = _field(
        None, "devices to use (default: all local; on CPU, 8 simulated)")
    backend: str = _field(DEFAULT_BACKEND, "shard_map or pmap")
    batch_size: int = _field(EVAL_BATCH, "global batch size")

    def validate(self) -> None:
        check_types(self)
        check_whole(self, "devices")
        check_whole(self, "batch_size")
        check_backend(self.backend, 1)


@dataclasses.dataclass
class PredictConfig(EvalConfig):
    """`dpax predict`: a checkpoint's prediction for every row of an .npz."""

    data: str = _field(None, ".npz with an array x of inputs", required=True, metavar="X.npz")
    out: str = _field(None, "where to write the array `predictions`", required=True,
                      metavar="PREDS.npz")


@dataclasses.dataclass
class SampleConfig:
    """`dpax sample`: a language model's continuation of a prompt."""

    checkpoint: str = _field(None, "a checkpoint of dpax train --model gpt (newest step) or "
                             "one step directory", required=True, metavar="PATH")
    prompt: str = _field("def ", "the text to continue")
    tokens: int = _field(200, "bytes to generate")
    temperature: float = _field(0.8, "sampling temperature (0: always the most likely byte)")
    seed: int = _field(0, "seed of the sampling")

    def validate(self) -> None:
        from dpax.models.generate import check

        check_types(self)
        check_whole(self, "seed", 0)
        check(self.prompt.encode(), self.tokens, self.temperature)


@dataclasses.dataclass
class CheckConfig:
    """`dpax check`: train a few steps on 1 and on N devices and compare."""

    model: str = _field("cnn-bn", "a built-in model")
    factory: str | None = _field(
        None, "your model: FN(input_shape, n_out, rngs=nnx.Rngs) -> nnx.Module (or a Linen "
              "module, initialised on one example; its flag `train`, if it takes one)",
        metavar="MODULE:FN")
    loss: str | None = _field(
        None, "your loss: FN(model, batch) -> per-example losses (default: the data's "
              "built-in loss)", metavar="MODULE:FN")
    data: str = _field("digits", "data to train on")
    devices: int = _field(8, "devices to compare with one")
    batch_size: int | None = _field(None, "global batch (default: 5N+3, so a device holds "
                                          "padding)")
    steps: int = _field(5, "SGD steps")
    backend: str = _field(DEFAULT_BACKEND, "shard_map or pmap")
    sync_batchnorm: bool = _field(
        True, "BatchNorm statistics over the global batch (--no-sync-batchnorm shows the "
              "difference per-device statistics make)")

    def validate(self) -> None:
        from dpax import models

        check_types(self)
        for name in ("devices", "steps", "batch_size"):
            check_whole(self, name)
        check_backend(self.backend, 1)
        if self.factory is None and self.model not in models.MODELS:
            raise DpaxError(f"unknown model {self.model!r}; choose one of "
                            f"{', '.join(models.MODELS)} or give `factory=MODULE:FN`")
        from dpax import data

        data.check_name(self.data)
        if self.factory is None and (self.model in models.TEXT_MODELS) != data.is_text(self.data):
            raise DpaxError(f"--model {self.model} does not fit --data {self.data}; "
                            "gpt trains on --data text or text:PATH, the others on the rest")


@dataclasses.dataclass
class BenchConfig:
    """`dpax bench`: dpax against the seeds' pmap loop and a 1-device jit loop."""

    workloads: str = _field("tiny,mlp,cnn,digits,gpt",
                            "comma-separated: tiny, mlp, cnn, digits, gpt")
    optimizer: str = _field("adam", "what every method trains with: sgd, momentum, adam, "
                            "adamw")
    devices: str = _field("1,2,4,8", "device counts, comma-separated", metavar="N,N")
    repeats: int = _field(5, "timed repeats")
    steps: int | None = _field(None, "steps per repeat (default: per workload)")
    steps_per_call: int = _field(8, "K for the dpax/k=K row (1 leaves it out)")
    sweep: bool = _field(True, "also the examples/s vs batch size sweep")
    sharding: str = _field("replicated", "comma-separated state layouts to time on shard_map: "
                           "replicated, optimizer, full (one dpax/<layout> row each)")
    out: str = _field("benchmarks/results", "where results.md, results.json and PNGs go",
                      metavar="DIR")

    def names(self) -> list[str]:
        return [w for w in self.workloads.split(",") if w]

    def layouts(self) -> list[str]:
        return [m for m in self.sharding.split(",") if m]

    def counts(self) -> list[int]:
        try:
            return [int(n) for n in self.devices.split(",")]
        except ValueError:
            raise DpaxError(f"`devices` must be comma-separated counts, got "
                            f"{self.devices!r}") from None

    def validate(self) -> None:
        from dpax.bench import OPTIMIZERS, WORKLOADS

        check_types(self)
        unknown = [w for w in self.names() if w not in WORKLOADS]
        if unknown or not self.names():
            raise DpaxError(f"unknown workload(s) {', '.join(unknown) or '(none)'}; choose "
                            f"from {', '.join(WORKLOADS)}")
        if any(n < 1 for n in self.counts()):
            raise DpaxError(f"`devices` must be counts >= 1, got {self.devices!r}")
        if self.optimizer not in OPTIMIZERS:
            raise DpaxError(f"unknown optimizer {self.optimizer!r}; choose from "
                            f"{', '.join(OPTIMIZERS)}")
        for name in ("repeats", "steps", "steps_per_call"):
            check_whole(self, name)
        from dpax.parallel.layout import check_sharding

        for mode in self.layouts():
            check_sharding(mode, "shard_map")
