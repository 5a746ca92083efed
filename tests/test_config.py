"""Config trees (`dpax.config`): flags derived from the tree, YAML that nests
and round-trips, one-line errors that name the field, each rule checked once
where it lives, and the resume check derived from the fields' kind."""

import dataclasses
import re

import pytest

import dpax
from dpax import config as cfg
from dpax.cli.command import build_parser
from dpax.cli.flags import config_from_args
from dpax.cli.job import TrainConfig
from dpax.errors import DpaxError


def test_every_flag_is_unique_and_reaches_its_field():
    by_flag = cfg.flags(TrainConfig)
    assert {"lr", "devices", "model", "data", "checkpoint_dir", "data_workers"} <= set(by_flag)
    assert by_flag["lr"].path == ("optimizer", "lr")
    assert by_flag["checkpoint_dir"].path == ("checkpoint", "dir")
    args = build_parser().parse_args(["train", "--lr", "0.1", "--devices", "4", "--model",
                                      "gpt", "--data", "text", "--no-sync-batchnorm"])
    c = config_from_args(args, TrainConfig)
    assert (c.optimizer.lr, c.trainer.devices, c.model.name, c.data.name) == (0.1, 4, "gpt",
                                                                              "text")
    assert c.trainer.sync_batchnorm is False and c.batch_size == 128  # the rest: defaults


def test_a_tree_whose_flags_collide_is_refused():
    @dataclasses.dataclass
    class A:
        lr: float = cfg.field(0.1, "a")

    @dataclasses.dataclass
    class B:
        x: float = cfg.field(0.1, "b", flag="lr")
        a: A = cfg.group(A)

    with pytest.raises(TypeError, match="flag 'lr' of a.lr is also x's"):
        cfg.flags(B)


def test_yaml_nests_by_group_and_round_trips(tmp_path):
    c = TrainConfig.from_flags(model="mlp", lr=0.05, devices=2, steps=7, augment=None)
    text = c.to_yaml()
    assert "optimizer:\n  name: adam\n  lr: 0.05" in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["train", "--config", str(path), "--steps", "9"])
    again = config_from_args(args, TrainConfig)
    assert again == dataclasses.replace(c, steps=9)  # the flag given wins over the file


@pytest.mark.parametrize("text,message", [
    ("optimizer:\n  lrr: 0.1\n", "unknown field(s) lrr in `optimizer:`"),
    ("lr: 0.1\n", "unknown field(s) lr;"),  # flat names belong on the command line
    ("model: cnn\n", "model must be a mapping"),
])
def test_a_config_file_with_a_misplaced_field_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["train", "--config", str(path)])
    with pytest.raises(DpaxError, match=re.escape(message)):
        config_from_args(args, TrainConfig)


@pytest.mark.parametrize("flags,message", [
    ({"lr": -1.0}, "`lr` must be a finite number > 0"),
    ({"ema_decay": 1.0}, "`ema_decay` must be a finite number > 0 and < 1"),
    ({"steps_per_call": 0}, "`steps_per_call` must be a whole number >= 1"),
    ({"width": 130, "model": "gpt", "data": "text"}, "multiple of `heads`"),
    ({"steps": 3, "epochs": 2}, "exactly one of `steps` or `epochs`"),
    ({"data_workers": -1}, "`data_workers` must be a whole number >= 0"),
    ({"model": "gpt"}, "does not fit --data digits"),
    ({"backend": "pmap", "num_processes": 2, "process_id": 0, "coordinator": "h:1"},
     "single-process"),
    ({"devices": "4"}, "`devices` must be int"),
])
def test_each_rule_is_a_one_line_error_naming_the_flag(flags, message):
    with pytest.raises(DpaxError, match=message):
        cfg.validate(TrainConfig.from_flags(**flags))


def test_the_trainer_and_the_config_share_their_rules():
    """`Trainer(ema_decay=1.0)` fails with the very message the CLI gives:
    the rule lives once, in TrainerConfig."""
    with pytest.raises(DpaxError) as from_config:
        cfg.validate(TrainConfig.from_flags(ema_decay=1.0))
    with pytest.raises(DpaxError) as from_trainer:
        dpax.Trainer(dpax.make_model("mlp", (4,), 2, 0), dpax.classification_loss,
                     dpax.make_optimizer("sgd", dpax.make_schedule(0.1)), devices=1,
                     ema_decay=1.0)
    assert str(from_config.value) == str(from_trainer.value)


def test_what_is_trained_holds_the_fields_a_resume_may_not_change():
    trained = cfg.what_is_trained(TrainConfig())
    assert {"model", "lr", "batch_size", "seed", "precision", "data"} <= set(trained)
    assert not {"devices", "backend", "steps", "log_every", "out", "xla_cpu_tuning",
                "checkpoint_dir"} & set(trained)


def test_from_flags_refuses_an_unknown_name():
    with pytest.raises(DpaxError, match="unknown field"):
        TrainConfig.from_flags(learning_rate=0.1)


@pytest.mark.parametrize("flags, lr", [
    ({"model": "mlp"}, 3e-3),
    ({"model": "deep-mlp"}, 1e-4),  # 3e-3 diverges on its 4096-wide layers (loss 96)
    ({"model": "deep-mlp", "lr": 0.01}, 0.01),
    ({"model": "mlp", "lr": 0.01, "scale_lr": True, "batch_size": 256}, 0.02),
])
def test_the_learning_rate_is_the_flag_else_the_models_else_the_default(flags, lr):
    c = cfg.validate(TrainConfig.from_flags(**flags))
    _, schedule = c.optimizer.build(c.batch_size, 10, c.model.lr)
    assert float(schedule(0)) == pytest.approx(lr)
