"""Augmentation keyed by (seed, step, global position): the same for any
device or process count, new for every epoch."""

import numpy as np
import optax
import pytest

import dpax
from conftest import digits, max_diff
from dpax.cli import main
from dpax.data import augment, pipeline
from dpax.errors import DpaxError

CROP_FLIP = augment.parse("crop,flip")


def batch(n=12, side=8, seed=0):
    return np.random.default_rng(seed).normal(size=(n, side, side, 3)).astype(np.float32)


def test_a_process_augments_its_rows_as_the_whole_batch_does():
    x = batch()
    whole = CROP_FLIP(x, seed=5, step=7, first=0, batch_size=12)
    for lo, hi in ((0, 3), (3, 6), (6, 12)):
        np.testing.assert_array_equal(CROP_FLIP(x[lo:hi], 5, 7, lo, 12), whole[lo:hi])
    assert not np.array_equal(whole, x)


def test_crop_is_a_window_of_the_zero_padded_image_and_flip_mirrors():
    x = batch(n=64)
    cropped = augment.Augment(crop=True, pad=2)(x, 0, 0, 0, 64)
    padded = np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))
    for i in range(64):
        assert any(np.array_equal(cropped[i], padded[i, a:a + 8, b:b + 8])
                   for a in range(5) for b in range(5))
    flipped = augment.Augment(flip=True)(x, 0, 0, 0, 64)
    mirrored = [np.array_equal(flipped[i], x[i, :, ::-1]) for i in range(64)]
    kept = [np.array_equal(flipped[i], x[i]) for i in range(64)]
    assert all(m or k for m, k in zip(mirrored, kept)) and 16 < sum(mirrored) < 48


def test_two_epochs_see_different_crops_of_the_same_example():
    ds = digits()
    plan = pipeline.BatchPlan(len(ds.x_train), 64, seed=0)
    seen = {}
    for step in range(2 * plan.steps_per_epoch):
        data = {"x": ds.x_train, "y": ds.y_train}
        b = pipeline.local_parts(data, plan, (0, 64), range(step, step + 1), CROP_FLIP)[0]
        for pos, i in enumerate(plan.indices(step)):
            seen.setdefault(int(i), []).append(b["x"][pos])
    changed = [not np.array_equal(a, b) for a, b in seen.values()]
    assert len(seen) == len(ds.x_train) and np.mean(changed) > 0.8


@pytest.fixture(scope="module")
def trained():
    """The cnn on digits with crop+flip, an uneven batch, on 1 and 4 devices."""
    ds = digits()

    def fit(n, aug):
        from flax import nnx

        model = dpax.models.CNN(ds.input_shape, ds.n_out, rngs=nnx.Rngs(0))
        t = dpax.Trainer(model, dpax.classification_loss, optax.adam(3e-3), devices=n)
        t.fit(ds.x_train, ds.y_train, batch_size=45, until_step=30, log_every=30,
              augment=aug)
        return t.params

    return {key: fit(*key) for key in ((1, CROP_FLIP), (4, CROP_FLIP), (4, None))}


def test_augmented_training_on_4_devices_equals_1(trained):
    diff = max_diff(trained[(4, CROP_FLIP)], trained[(1, CROP_FLIP)])
    print(f"augmented cnn, 4 devices vs 1: max |diff| {diff:.2e}")
    assert diff <= 1e-5
    assert max_diff(trained[(4, None)], trained[(4, CROP_FLIP)]) > 1e-3  # it did augment


def test_bad_augment_is_one_line_and_exit_2(capsys):
    assert main(["train", "--augment", "crop,rotate", "--steps", "1"]) == 2
    assert "unknown augmentation 'rotate'" in capsys.readouterr().err
    assert main(["train", "--model", "mlp", "--data", "regression", "--augment", "flip",
                 "--steps", "1", "--devices", "1"]) == 2
    err = capsys.readouterr().err
    assert "augmentation needs images" in err and err.count("\n") == 1
    with pytest.raises(DpaxError, match="choose from crop, flip"):
        augment.parse("flip,,crop")
