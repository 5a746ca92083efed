"""Seeds 001-003 on dpax: one function per device, in_axes, and psum.

`dpax.pmap.spmd` is `jax.pmap` with the seeds' meaning on current JAX, on either
backend: mapped arguments carry a leading device axis, `None` ones are
broadcast (also when nothing is mapped), and collectives use the axis "data".
Run: python examples/seed001_002_spmd_basics.py
"""

import dpax

dpax.simulate_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402

n = 4
# Seed 002: scale by two on every device, then sum across devices with psum.
x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)


def scale_and_sum(x):
    scaled = x * 2
    return scaled, jax.lax.psum(scaled.sum(), "data")


for backend in ("shard_map", "pmap"):
    scaled, total = dpax.pmap.spmd(scale_and_sum, devices=n, backend=backend)(x)
    print(f"{backend:9}  psum on every device: {np.asarray(total)}  "
          f"expected {float((x * 2).sum())}")

# Seed 001: parallel prediction, params broadcast (in_axes None), data split (0).
rng = np.random.default_rng(0)
params = {"w": rng.normal(size=(10, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
batch = rng.normal(size=(32 * n, 10)).astype(np.float32)
sharded = dpax.pmap.shard_batch({"x": batch}, n)


def predict(params, inputs):
    return inputs @ params["w"] + params["b"]


preds = dpax.pmap.spmd(predict, devices=n, in_axes=(None, 0))(params, sharded["x"])
print("sharded predictions:", preds.shape, "-> unsharded:",
      dpax.pmap.unshard(preds, sharded["mask"]).shape)
np.testing.assert_allclose(dpax.pmap.unshard(preds), predict(params, batch), rtol=1e-5, atol=1e-5)
