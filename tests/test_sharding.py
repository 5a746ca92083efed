import jax
import numpy as np
import pytest

from dpax.data.batches import pad_batch, padded_size
from dpax.errors import DpaxError
from dpax.pmap import replicas_in_sync, replicate, shard_batch, unreplicate, unshard


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 3, 7, 8, 9, 41, 64])
def test_shard_batch_pads_masks_and_round_trips(n, b):
    x = np.arange(b * 3, dtype=np.float32).reshape(b, 3)
    y = np.arange(b, dtype=np.int32)
    s = shard_batch({"x": x, "y": y}, n)
    rows = padded_size(b, n)
    assert rows % n == 0 and rows - b < n
    assert s["x"].shape == (n, rows // n, 3) and s["mask"].shape == (n, rows // n)
    assert s["mask"].sum() == b
    back = unshard({"x": s["x"], "y": s["y"]}, s["mask"])
    np.testing.assert_array_equal(back["x"], x)
    np.testing.assert_array_equal(back["y"], y)


def test_padding_rows_copy_the_first_example_and_are_masked_off():
    x = np.arange(6, dtype=np.float32).reshape(3, 2) + 1
    s = pad_batch({"x": x, "y": {"n": np.array([4, 5, 6])}}, 8)
    assert s["mask"].tolist() == [True] * 3 + [False] * 5
    np.testing.assert_array_equal(s["x"], np.concatenate([x, np.repeat(x[:1], 5, 0)]))
    assert s["y"]["n"].tolist() == [4, 5, 6] + [4] * 5
    # A given example (`local_part`'s: the global batch's first), and zeros
    # only where there is no example to copy.
    s = pad_batch({"x": x}, 5, fill={"x": np.full((1, 2), 9.0)})
    assert s["x"][3:].tolist() == [[9.0, 9.0]] * 2
    s = pad_batch({"x": np.zeros((0, 2), np.float32)}, 2)
    assert not s["x"].any() and not s["mask"].any()
    # No real row: still the user's own first row, never a row of zeros.
    s = pad_batch({"x": x, "mask": np.zeros(3, bool)}, 4)
    assert s["x"][3].tolist() == x[0].tolist() and not s["mask"].any()
    with pytest.raises(ValueError, match="one example"):
        pad_batch({"x": x}, 5, fill={"x": np.zeros((0, 2))})


def test_pad_keeps_an_existing_mask():
    s = pad_batch({"x": np.arange(3) + 1, "mask": np.array([False, True, True])}, 4)
    assert s["mask"].tolist() == [False, True, True, False]
    assert s["x"].tolist() == [1, 2, 3, 2]  # the first real row's copy


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="differ"):
        pad_batch({"x": np.ones(3), "y": np.ones(2)}, 4)
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch({"x": np.ones(5)}, 4)
    with pytest.raises(ValueError, match="multiple"):
        shard_batch({"x": np.ones(5)}, 4, size=6)
    with pytest.raises(DpaxError, match="`batch` must be a dict of arrays"):
        shard_batch(np.ones((8, 2)), 4)


def test_replicate_unreplicate_and_sync_check_on_host():
    tree = {"w": np.arange(6.0).reshape(2, 3), "b": np.float32(2.0)}
    rep = replicate(tree, 4)
    assert rep["w"].shape == (4, 2, 3) and rep["b"].shape == (4,)
    assert replicas_in_sync(rep)
    np.testing.assert_array_equal(unreplicate(rep)["w"], tree["w"])
    broken = {"w": rep["w"].copy(), "b": rep["b"]}
    broken["w"][3, 0, 0] += 1e-7
    assert not replicas_in_sync(broken)


def test_sync_check_reads_every_device_of_a_replicated_array():
    devs = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    same = jax.device_put(np.ones(3, np.float32), rep)
    assert replicas_in_sync(same)
    # Assemble a "replicated" array whose copy on device 2 differs by one bit.
    bufs = [jax.device_put(np.ones(3, np.float32) * (1 if i != 2 else 1.0000001), d)
            for i, d in enumerate(devs)]
    diverged = jax.make_array_from_single_device_arrays((3,), rep, bufs)
    assert not replicas_in_sync(diverged)


def test_batch_plan_covers_each_epoch_once_and_reshuffles():
    from dpax.data.pipeline import BatchPlan

    plan = BatchPlan(n_examples=10, batch_size=4, seed=3)
    epochs = [np.concatenate([plan.indices(e * 3 + j) for j in range(3)]) for e in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == list(range(10))  # 4 + 4 + 2, nothing dropped
    assert epochs[0].tolist() != epochs[1].tolist()
    assert plan.indices(5).tolist() == BatchPlan(10, 4, 3).indices(5).tolist()
    assert plan.indices(0).tolist() != BatchPlan(10, 4, 4).indices(0).tolist()
