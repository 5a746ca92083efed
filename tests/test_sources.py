"""Examples streamed from disk (ArrayRecord, Parquet, saved Hugging Face
datasets) train exactly as the same examples in memory; `dpax prepare`
converts; bad files are one line and exit 2."""

import json
import os

import numpy as np
import pytest

from conftest import max_diff
from dpax import data
from dpax.cli import main
from dpax.cli.job import TrainConfig
from dpax.cli.outputs import flat_params
from dpax.cli.train import train
from dpax.data import datasets, pipeline, prepare, sources
from dpax.errors import DpaxError

FORMATS = ("npz", "array_record", "parquet", "hf")


def images(n=300, seed=0):
    """uint8 8x8x3 images whose label is a fixed function of the pixels."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
    y = (x.reshape(n, -1).astype(np.int64) @ rng.normal(size=(192, 10))).argmax(-1)
    return x, y


def arrow_images(x):
    """uint8 NHWC images as an Arrow column of nested fixed-size lists."""
    import pyarrow as pa

    arr = pa.array(x.reshape(-1))
    for side in reversed(x.shape[1:]):
        arr = pa.FixedSizeListArray.from_arrays(arr, side)
    return arr


def write_parquet(directory, x, y, split=200, row_group_size=64):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(directory)
    for name, rows in (("a", slice(0, split)), ("b", slice(split, None))):
        table = pa.table({"x": arrow_images(x[rows]), "y": y[rows]})
        pq.write_table(table, os.path.join(directory, f"{name}.parquet"),
                       row_group_size=row_group_size)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The same 300 examples as .npz, ArrayRecord shards, Parquet and HF."""
    import datasets

    root = tmp_path_factory.mktemp("stored")
    x, y = images()
    paths = {f: str(root / f) for f in FORMATS}
    paths["npz"] += ".npz"
    np.savez(paths["npz"], x=x, y=y)
    write_parquet(paths["parquet"], x, y)
    datasets.Dataset.from_dict({"x": x, "y": y}).save_to_disk(paths["hf"])
    prepare.prepare(paths["npz"], paths["array_record"], shard_bytes=64 * 192,
                    progress=False)
    return x, y, paths


def test_every_format_reads_the_same_examples_and_split(stored):
    x, y, paths = stored
    ref = data.load(paths["npz"])
    idx = np.array([7, 0, 239, 3, 3])
    for fmt in FORMATS:
        ds = data.load(paths[fmt])
        assert isinstance(ds.x_train, sources.Column)  # uint8 images stay on disk / as uint8
        assert (ds.task, ds.n_out, ds.input_shape) == ("classification", 10, (8, 8, 3))
        np.testing.assert_array_equal(ds.y_train, ref.y_train)
        np.testing.assert_array_equal(ds.x_train[idx], ref.x_train[idx])
        np.testing.assert_array_equal(ds.x_eval[10:20], ref.x_eval[10:20])
    # The decode: uint8 scaled to [0, 1], in the order of the npz's own split.
    order = np.random.default_rng(datasets.DATA_SEED).permutation(len(x))[60:]
    np.testing.assert_array_equal(ref.x_train[idx], x[order[idx]] / np.float32(255))


def test_prepare_writes_one_record_per_example_in_order(stored):
    import grain
    from flax import serialization

    x, y, paths = stored
    meta = json.load(open(os.path.join(paths["array_record"], sources.META)))
    assert meta["examples"] == 300 and len(meta["shards"]) == 5  # 64 examples per shard
    records = grain.sources.ArrayRecordDataSource(
        [os.path.join(paths["array_record"], s) for s in meta["shards"]])
    for i in (0, 63, 64, 299):
        r = serialization.msgpack_restore(records[i])
        np.testing.assert_array_equal(r["x"], x[i])
        assert r["y"] == y[i]
    np.testing.assert_array_equal(np.load(os.path.join(paths["array_record"], "labels.npy")), y)


def test_prepare_from_parquet_and_hf_equals_prepare_from_npz(stored, tmp_path, capsys):
    x, y, paths = stored
    for fmt in ("parquet", "hf"):
        dest = str(tmp_path / fmt)
        # Not --quiet: into a pipe (pytest's capture) the bar stays off, no "\r" redraws.
        assert main(["prepare", paths[fmt], dest]) == 0
        printed = capsys.readouterr()
        assert f"wrote 300 examples in 1 shard(s) to {dest}" in printed.out
        assert "\r" not in printed.err + printed.out
        got = data.load(dest)
        np.testing.assert_array_equal(got.x_train[np.arange(240)],
                                      data.load(paths["npz"]).x_train[np.arange(240)])


@pytest.mark.slow
def test_four_formats_train_bit_identical_params_on_4_devices(stored):
    """50 steps on 4 devices, an uneven batch (37), the same params from each."""
    params = {}
    for fmt in FORMATS:
        result = train(TrainConfig.from_flags(
            model="cnn", data=stored[2][fmt], devices=4, steps=50,
                                   batch_size=37, log_every=25, quiet=True), log=None)
        params[fmt] = flat_params(result.trainer.params)
    for fmt in FORMATS[1:]:
        assert max_diff(params[fmt], params["npz"]) == 0.0, fmt


