"""Datasets behind the CLI names and users' .npz files (`dpax.data`)."""

import numpy as np

from dpax import data
from dpax.cli.train import TrainConfig, train


def test_digits_split_is_fixed_and_covers_every_image():
    a, b = data.digits(), data.digits()
    assert len(a.x_train) + len(a.x_eval) == 1797
    np.testing.assert_array_equal(a.y_eval, b.y_eval)
    assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0


def test_digits_are_scikit_learns_own_without_importing_it():
    """dpax reads the file `load_digits` reads, without its ~2 s import."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    d = load_digits()
    theirs = data.datasets._split("digits", (d.images[..., None] / 16.0).astype(np.float32),
                                  d.target.astype(np.int32), "classification", 10)
    ours = data.digits()
    for field in ("x_train", "y_train", "x_eval", "y_eval"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    loads = "import sys, dpax; dpax.data.digits(); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", loads], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_random_images_are_nhwc_and_learnable_labels():
    ds = data.random_images(n=64)
    assert ds.x_train.shape[1:] == (32, 32, 3) and ds.n_out == 10
    # The labels are a linear function of the pixels: a least-squares probe fit
    # on the training split predicts the held-out labels far above chance (0.1).
    small = data.random_images(n=3000, side=4, channels=2)
    onehot = np.eye(small.n_out)[small.y_train]
    w, *_ = np.linalg.lstsq(small.x_train.reshape(len(onehot), -1), onehot, rcond=None)
    guess = np.argmax(small.x_eval.reshape(len(small.y_eval), -1) @ w, -1)
    assert np.mean(guess == small.y_eval) > 0.6
    np.testing.assert_array_equal(small.y_eval, data.random_images(n=3000, side=4,
                                                                   channels=2).y_eval)


def test_user_npz_classification_and_regression(tmp_path):
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float64)
    np.savez(tmp_path / "c.npz", x=x, y=np.arange(50) % 3)
    np.savez(tmp_path / "r.npz", x=x, y=x.sum(1))
    c, r = data.load(str(tmp_path / "c.npz")), data.load(str(tmp_path / "r.npz"))
    assert c.task == "classification" and c.n_out == 3 and c.x_train.dtype == np.float32
    assert r.task == "regression" and len(r.x_train) + len(r.x_eval) == 50
    cfg = TrainConfig.from_flags(
        model="mlp", data=str(tmp_path / "r.npz"), devices=4,
                           optimizer="sgd", lr=0.05, batch_size=7, steps=3, log_every=3)
    assert np.isfinite(train(cfg, log=None).eval["loss"])
