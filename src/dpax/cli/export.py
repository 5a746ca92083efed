"""`dpax export`: a language-model checkpoint as a Hugging Face directory,
which `transformers` loads (`GPT2LMHeadModel` for gpt: `dpax.models.hf_gpt2`;
`LlamaForCausalLM` for llama: `dpax.models.hf_llama`), with its BPE
tokenizer's files when it has one (`AutoTokenizer` loads them)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil

from dpax import config as cfg
from dpax.cli import devices, outputs
from dpax.cli.flags import add_flags, config_from_args
from dpax.cli.job import load_checkpoint
from dpax.data import tokenizer
from dpax.errors import DpaxError
from dpax.models import hf_files, hf_gpt2
from dpax.models.registry import HF

NAME = "export"
# What `dpax export --out DIR` writes; a directory holding any of them holds a
# model, which `overwrite` replaces, keeping every other file (as `dpax train
# --overwrite` keeps what is not a run's). A tokenizer left by an earlier
# export is removed with it: it would tokenize for a model that has none.
# (A shard index may stay: readers take model.safetensors before it.)
FILES = (hf_files.WEIGHTS, *tokenizer.HF_FILES, hf_files.CONFIG)


@dataclasses.dataclass
class ExportConfig:
    """`dpax export`: a language-model checkpoint in Hugging Face's layout."""

    checkpoint: str = cfg.field(None, "a checkpoint of dpax train --model gpt or llama "
                                "(newest step) "
                                "or one step directory", required=True, metavar="PATH")
    out: str = cfg.field(None, "the directory to write (config.json, model.safetensors)",
                         required=True, metavar="DIR")
    ema: bool | None = cfg.field(None, "export the EMA params (default: when the run kept "
                                 "them)")
    overwrite: bool = cfg.field(False, "replace the model --out holds, keeping its other "
                                "files (default: refuse)")

    def check(self) -> None:
        if os.path.isfile(self.out):
            raise DpaxError(f"`out={self.out}` is a file; give a directory")
        held = held_files(self.out)
        if held and not self.overwrite:
            raise DpaxError(f"`out={self.out}` already holds a model ({', '.join(held)}); give "
                            "`overwrite` to replace it (its other files stay), or another "
                            "directory")
        # The export is written next to `out` first (`export_checkpoint`).
        outputs.probe(outputs.existing_parent(self.out, "out"), f"`out={self.out}`")
        if os.path.isdir(self.out):
            outputs.probe(self.out, f"`out={self.out}`")


def add_parser(sub) -> None:
    add_flags(sub.add_parser(
        NAME, help="write a GPT or Llama checkpoint as a Hugging Face directory",
        description="Write a checkpoint of dpax train --model gpt (or llama) as config.json "
                    "+ model.safetensors, which transformers' GPT2LMHeadModel (or "
                    "LlamaForCausalLM).from_pretrained loads; dpax train --init-from DIR "
                    "starts from such a directory."),
        ExportConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, ExportConfig))
    devices.start(1)
    export_checkpoint(config.checkpoint, config.out, config.ema)
    print(f"wrote a Hugging Face model to {config.out}")
    return 0


def held_files(out: str) -> list[str]:
    """Those of export's `FILES` that the directory `out` holds."""
    return [name for name in FILES if os.path.exists(os.path.join(out, name))]


def export_checkpoint(path: str, out: str, ema: bool | None = None) -> None:
    """Write the language model of checkpoint `path` to the directory `out`
    in Hugging Face's layout (GPT-2's or Llama's). It is written next to `out` first: a new `out`
    appears complete or not at all; into an existing one, the files move one
    by one, replacing an earlier export's (`FILES`) and keeping all others."""
    loaded = load_checkpoint(path, devices=1)
    if loaded.meta["task"] != "lm":
        raise DpaxError(f"{path} holds a {loaded.meta['task']} model; dpax export writes "
                        "language-model checkpoints (dpax train --model gpt or llama)")
    model = loaded.trainer.model(ema)
    partial = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    if loaded.config.model.name == "gpt":
        hf_gpt2.save(model, partial, loaded.config.model.dropout)
    else:
        HF[loaded.config.model.name].save(model, partial)
    for name, text in tokenizer.hf_files(loaded.tokenizer).items():  # a BPE's, if any
        with open(os.path.join(partial, name), "w") as f:
            f.write(text)
    move_in(partial, out)


def move_in(partial: str, out: str) -> None:
    """Make the export written to `partial` the one in `out`. Of an earlier
    export, only the files this one lacks are removed; config.json comes
    last, so that one that names the new model finds its weights in place."""
    if not os.path.isdir(out):
        os.replace(partial, out)
        return
    written = set(os.listdir(partial))
    for name in held_files(out):
        if name not in written:
            os.remove(os.path.join(out, name))
    for name in FILES:
        if name in written:
            os.replace(os.path.join(partial, name), os.path.join(out, name))
    os.rmdir(partial)
