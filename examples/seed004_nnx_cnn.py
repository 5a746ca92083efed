"""Seed 004 on dpax: a Flax NNX CNN with Adam, data-parallel, from Python.

The model and loss are written for ONE device; the loss returns one value per
example so uneven shards average exactly. No batch is skipped: the seed's
`if batch.shape[0] != total_batch_size: continue` becomes padding + a mask.
Run: python examples/seed004_nnx_cnn.py
"""

import dpax

dpax.simulate_devices(8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from dpax import data  # noqa: E402


class CNN(nnx.Module):
    def __init__(self, num_classes: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.dense = nnx.Linear(64 * 2 * 2, num_classes, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        return self.dense(x.reshape(x.shape[0], -1))


def loss_fn(model, batch):
    logits = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}


digits = data.digits()
trainer = dpax.Trainer(CNN(10, nnx.Rngs(0)), loss_fn, optax.adam(3e-3), devices=8,
                       predict_fn=lambda model, batch: jnp.argmax(model(batch["x"]), -1))
for row in trainer.fit(digits.x_train, digits.y_train, batch_size=100, epochs=10,
                       log_every=45):
    print(f"step {row['step']:3d}  loss {row['loss']:.4f}  accuracy {row['accuracy']:.3f}")
ev = trainer.evaluate(digits.x_eval, digits.y_eval)
print(f"eval accuracy {ev['accuracy']:.3f} on {ev['examples']} examples")
print("predictions for the first 10 eval digits:", trainer.predict(digits.x_eval[:10]))
print("labels:                                 ", digits.y_eval[:10])
