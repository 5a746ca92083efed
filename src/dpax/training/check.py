"""`dpax check` / `check_equivalence`: does a model train on N devices exactly
as on one? If not, name the likely cause.

Runs a few SGD steps of a fresh model on 1 device, and each of those steps
again on N devices from the very state one device had before it, with an
uneven global batch (padding on some devices); compares params, losses and
model state after every step and, when they differ beyond float rounding,
tests the usual suspects in turn.

Step by step from the same state, not two runs side by side: N devices add
their sums in another order than one device does, so each step differs in
the last bits, and in a model with max pooling or ReLUs a last bit can flip a
near-tie and send a gradient elsewhere; over several steps such a flip grows
into a visible difference that says nothing about the model's correctness.
One step from the same state shows what dpax does to a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpax.data.batches import batch_rows
from dpax.data.pipeline import examples
from dpax.errors import (
    MixesExamples,
    NotPerExample,
    PerDeviceRandom,
    PerDeviceState,
    ReadsBatchSize,
)
from dpax.models.bridge import LinenModel
from dpax.models.layers import SyncBatchNorm
from dpax.parallel.backends import DEFAULT_BACKEND
from dpax.training.trainer import Trainer

TOLERANCE = 1e-5

CAUSES = {
    "loss-mean": "the loss averages per device: return one loss per example, dpax does the "
                 "global mean",
    "batchnorm": "unsynchronized batch statistics: {layers} normalize with per-device "
                 "statistics; use nnx.BatchNorm or Linen's nn.BatchNorm (dpax converts them) "
                 "or dpax.models.layers.SyncBatchNorm",
    "batchnorm-off": "unsynchronized batch statistics: {layers} normalize with per-device "
                     "statistics because synchronization is off (`sync_batchnorm=False`); "
                     "drop that (`sync_batchnorm=True` is the default) for one device's numbers",
    "state": "per-device model state: {paths} is computed from each device's own rows by a "
             "layer dpax does not synchronize; compute it with nnx.BatchNorm (which dpax "
             "synchronizes) or with collectives over the devices",
    "rng": "per-device RNG: the model draws random numbers from its own key on every "
           "device; use nnx.Dropout (dpax derives each example's key from seed, step and index)",
    "loss-mixes": "the loss mixes examples across the batch (e.g. a per-device mean or "
                  "normalization): return each example's own loss; for a loss over the "
                  "whole batch take the other examples from dpax.models.layers.global_rows",
    "mixes": "the model or the loss mixes examples across the batch: compute each example's "
             "loss from that example alone; for a loss over the whole batch take the other "
             "examples from dpax.models.layers.global_rows",
    "model-mixes": "an op in the model mixes examples across the batch (a mean, norm or "
                   "sort over the batch axis) without synchronizing it",
    "batch-size": "the loss or the model computes with the number of rows a device holds "
                  "or a row's position among them (e.g. divides by x.shape[0]), a device's "
                  "share of the batch on N devices: return each example's own loss, and "
                  "take positions from batch['index']",
    "nonfinite": "NaN or inf on one side only (N devices or the one device): something the "
                 "model or the loss computes from a device's share of the batch (its size, "
                 "its rows) is not finite there",
}


@dataclasses.dataclass
class CheckResult:
    devices: int
    batch_size: int
    steps: int
    param_diff: float | None  # None: not compared (the run on N devices could not train)
    loss_diff: float | None
    state_diff: float | None
    cause: str | None = None  # a key of CAUSES
    detail: str = ""
    layout: str = "replicated"  # the run on N devices: its sharding, and groups if any

    @property
    def equivalent(self) -> bool:
        return self.cause is None

    def report(self) -> str:
        layout = "" if self.layout == "replicated" else f" ({self.layout})"
        head = (f"1 vs {self.devices} devices{layout}, global batch {self.batch_size}, "
                f"{self.steps} SGD steps, each from one device's state")
        if self.param_diff is None:
            head += ": not compared"
        else:
            head += (f": max |diff| params {self.param_diff:.2e}, loss {self.loss_diff:.2e}, "
                     f"model state {self.state_diff:.2e}")
        if self.equivalent:
            return f"{head}\nequivalent (tolerance {TOLERANCE:.0e})"
        return f"{head}\nNOT equivalent: {self.detail or CAUSES[self.cause]}"


def default_batch(devices: int) -> int:
    """A global batch that leaves `devices` > 1 padding: 5N + 3, or one less
    where N divides that (N = 3)."""
    b = 5 * devices + 3
    return b - 1 if devices > 1 and b % devices == 0 else b


def _numeric(x) -> np.ndarray:
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float64)


def _max_diff(a, b) -> float:
    """The largest |a - b| over two trees: inf where a value is NaN or
    infinite on one side only (equal NaNs and infinities differ by 0)."""
    diffs = [0.0]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = _numeric(x), _numeric(y)
        if x.size:
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            d = np.where(same, 0.0, np.abs(x - y))
            diffs.append(float(np.max(np.where(np.isnan(d), np.inf, d))))
    return max(diffs)


def _per_device_batchnorm(model: nnx.Module, sync_batchnorm: bool) -> list[str]:
    """The BatchNorm layers that normalize per device: NNX ones not converted,
    and those of a Linen model (`dpax.from_linen`) when synchronization is off."""
    names = [".".join(map(str, path)) or type(m).__name__
             for path, m in nnx.iter_modules(model)
             if isinstance(m, nnx.BatchNorm) and not isinstance(m, SyncBatchNorm)]
    if not sync_batchnorm:
        for path, m in nnx.iter_modules(model):
            if isinstance(m, LinenModel):
                stats = nnx.to_flat_state(nnx.state(m, nnx.BatchStat))
                names += sorted({".".join(map(str, path + p[:-1])) for p, _ in stats})
    return names


def _uses_rng_streams(before: nnx.State, after: nnx.State) -> bool:
    """True when a training step advanced an RNG stream of the model."""
    def counts(state):
        return [np.asarray(v[...]) for v in jax.tree.leaves(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(v, nnx.RngCount)]
    return any(not np.array_equal(a, b) for a, b in zip(counts(before), counts(after)))


def check_equivalence(
    make_model: Callable[[], nnx.Module],
    loss_fn: Callable,
    data,
    y=None,
    *,
    devices: int = 8,
    batch_size: int | None = None,
    steps: int = 5,
    lr: float = 0.05,
    sync_batchnorm: bool = True,
    backend: str = DEFAULT_BACKEND,
    grad_accum: int = 1,
    sharding: str = "replicated",
    replicas: int | str = 1,
) -> CheckResult:
    """Train `make_model()` for `steps` SGD steps on 1 device, run each step on
    `devices` too from the state one device had before it, with a global
    batch that leaves some devices padding; compare and diagnose.

    Args:
      make_model: builds a fresh, identically initialised model on each call.
      loss_fn: the loss as given to `Trainer` (one loss per example).
      data, y: training examples, as `Trainer.fit` takes them.
      devices: the device count compared against one device.
      batch_size: the global batch; None: `5 * devices + 3` (one less where
        that splits evenly, on 3 devices), which leaves the last device
        padding.
      steps: how many steps are compared, each from one device's state.
      lr: the SGD learning rate.
      sync_batchnorm: as `Trainer` takes it.
      backend: "shard_map" or "pmap", for the run on `devices`.
      grad_accum: micro-batches per step, on both sides.
      sharding, replicas: the layout and hybrid sharding's groups of the run
        on `devices`, as `Trainer` takes them (one device: replicated).

    Returns:
      A `CheckResult`: the largest differences of params, loss and model
      state (within `TOLERANCE`: `equivalent`), or the `cause` found and its
      `detail` (a BatchNorm not synchronized, per-device random numbers or
      state, a model or loss that mixes examples, a loss that returns a
      mean). A model the Trainer refuses on `devices` is such a result, not
      an exception.

    Raises:
      DpaxError: an argument the Trainer refuses (more `devices` than JAX
        has, an unknown `backend`, examples no step can train on).
    """
    data = examples(data, y)
    # Uneven: with N = 8, 43 rows pad to 48, and the last device holds 1 real row.
    batch_size = batch_size or default_batch(devices)
    t1, tn = (Trainer(make_model(), loss_fn, optax.sgd(lr), devices=n, backend=backend,
                      sync_batchnorm=sync_batchnorm, max_bad_steps=None,
                      grad_accum=grad_accum, **layout)
              for n, layout in ((1, {}), (devices, {"sharding": sharding,
                                                    "replicas": replicas})))
    before = t1.backend.host(t1.state.model_state)
    layout = tn.layout.name + (f" in {tn.backend.replicas} replica groups"
                               if tn.backend.replicas > 1 else "")
    diffs = {"params": 0.0, "loss": 0.0, "state": 0.0}
    for step in range(1, steps + 1):
        tn.load_state_dict(t1.state_dict())  # the state one device starts the step from
        try:
            row1, rown = (t.fit(data, batch_size=batch_size, until_step=step, log_every=1)[-1]
                          for t in (t1, tn))
        except (PerDeviceRandom, PerDeviceState, MixesExamples, ReadsBatchSize,
                NotPerExample) as e:
            # Refused before the step on N devices ran.
            cause, detail = _refused(e, tn, t1, loss_fn, data, before, sync_batchnorm)
            return CheckResult(devices, batch_size, steps, None, None, None, cause, detail,
                               layout)
        for name, a, b in (("params", t1.params, tn.params), ("loss", row1["loss"], rown["loss"]),
                           ("state", t1.backend.host(t1.state.model_state),
                            tn.backend.host(tn.state.model_state))):
            diffs[name] = max(diffs[name], _max_diff(a, b))
    result = CheckResult(devices, batch_size, steps, diffs["params"], diffs["loss"],
                         diffs["state"], layout=layout)
    if max(diffs.values()) <= TOLERANCE:
        return result
    if np.isinf(max(diffs.values())):  # not a difference of rounding or of a mix: no search
        result.cause = "nonfinite"
        return result
    result.cause, result.detail = _diagnose(tn.model(), t1, loss_fn, data, before,
                                            sync_batchnorm)
    return result


def _refused(e: Exception, tn, t1, loss_fn, data, before, sync_batchnorm
             ) -> tuple[str, str]:
    """(cause, detail) of a refusal; raises `e` again where it is no verdict."""
    if isinstance(e, PerDeviceRandom):
        return "rng", ""
    if isinstance(e, PerDeviceState):
        unsynced = _per_device_batchnorm(tn.model(), sync_batchnorm)
        cause = "batchnorm" if unsynced else "state"
        return cause, CAUSES[cause].format(layers=", ".join(unsynced), paths=", ".join(e.paths))
    if isinstance(e, MixesExamples):
        cause, detail = _diagnose(tn.model(), t1, loss_fn, data, before, sync_batchnorm)
        return cause, f"{detail} ({e.where})"
    if isinstance(e, ReadsBatchSize):
        return "batch-size", f"{CAUSES['batch-size']} ({e.where})"
    if e.name == "loss" and e.shape == ():  # a mean over the batch, not one loss per example
        return "loss-mean", ""
    raise e  # a loss of another shape: bad input, as `fit` says


def _diagnose(model, trainer, loss_fn, data, rest_before, sync_batchnorm) -> tuple[str, str]:
    unsynced = _per_device_batchnorm(model, sync_batchnorm)
    if unsynced:
        cause = "batchnorm" if sync_batchnorm else "batchnorm-off"
        return cause, CAUSES[cause].format(layers=", ".join(unsynced))
    if _uses_rng_streams(rest_before, trainer.backend.host(trainer.state.model_state)):
        return "rng", CAUSES["rng"]
    # With the model's batch-level behaviour off (eval mode), does an example's
    # output, then its loss, depend on which other examples share its batch?
    host = trainer.model()
    host.eval()
    b = min(batch_rows(data), 16)
    batch = {**jax.tree.map(lambda v: jnp.asarray(v[:b]), data), "mask": jnp.ones(b, bool)}
    half = jax.tree.map(lambda v: v[: b // 2], batch)
    try:
        outputs = np.asarray(host(batch["x"]))[: b // 2], np.asarray(host(half["x"]))
    except (TypeError, KeyError):  # a model not called as model(x): only the loss can tell
        outputs = None
    if outputs is not None and not _same(*outputs):
        return "model-mixes", CAUSES["model-mixes"]
    try:
        whole = np.asarray(_per_example(loss_fn, host, batch))[: b // 2]
        alone = np.asarray(_per_example(loss_fn, host, half))
    except Exception:  # noqa: BLE001 - a loss made for other batch sizes: no probe to tell
        return "mixes", CAUSES["mixes"]
    if not _same(whole, alone):
        return "loss-mixes", CAUSES["loss-mixes"]
    # Neither half of the batch shows it (a difference of neighbours, the
    # batch's hardest examples): the refusal's line, if any, says where.
    return "mixes", CAUSES["mixes"]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(a, b, atol=1e-6)


def _per_example(loss_fn, model, batch):
    out = loss_fn(model, batch)
    return out[0] if isinstance(out, tuple) else out
