"""Built-in Flax NNX models, each written for ONE device.

Any `nnx.Module` works with dpax; these are the ones the CLI can name.
"""

from __future__ import annotations

import math

from flax import nnx

from dpax.errors import DpaxError


class Linear(nnx.Module):
    """y = x w + b on flattened inputs (linear regression)."""

    def __init__(self, in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(math.prod(in_shape), n_out, rngs=rngs)

    def __call__(self, x):
        return self.dense(x.reshape(x.shape[0], -1))


class MLP(nnx.Module):
    """ReLU hidden layers of the given widths (two of `hidden`, by default) on
    flattened inputs."""

    def __init__(self, in_shape: tuple[int, ...], n_out: int, *,
                 hidden: int | tuple[int, ...] = 128, rngs: nnx.Rngs):
        widths = (hidden, hidden) if isinstance(hidden, int) else tuple(hidden)
        sizes = (math.prod(in_shape), *widths, n_out)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:])])

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    """Two conv + max-pool blocks and a dense head, on NHWC images."""

    def __init__(self, in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs):
        h, w, c = in_shape
        if h % 4 or w % 4:
            raise DpaxError(f"cnn needs image sides divisible by 4, got {h}x{w}")
        self.conv1 = nnx.Conv(c, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.dense = nnx.Linear(64 * (h // 4) * (w // 4), n_out, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        return self.dense(x.reshape(x.shape[0], -1))


class CNNBN(nnx.Module):
    """A small residual CNN with BatchNorm and dropout, on NHWC images.

    dpax trains it exactly as one device would: its BatchNorm statistics are
    global and masked, its dropout masks independent of the device count.
    """

    def __init__(self, in_shape: tuple[int, ...], n_out: int, *, width: int = 32,
                 dropout: float = 0.2, rngs: nnx.Rngs):
        h, w, c = in_shape
        if h % 4 or w % 4:
            raise DpaxError(f"cnn-bn needs image sides divisible by 4, got {h}x{w}")
        self.stem = nnx.Conv(c, width, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(width, rngs=rngs)
        self.res1 = nnx.Conv(width, width, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.res1_bn = nnx.BatchNorm(width, rngs=rngs)
        self.res2 = nnx.Conv(width, width, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.res2_bn = nnx.BatchNorm(width, rngs=rngs)
        self.down = nnx.Conv(width, 2 * width, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.down_bn = nnx.BatchNorm(2 * width, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(2 * width * (h // 4) * (w // 4), n_out, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_bn(self.stem(x)))
        r = nnx.relu(self.res1_bn(self.res1(x)))
        x = nnx.relu(x + self.res2_bn(self.res2(r)))  # the residual connection
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.down_bn(self.down(x)))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def deep_mlp(in_shape: tuple[int, ...], n_out: int, *, rngs: nnx.Rngs) -> MLP:
    """Seven hidden layers of 4096: about 101M parameters on 8x8 digits, whose
    state (params, gradients and Adam's two moments) rather than activations
    fills a device: the model that shows what `sharding="full"` saves."""
    return MLP(in_shape, n_out, hidden=(4096,) * 7, rngs=rngs)
