"""A training job: its config (`TrainConfig`, the tree the modules own), and
what the commands build from one: the data, the model, the optimizer and the
Trainer; and a Trainer holding a checkpoint's state."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings

import jax

from dpax import config as cfg
from dpax.cli.outputs import OutputConfig
from dpax.data import augment, resident, tokenizer
from dpax.data.datasets import TEXT, DataConfig, Dataset
from dpax.data.pipeline import BatchPlan, check_length, train_input
from dpax.data.tokenizer import Tokenizer
from dpax.errors import DpaxError, DpaxWarning
from dpax.models import hf_files, losses
from dpax.models.registry import TEXT_MODELS, ModelConfig
from dpax.parallel import compile_cache
from dpax.parallel.backends import DEFAULT_BACKEND, check_backend
from dpax.parallel.distributed import DistributedConfig
from dpax.parallel.layout import layout_class
from dpax.training.checkpoint import CheckpointConfig, Checkpointer, locate
from dpax.training.optim import BY_LENGTH, OptimizerConfig
from dpax.training.state import host_device
from dpax.training.trainer import Trainer, TrainerConfig

# The main job's length when neither --epochs nor --steps is given.
DEFAULT_EPOCHS = 15


@dataclasses.dataclass
class TrainConfig:
    """One training run. The default is the main job: the digits CNN on 8 devices.

    The command line is flat (`--lr`, `--devices`); the groups nest in YAML
    (`optimizer: {lr: ...}`). `TrainConfig.from_flags(lr=0.1, devices=4)`
    builds one by flag names from Python.
    """

    batch_size: int = cfg.field(128, "GLOBAL batch size, split over the devices")
    epochs: int | None = cfg.field(
        None, f"passes over the training data (default {DEFAULT_EPOCHS} unless --steps is "
        "given)", how=True)  # how long, not what: a finished run can be extended
    steps: int | None = cfg.field(None, "training steps (instead of --epochs)", how=True)
    seed: int = cfg.field(0, "seed of the init, the batch order and the dropout masks")
    log_every: int = cfg.field(10, "steps between metric logs (host syncs happen only here)",
                               how=True)
    eval_every: int = cfg.field(0, "steps between evaluations (0: only at the end)", how=True)
    model: ModelConfig = cfg.group(ModelConfig)
    data: DataConfig = cfg.group(DataConfig)
    optimizer: OptimizerConfig = cfg.group(OptimizerConfig)
    trainer: TrainerConfig = cfg.group(TrainerConfig)
    checkpoint: CheckpointConfig = cfg.group(CheckpointConfig)
    output: OutputConfig = cfg.group(OutputConfig)
    distributed: DistributedConfig = cfg.group(DistributedConfig)

    @classmethod
    def from_flags(cls, **flags) -> TrainConfig:
        """The default config with fields set by their flag names, e.g.
        `TrainConfig.from_flags(model="mlp", lr=0.1, devices=4)`."""
        return cfg.with_flags(cls(), **flags)

    def check(self) -> None:
        """The rules that span groups (each group checks its own fields)."""
        for name in ("batch_size", "log_every"):
            cfg.whole(self, name)
        cfg.whole(self, "seed", low=0)
        cfg.whole(self, "eval_every", low=0)
        check_length(self.steps, self.epochs)
        if self.data.is_text != self.model.takes_text:
            text = " or ".join(TEXT_MODELS)
            raise DpaxError(f"--model {self.model.name} does not fit --data {self.data.name}: "
                            f"text data (text, text:PATH or the text shards of dpax prepare) "
                            f"needs --model {text}, and {text} needs text data")
        check_backend(self.trainer.backend, self.distributed.processes)
        if self.model.init_from is not None and self.data.is_text:
            hf_files.check_tokenizer(self.model.init_from, self.data.tokenizer)
        if self.output.overwrite and self.checkpoint.resume is not None:
            raise DpaxError("give `overwrite` or `resume`, not both: a resumed run "
                            "continues the files in `out`")

    def check_length(self, total: int) -> None:
        """Checks that need the run's length in steps (known once the data is):
        refuse a profile window past the end; warn on a warmup that never ends."""
        if self.output.profile_steps is not None and self.output.profile_range()[0] > total:
            raise DpaxError(f"`profile_steps={self.output.profile_steps}` starts after the "
                            f"run's last step {total}; profile steps within 1..{total}")
        if self.optimizer.warmup_steps >= total:
            lr = self.optimizer.resolved_lr(self.model.lr)
            warnings.warn(f"the warmup ({self.optimizer.warmup_steps} steps) is not shorter "
                          f"than the run ({total} steps): the learning rate never reaches "
                          f"{lr:g}", DpaxWarning, stacklevel=2)

    def to_yaml(self) -> str:
        """The resolved config; `dpax train --config FILE` runs it again."""
        rerun = dataclasses.replace(
            self, checkpoint=dataclasses.replace(self.checkpoint, resume=None))
        return cfg.to_yaml(rerun)


@dataclasses.dataclass
class Job:
    """Everything a config builds before training starts."""

    config: TrainConfig
    ds: Dataset
    plan: BatchPlan
    total: int
    trainer: Trainer

    def meta(self) -> dict:
        """What a checkpoint needs besides the state: the resolved config, and
        the shapes to rebuild the model without the training data."""
        tok = self.ds.tokenizer
        return {"config": cfg.to_dict(self.config), "task": self.ds.task,
                "input_shape": list(self.ds.input_shape), "n_out": self.ds.n_out,
                "total": self.total, "tokenizer": None if tok is None else tok.to_json()}

    @functools.cached_property
    def on_device(self) -> bool:
        """Whether the training arrays stay on the devices (`dpax.data.resident`):
        then `input` makes batches of their indices."""
        data, t = self.config.data, self.trainer
        return resident.choose(data.on_device, {"x": self.ds.x_train, "y": self.ds.y_train},
                               t.backend.devices, t.platform.name, jax.process_count(),
                               batches_given=False, augment=data.augment is not None,
                               workers=data.workers)

    def input(self, start: int):
        """This process's training batches of steps `start..total-1`."""
        rows = self.trainer.backend.local_rows(self.trainer.padded(self.config.batch_size))
        return train_input({"x": self.ds.x_train, "y": self.ds.y_train}, self.plan, rows,
                           start, self.total, augment.parse(self.config.data.augment),
                           self.config.data.workers, indices=self.on_device)


