"""`dpax sample`: a continuation of a prompt from a language-model
checkpoint, with the EMA params when the run kept them."""

from __future__ import annotations

import argparse
import dataclasses

from dpax import config as cfg
from dpax.cli import devices
from dpax.cli.flags import add_flags, config_from_args
from dpax.cli.job import load_checkpoint
from dpax.errors import DpaxError
from dpax.models.generate import check, generate

NAME = "sample"


@dataclasses.dataclass
class SampleConfig:
    """`dpax sample`: a language model's continuation of a prompt."""

    checkpoint: str = cfg.field(None, "a checkpoint of dpax train --model gpt or llama "
                                "(newest step) or one step directory", required=True,
                                metavar="PATH")
    prompt: str = cfg.field("def ", "the text to continue")
    tokens: int = cfg.field(200, "tokens to generate (bytes, with byte tokens)")
    temperature: float = cfg.field(0.8, "sampling temperature (0: always the most likely "
                                   "byte)")
    top_k: int | None = cfg.field(None, "draw among the K most likely tokens only")
    top_p: float | None = cfg.field(None, "draw among the most likely tokens whose "
                                    "probabilities add up to P (nucleus sampling)",
                                    metavar="P")
    cache: bool = cfg.field(True, "compute each token from the model's key/value cache "
                            "(--no-cache: from the whole window again; the same tokens)")
    seed: int = cfg.field(0, "seed of the sampling")

    def check(self) -> None:
        cfg.whole(self, "seed", 0)
        check(self.prompt.encode(), self.tokens, self.temperature, self.top_k, self.top_p)


def add_parser(sub) -> None:
    add_flags(sub.add_parser(
        NAME, help="continue a prompt with a trained language model",
        description="Print a language model's continuation of --prompt (dpax train "
                    "--model gpt --data text makes one)."), SampleConfig)


def run(args: argparse.Namespace) -> int:
    config = cfg.validate(config_from_args(args, SampleConfig))
    devices.start(1)
    text = sample_checkpoint(config.checkpoint, config.prompt, config.tokens,
                             config.temperature, config.seed, config.top_k, config.top_p,
                             config.cache)
    print(config.prompt + text)
    return 0


def sample_checkpoint(path: str, prompt: str, tokens: int = 200, temperature: float = 0.8,
                      seed: int = 0, top_k: int | None = None, top_p: float | None = None,
                      cache: bool = True) -> str:
    """A continuation of `prompt` from a language-model checkpoint (`dpax train
    --model gpt`), as text (bytes that are not UTF-8 shown as U+FFFD);
    `dpax.models.generate.generate` draws it."""
    check(prompt.encode(), tokens, temperature, top_k, top_p)
    loaded = load_checkpoint(path, devices=1)
    if loaded.meta["task"] != "lm":
        raise DpaxError(f"{path} holds a {loaded.meta['task']} model; dpax sample needs a "
                        "language model (dpax train --model gpt --data text)")
    seq_len = loaded.meta["input_shape"][0] - 1
    tok = loaded.tokenizer
    out = generate(loaded.trainer.model(), tok.encode(prompt.encode()), tokens, seq_len,
                   temperature, seed, top_k, top_p, cache)
    return tok.decode(out).decode("utf-8", errors="replace")
