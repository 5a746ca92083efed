"""`dpax prepare`: examples, or the windows of text, to ArrayRecord shards
that `dpax train --data` streams (`dpax.data.prepare`, `dpax.data.text_shards`)."""

from __future__ import annotations

import argparse
import os
import sys

from dpax.data import tokenizer
from dpax.data.datasets import DEFAULT_SEQ_LEN, TEXT, is_text
from dpax.data.prepare import prepare, prepare_text
from dpax.errors import DpaxError
from dpax.models import hf_files

NAME = "prepare"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        NAME, help="write examples or text windows as ArrayRecord shards to stream with --data",
        description="Convert an .npz, Parquet file(s) or a saved Hugging Face dataset to "
                    "ArrayRecord shards in DEST (a new directory), read per batch by "
                    "dpax train --data DEST. Text (text or text:PATH) is written as the "
                    "windows --data text:PATH trains on, cut and tokenized once; train on "
                    "them with the same --seq-len, --tokenizer and --pack.")
    parser.add_argument("src", metavar="SRC", help=".npz, Parquet file or directory, a "
                        "datasets.save_to_disk directory, or text / text:PATH")
    parser.add_argument("dest", metavar="DEST", help="new directory for the shards")
    parser.add_argument("--x-column", help="column of inputs (default: x)")
    parser.add_argument("--y-column", help="column of labels (default: y)")
    text = parser.add_argument_group("text")
    text.add_argument("--seq-len", type=int,
                      help=f"tokens per window (default: {DEFAULT_SEQ_LEN})")
    text.add_argument("--tokenizer",
                      help="bytes (default) or bpe:VOCAB, trained on the training text")
    text.add_argument("--pack", action="store_true",
                      help="pack documents into full windows (dpax train --pack)")
    text.add_argument("--tokenizer-from", metavar="DIR",
                      help="a Hugging Face model directory whose tokenizer.json to use "
                           "(the model's --init-from)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


TEXT_FLAGS = ("seq_len", "tokenizer", "pack", "tokenizer_from")


def run(args: argparse.Namespace) -> int:
    raw_text = args.src == TEXT or args.src.startswith(TEXT + ":")
    given = [name for name in ("x_column", "y_column", *TEXT_FLAGS)
             if getattr(args, name) not in (None, False)]
    wrong = [n for n in given if (n in TEXT_FLAGS) != raw_text]
    if wrong:
        what = "text" if raw_text else "examples"
        raise DpaxError(f"--{wrong[0].replace('_', '-')} is not for {what}; drop it")
    if not raw_text:
        if is_text(args.src):
            raise DpaxError(f"{args.src} holds text dpax prepare already wrote; train on it "
                            "with --data")
        meta = prepare(args.src, args.dest, args.x_column or "x", args.y_column or "y",
                       progress=_bar(args))
        print(f"wrote {meta['examples']} examples in {len(meta['shards'])} shard(s) to "
              f"{args.dest}")
        return 0
    seq_len = DEFAULT_SEQ_LEN if args.seq_len is None else args.seq_len
    spec = args.tokenizer or tokenizer.BYTES
    if seq_len < 1:
        raise DpaxError(f"--seq-len must be >= 1, got {seq_len}")
    tok = None
    if args.tokenizer_from is not None:
        if not os.path.isdir(args.tokenizer_from):
            raise DpaxError(f"--tokenizer-from {args.tokenizer_from} is not a directory; give "
                            "a Hugging Face model's directory")
        hf_files.check_tokenizer(args.tokenizer_from, spec)
        tok = tokenizer.from_json(spec, hf_files.tokenizer_json(args.tokenizer_from))
    meta = prepare_text(args.src.partition(":")[2] or None, args.dest, seq_len, spec,
                        args.pack, tok, progress=_bar(args))
    info = meta["text"]
    held = meta["examples"] - info["train_examples"]
    split = (f"{info['train_examples']} to train on, {held} held out" if held else
             "all to train on: too few documents to hold any out, so they are evaluated on")
    print(f"wrote {meta['examples']} windows of {info['seq_len']} tokens ({split}) in "
          f"{len(meta['shards'])} shard(s) to {args.dest}")
    return 0


def _bar(args: argparse.Namespace) -> bool:
    """A progress bar on a terminal only: redrawn with carriage returns, it
    fills a log or a pipe with one line per update (the final line says it all)."""
    return not args.quiet and sys.stderr.isatty()
