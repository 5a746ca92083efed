"""The typed run configuration: the single source of defaults and help texts.

The CLI is derived from these fields, so a default lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

from dpax.distributed import DEFAULT_TIMEOUT_S

# Fields that change how a run executes, not what it computes (beyond float
# rounding): a checkpoint may be resumed with different values of these.
HOW_FIELDS = frozenset({
    "devices", "backend", "log_every", "eval_every", "out", "checkpoint_dir",
    "checkpoint_every", "keep", "resume", "coordinator", "num_processes", "process_id",
    "timeout", "max_bad_steps", "grad_accum", "tensorboard", "profile_steps", "quiet",
    "verbose", "steps_per_call", "shard_optimizer_state", "overwrite",
    # How long to train, not what: a finished run can be extended.
    "steps", "epochs",
})

F32_MAX = 3.4028234663852886e38  # the largest finite float32

# The main job's length when neither --epochs nor --steps is given.
DEFAULT_EPOCHS = 15


def _field(default, help: str, **meta):
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass
class TrainConfig:
    """One training run. The default is the main job: the digits CNN on 8 devices."""

    model: str = _field("cnn", "model: linear, mlp, cnn or cnn-bn (BatchNorm + dropout)")
    data: str = _field("digits", "data: regression, digits, random-images, or a path to a .npz")
    devices: int | None = _field(
        None, "devices per process (default: all local accelerators; on CPU, 8 simulated)"
    )
    backend: str = _field("shard_map", "shard_map (jit + shard_map) or pmap")
    batch_size: int = _field(128, "GLOBAL batch size, split over the devices")
    epochs: int | None = _field(
        None, f"passes over the training data (default {DEFAULT_EPOCHS} unless --steps is given)"
    )
    steps: int | None = _field(None, "training steps (instead of --epochs)")
    optimizer: str = _field("adam", "sgd, momentum, adam or adamw")
    lr: float = _field(3e-3, "peak learning rate")
    schedule: str = _field("constant", "constant or warmup-cosine")
    warmup_steps: int = _field(0, "linear warmup steps")
    scale_lr: bool = _field(False, "scale lr by batch-size / reference-batch (linear rule)")
    reference_batch: int = _field(128, "batch size the lr was tuned for (with --scale-lr)")
    momentum: float = _field(0.9, "momentum of the momentum optimizer")
    weight_decay: float = _field(1e-4, "weight decay of adamw")
    grad_accum: int = _field(1, "micro-batches per device, accumulated in the step")
    precision: str = _field("fp32", "fp32, or bf16 compute on fp32 master params")
    allreduce_dtype: str = _field("fp32", "dtype of the gradient all-reduce: fp32 or bf16")
    clip_norm: float | None = _field(None, "clip the reduced gradient to this global norm")
    max_bad_steps: int = _field(
        10, "stop (exit 3) after this many non-finite steps in a row, checked at log steps"
    )
    sync_batchnorm: bool = _field(
        True, "BatchNorm statistics over the global batch (--no-sync-batchnorm: per "
              "device, not equivalent to one device)")
    shard_optimizer_state: bool = _field(
        False, "ZeRO-1: each device keeps 1/N of the optimizer state (shard_map backend)")
    steps_per_call: int = _field(
        1, "training steps per compiled call (a scan over batches on the device)")
    seed: int = _field(0, "seed of the init and of the batch order")
    log_every: int = _field(10, "steps between metric logs (host syncs happen only here)")
    eval_every: int = _field(0, "steps between evaluations (0: only at the end)")
    out: str | None = _field(None, "run directory for metrics.jsonl and params.npz")
    overwrite: bool = _field(False, "replace the run already in --out (default: refuse)")
    checkpoint_dir: str | None = _field(None, "directory for Orbax checkpoints")
    checkpoint_every: int = _field(0, "steps between checkpoints (0: only at the end)")
    keep: int = _field(3, "checkpoints to keep")
    resume: str | None = _field(
        None, "resume from the newest checkpoint in --checkpoint-dir, or from PATH",
        nargs="?", const="latest")
    tensorboard: bool = _field(False, "also write TensorBoard event files to --out/tensorboard")
    profile_steps: str | None = _field(
        None, "A:B: a JAX profiler trace of steps A..B into --out/profile (Perfetto/TensorBoard)")
    quiet: bool = _field(False, "no progress output, only the summary line and errors")
    verbose: bool = _field(False, "plain progress lines even on a terminal, plus run details")
    coordinator: str | None = _field(
        None, "HOST:PORT of process 0, for multi-process runs (or use dpax launch)"
    )
    num_processes: int | None = _field(None, "processes in a multi-process run")
    process_id: int | None = _field(None, "this process's rank, 0..num-processes-1")
    timeout: int = _field(
        DEFAULT_TIMEOUT_S, "seconds before an unreachable coordinator or a dead rank stops the run"
    )

    def profile_range(self) -> tuple[int, int]:
        """First and last step (1-based, inclusive) of --profile-steps A:B."""
        from dpax.errors import DpaxError

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

        from dpax.errors import DpaxError

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
        if unknown:
            raise DpaxError(f"--config {path}: unknown field(s) {', '.join(unknown)}; "
                            "see dpax train --help")
        return loaded

    def meaning(self) -> dict:
        """The fields that define what is trained; a resume may change only the others."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in HOW_FIELDS}

    def total_steps(self, steps_per_epoch: int) -> int:
        """Steps of this run: --steps, else --epochs (default DEFAULT_EPOCHS) passes."""
        if self.steps is not None:
            return self.steps
        return (self.epochs or DEFAULT_EPOCHS) * steps_per_epoch

    def validate(self) -> None:
        """Raise `DpaxError` for a value no run can use, before anything is written."""
        from dpax import backends, data, models, optim
        from dpax.devices import MAX_SIMULATED_DEVICES
        from dpax.errors import DpaxError

        for f in dataclasses.fields(self):
            value, expected = getattr(self, f.name), _TYPES[f.name]
            ok = isinstance(value, expected) and not (isinstance(value, bool)
                                                      and bool not in expected)
            if not ok and not (value is None and f.default is None):
                raise DpaxError(f"`{f.name}` must be "
                                f"{' or '.join(t.__name__ for t in expected)}, got {value!r}")

        def whole(name, low=1):
            value = getattr(self, name)
            if value is not None and value < low:
                raise DpaxError(f"`{name}` must be a whole number >= {low}, got {value!r}")

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
        for name in ("seed", "warmup_steps", "eval_every", "checkpoint_every"):
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
            if getattr(self, name) not in ("fp32", "bf16"):
                raise DpaxError(f"`{name}` must be fp32 or bf16, got {getattr(self, name)!r}")
        for name, value, choices in (("model", self.model, models.MODELS),
                                     ("optimizer", self.optimizer, optim.OPTIMIZERS),
                                     ("schedule", self.schedule, optim.SCHEDULES),
                                     ("backend", self.backend, backends.BACKENDS)):
            if value not in choices:
                raise DpaxError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
        if not self.data.endswith(".npz") and self.data not in data.DATASETS:
            raise DpaxError(f"unknown data {self.data!r}; choose one of "
                            f"{', '.join(data.DATASETS)} or a path to a .npz")
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
        if self.shard_optimizer_state and (self.backend != "shard_map"
                                           or self.steps_per_call != 1
                                           or self.clip_norm is not None):
            raise DpaxError("`shard_optimizer_state` needs `backend=shard_map`, "
                            "`steps_per_call=1` and no `clip_norm` (a slice has no global norm)")
        if self.quiet and self.verbose:
            raise DpaxError("give `quiet` or `verbose`, not both")
        if self.backend == "pmap" and (self.num_processes or 1) > 1:
            raise DpaxError("the pmap backend is single-process only in dpax; "
                            "use `backend=shard_map` for several processes")
        if self.overwrite and self.resume is not None:
            raise DpaxError("give `overwrite` or `resume`, not both: a resumed run "
                            "continues the files in `out`")

    def check_length(self, total: int) -> None:
        """Checks that need the run's length in steps (known once the data is):
        refuse a profile window past the end; warn on a warmup that never ends."""
        from dpax.errors import DpaxError, DpaxWarning

        if self.profile_steps is not None and self.profile_range()[0] > total:
            raise DpaxError(f"`profile_steps={self.profile_steps}` starts after the run's "
                            f"last step {total}; profile steps within 1..{total}")
        if self.warmup_steps >= total:
            warnings.warn(f"the warmup ({self.warmup_steps} steps) is not shorter than the "
                          f"run ({total} steps): the learning rate never reaches {self.lr:g}",
                          DpaxWarning, stacklevel=2)


def _types() -> dict[str, tuple[type, ...]]:
    import typing

    out = {}
    for name, tp in typing.get_type_hints(TrainConfig).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        out[name] = tuple(args) + ((int,) if float in args else ())
    return out


_TYPES = _types()  # field -> accepted Python types (an int is a fine float)
