"""`dpax prepare`: examples to ArrayRecord shards that `dpax train --data`
streams (`dpax.data.prepare`)."""

from __future__ import annotations

import argparse

from dpax.data.prepare import prepare

NAME = "prepare"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        NAME, help="write examples as ArrayRecord shards to stream with --data",
        description="Convert an .npz, Parquet file(s) or a saved Hugging Face dataset to "
                    "ArrayRecord shards in DEST (a new directory), read per batch by "
                    "dpax train --data DEST.")
    parser.add_argument("src", metavar="SRC", help=".npz, Parquet file or directory, or a "
                        "datasets.save_to_disk directory")
    parser.add_argument("dest", metavar="DEST", help="new directory for the shards")
    parser.add_argument("--x-column", default="x", help="column of inputs (default: x)")
    parser.add_argument("--y-column", default="y", help="column of labels (default: y)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    meta = prepare(args.src, args.dest, args.x_column, args.y_column, progress=not args.quiet)
    print(f"wrote {meta['examples']} examples in {len(meta['shards'])} shard(s) to {args.dest}")
    return 0