def build(config: TrainConfig) -> Job:
    """Data, model, optimizer and Trainer for a validated config."""
    # A pretrained model's own tokenizer, if its directory has one; else the data's.
    saved = config.model.init_from and hf_files.tokenizer_json(config.model.init_from)
    ds = config.data.load(tokenizer.from_json(config.data.tokenizer, saved) if saved else None)
    plan = BatchPlan(len(ds.x_train), config.batch_size, config.seed)
    total = plan.total_steps(config.steps, config.epochs, DEFAULT_EPOCHS)
    trainer = make_trainer(config, ds.task, ds.input_shape, ds.n_out, total, ds.tokenizer)
    return Job(config, ds, plan, total, trainer)


def make_trainer(config: TrainConfig, task: str, input_shape: tuple[int, ...], n_out: int,
                 total: int, tok: Tokenizer | None = None) -> Trainer:
    """The config's model (for examples of `input_shape`), optimizer and Trainer
    (`tok`: text's tokenizer, whose bytes per token a BPE's loss reports)."""
    tx, schedule = config.optimizer.build(config.batch_size, total, config.model.lr)
    bpe = tok is not None and tok.hf is not None
    loss_fn, predict_fn = losses.for_task(task, tok.token_bytes if bpe else None)
    # Split layouts exist for states that do not fit one device: their model
    # is built in host memory, not whole on the first device.
    where = (jax.default_device(host_device())
             if not layout_class(config.trainer.sharding).whole_state
             else contextlib.nullcontext())
    with where:
        model = config.model.build(input_shape, n_out, config.seed, task)
    return Trainer(model, loss_fn, tx, predict_fn=predict_fn, schedule=schedule,
                   seed=config.seed, **dataclasses.asdict(config.trainer))


