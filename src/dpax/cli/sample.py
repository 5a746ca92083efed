"""`dpax sample`: a continuation of a prompt from a language-model
checkpoint, with the EMA params when the run kept them."""

from __future__ import annotations

from dpax.cli.run import load_checkpoint
from dpax.errors import DpaxError
from dpax.models.generate import check, generate


def sample_checkpoint(path: str, prompt: str, tokens: int = 200, temperature: float = 0.8,
                      seed: int = 0) -> str:
    """A continuation of `prompt` from a language-model checkpoint (`dpax train
    --model gpt`), as text (bytes that are not UTF-8 shown as U+FFFD)."""
    check(prompt.encode(), tokens, temperature)
    loaded = load_checkpoint(path, devices=1)
    if loaded.meta["task"] != "lm":
        raise DpaxError(f"{path} holds a {loaded.meta['task']} model; dpax sample needs a "
                        "language model (dpax train --model gpt --data text)")
    seq_len = loaded.meta["input_shape"][0] - 1
    out = generate(loaded.trainer.model(), prompt.encode(), tokens, seq_len, temperature, seed)
    return out.decode("utf-8", errors="replace")
