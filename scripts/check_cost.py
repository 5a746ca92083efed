"""What the Trainer's checks of the examples cost (`dpax.data.checks`), on
the digits set and on large float arrays: the best of a few runs each.

    PYTHONPATH=src python scripts/check_cost.py [--sizes 1e7 1e8]
"""

import argparse
import time

import dpax

dpax.simulate_devices(2)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from dpax.data import checks  # noqa: E402


def best_ms(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def trainer(input_shape, model="cnn"):
    return dpax.Trainer(dpax.make_model(model, input_shape, 10, seed=0),
                        dpax.classification_loss, optax.sgd(0.1), devices=2)


def cost(name, t, x, y) -> None:
    data = {"x": x, "y": y}
    given = t._examples(data, positional=True)
    first = best_ms(lambda: t._model_output(x.shape[1:], x.dtype), repeats=1)
    values = best_ms(lambda: checks.values(given))
    rule = best_ms(lambda: t._rule(given))
    print(f"{name}: x {x.shape} {x.dtype} ({x.nbytes / 1e6:.0f} MB), y {y.shape}: "
          f"values {values:.2f} ms, classification rule {rule:.2f} ms "
          f"(the model's outputs traced once: {first:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="*", default=[1e7, 1e8])
    args = parser.parse_args()
    ds = dpax.data.digits()
    cost("digits", trainer(ds.input_shape), ds.x_train, ds.y_train)
    rng = np.random.default_rng(0)
    for size in args.sizes:
        rows = int(size) // 1024
        x = rng.random((rows, 1024), dtype=np.float32)
        y = rng.integers(0, 10, rows).astype(np.int32)
        cost(f"{size:.0e} floats", trainer((1024,), "mlp"), x, y)
        sums = best_ms(lambda x=x: x.sum())
        flags = best_ms(lambda x=x: np.isfinite(x).all())
        print(f"  for comparison: x.sum() {sums:.1f} ms, np.isfinite(x).all() {flags:.1f} ms")


if __name__ == "__main__":
    main()