def check_same_meaning(saved: dict, config: TrainConfig) -> None:
    """Refuse a resume that changes what is trained; say what a longer or
    shorter run changes of the schedule."""
    old = cfg.from_dict(TrainConfig, saved)
    was, now = cfg.what_is_trained(old), cfg.what_is_trained(config)

    def shown(v):  # None: the option was left to its default
        return "not given" if v is None else repr(v)

    for key, value in now.items():
        if was.get(key) != value:
            same = "without" if was.get(key) is None else "with the same"
            raise DpaxError(f"cannot resume: `{key}` was {shown(was.get(key))} in the "
                            f"checkpoint, now {shown(value)}; resume {same} `{key}` or "
                            "start a new run")
    if (old.steps, old.epochs) != (config.steps, config.epochs) and (
            config.optimizer.schedule in BY_LENGTH):
        warnings.warn(f"the run's length changed: the {config.optimizer.schedule} schedule "
                      "follows the new length from here", DpaxWarning, stacklevel=2)


@dataclasses.dataclass
class Loaded:
    """A Trainer holding a checkpoint's state, and what the checkpoint says."""

    trainer: Trainer
    config: TrainConfig  # the run's config, with this process's devices and backend
    meta: dict  # task, input_shape, n_out, total
    tokenizer: Tokenizer | None = None  # a language model's


def load_checkpoint(path: str, devices: int | None = None,
                    backend: str = DEFAULT_BACKEND) -> Loaded:
    """A Trainer holding a checkpoint's state, on any device count. The model is
    built from the checkpoint's own shapes: no data is read.

    `path` is a checkpoint directory (its newest intact step is read, newer
    damaged ones named in one warning line) or one step directory (a
    `DpaxError` if it is damaged)."""
    directory, step = locate(path)
    ckpt = Checkpointer(directory)
    step, meta = ckpt.newest_meta(step)
    try:
        saved = cfg.from_dict(TrainConfig, meta["config"])
    except (DpaxError, KeyError, TypeError) as e:
        raise DpaxError(f"checkpoint step {step} in {directory} was written by another "
                        f"version of dpax ({e})") from None
    # The run's sharding where the backend allows it: a model that needed
    # sharding to train needs it to evaluate, split over every device here
    # (the run's groups need not divide this device count).
    sharding = saved.trainer.sharding if backend == "shard_map" else "replicated"
    # The checkpoint holds the weights: the directory a run started from
    # (`init_from`) is not read again, and need not exist any more. Nor need
    # the run's compilation cache: this machine's default serves.
    config = dataclasses.replace(
        saved, trainer=dataclasses.replace(saved.trainer, devices=devices, backend=backend,
                                           sharding=sharding, replicas=1,
                                           compile_cache=compile_cache.DEFAULT),
        model=dataclasses.replace(saved.model, init_from=None),
        checkpoint=type(saved.checkpoint)(), output=type(saved.output)(),
        distributed=type(saved.distributed)())
    # Nor need its data: `sample` and `export` read none, and `eval` checks
    # what it reads. A language model's data is validated as text, whatever
    # files (shards of prepared text) it named.
    cfg.validate(config if meta["task"] != "lm" else dataclasses.replace(
        config, data=dataclasses.replace(config.data, name=TEXT)))
    tok = (tokenizer.from_json(config.data.tokenizer, meta.get("tokenizer"))
           if meta["task"] == "lm" else None)
    trainer = make_trainer(config, meta["task"], tuple(meta["input_shape"]), meta["n_out"],
                           meta.get("total", 1), tok)
    trainer.restore(ckpt, step=step)
    ckpt.close()
    return Loaded(trainer, config, meta, tok)
