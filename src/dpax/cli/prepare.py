"""`dpax prepare`: examples, or the windows of text, to ArrayRecord shards
that `dpax train --data` streams (`dpax.data.prepare`, `dpax.data.text_shards`)."""

from __future__ import annotations

import argparse
import os

from dpax.data import tokenizer
from dpax.data.datasets import DEFAULT_SEQ_LEN, is_text
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
    parser.add_argument("--x-column", default="x", help="column of inputs (default: x)")
    parser.add_argument("--y-column", default="y", help="column of labels (default: y)")
    text = parser.add_argument_group("text")
    text.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                      help=f"tokens per window (default: {DEFAULT_SEQ_LEN})")
    text.add_argument("--tokenizer", default=tokenizer.BYTES,
                      help="bytes (default) or bpe:VOCAB, trained on the training text")
    text.add_argument("--pack", action="store_true",
                      help="pack documents into full windows (dpax train --pack)")
    text.add_argument("--tokenizer-from", metavar="DIR",
                      help="a Hugging Face model directory whose tokenizer.json to use "
                           "(the model's --init-from)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not is_text(args.src):
        meta = prepare(args.src, args.dest, args.x_column, args.y_column,
                       progress=not args.quiet)
        print(f"wrote {meta['examples']} examples in {len(meta['shards'])} shard(s) to "
              f"{args.dest}")
        return 0
    if args.seq_len < 1:
        raise DpaxError(f"`seq_len` must be >= 1, got {args.seq_len}")
    tok = None
    if args.tokenizer_from is not None:
        if not os.path.isdir(args.tokenizer_from):
            raise DpaxError(f"`tokenizer_from={args.tokenizer_from}` is not a directory; give "
                            "a Hugging Face model's directory")
        hf_files.check_tokenizer(args.tokenizer_from, args.tokenizer)
        tok = tokenizer.from_json(args.tokenizer, hf_files.tokenizer_json(args.tokenizer_from))
    meta = prepare_text(args.src.partition(":")[2] or None, args.dest, args.seq_len,
                             args.tokenizer, args.pack, tok, progress=not args.quiet)
    info = meta["text"]
    print(f"wrote {meta['examples']} windows of {info['seq_len']} tokens "
          f"({info['train_examples']} to train on, the rest held out) in "
          f"{len(meta['shards'])} shard(s) to {args.dest}")
    return 0