class CountingTable:
    def __init__(self, table):
        self.table, self.read_rows = table, []
        self.x_shape, self.y = table.x_shape, table.y

    def __len__(self):
        return len(self.table)

    def read(self, idx):
        self.read_rows.extend(idx.tolist())
        return self.table.read(idx)


def test_a_process_reads_only_the_rows_of_its_part_of_each_batch(stored):
    table = CountingTable(sources.open_table(stored[2]["array_record"]))
    x, y = sources.Column(table), table.y
    plan = pipeline.BatchPlan(len(y), 37, seed=3)
    rows = (20, 40)  # process 1 of 2, padded global batch of 40
    batches = list(pipeline.train_batches({"x": x, "y": y}, plan, rows, 0, plan.steps_per_epoch))
    expected = [i for s in range(plan.steps_per_epoch) for i in plan.indices(s)[20:40]]
    # A part with no example of its own (the epoch's short last batch) pads
    # with copies of the batch's first example: the one row read beyond its own.
    fills = [plan.indices(s)[0] for s in range(plan.steps_per_epoch)
             if not len(plan.indices(s)[20:40])]
    assert sorted(table.read_rows) == sorted(expected + fills)  # nothing else was read
    assert sum(b["mask"].sum() for b in batches) == len(expected)


def test_grain_workers_give_the_same_batches(stored):
    x = sources.Column(sources.open_table(stored[2]["array_record"]))
    y = np.arange(len(x))
    plan = pipeline.BatchPlan(len(x), 32, seed=0)
    data = {"x": x, "y": y}
    same = [pipeline.train_batches(data, plan, (8, 24), 0, 12, workers=w) for w in (0, 2)]
    for a, b in zip(*same):
        np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(a["y"], b["y"])


def test_workers_resume_at_the_saved_position(stored):
    """A Grain worker pipeline's state restores into a fresh one."""
    x = sources.Column(sources.open_table(stored[2]["array_record"]))
    y = np.arange(len(x))
    plan = pipeline.BatchPlan(len(x), 32, seed=0)
    it = pipeline.train_input({"x": x, "y": y}, plan, (0, 32), 0, 20, workers=2)
    for _ in range(5):
        next(it)
    it.trained(3)
    fresh = pipeline.train_input({"x": x, "y": y}, plan, (0, 32), 0, 20, workers=2)
    fresh.set_state(it.get_state())
    np.testing.assert_array_equal(next(fresh)["y"], plan.indices(3))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage, needle", [
    ("missing shard", "is missing"),
    ("truncated shard", "is damaged"),
    ("no meta", "no dpax.json beside the shards"),
    ("missing column", "has no column 'x'"),
    ("mixed shapes", "different sizes"),
    ("splits", "give one split's directory"),
    ("empty dir", "holds no *.array_record shards"),
    ("only shard deleted", "is missing"),  # dpax.json still lists it
    ("unknown x column", "hold the columns x and y, not 'nope'"),
    ("unknown y column", "hold the columns x and y, not 'label'"),
])
def test_bad_streamed_data_is_one_line_and_exit_2(stored, tmp_path, capsys, damage, needle):
    import shutil

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y, paths = stored
    bad = str(tmp_path / "bad")
    flags = []
    if damage in ("missing shard", "truncated shard", "no meta", "unknown x column",
                  "unknown y column"):
        shutil.copytree(paths["array_record"], bad)
        flags = {"unknown x column": ["--x-column", "nope"],
                 "unknown y column": ["--y-column", "label"]}.get(damage, [])
        first = os.path.join(bad, sorted(os.listdir(bad))[0])
        {"missing shard": os.remove, "truncated shard": truncate,
         "no meta": lambda _: os.remove(os.path.join(bad, sources.META))}.get(
            damage, lambda _: None)(first)
    elif damage == "only shard deleted":
        prepare.prepare(paths["npz"], bad, progress=False)  # one shard: 300 small images
        for f in os.listdir(bad):
            if f.endswith(sources.SUFFIX):
                os.remove(os.path.join(bad, f))
    elif damage == "missing column":
        os.makedirs(bad)
        pq.write_table(pa.table({"image": arrow_images(x), "y": y}), f"{bad}/a.parquet")
    elif damage == "mixed shapes":
        os.makedirs(bad)
        pq.write_table(pa.table({"x": [[1, 2], [3]], "y": [0, 1]}), f"{bad}/a.parquet")
    elif damage == "splits":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": x, "y": y})}
                             ).save_to_disk(bad)
    else:
        os.makedirs(bad)
    out = str(tmp_path / "run")
    capsys.readouterr()
    code = main(["train", "--data", bad, "--devices", "2", "--steps", "20", "--batch-size",
                 "64", "--out", out, *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    assert not os.path.exists(out)  # refused before anything was written


def test_prepare_refuses_an_existing_dest_and_leaves_nothing_half_written(stored, tmp_path,
                                                                         capsys):
    _, y, paths = stored
    assert main(["prepare", paths["npz"], paths["array_record"], "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    dest = str(tmp_path / "half")
    chunks = iter([np.zeros((4, 8, 8, 3), np.uint8), np.zeros((4, 8, 8, 2), np.uint8)])
    with pytest.raises(DpaxError, match="every example needs one shape"):
        prepare.write_shards(dest, chunks, y[:8], progress=False)
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")
