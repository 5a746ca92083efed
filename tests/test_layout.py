"""State layouts (`dpax.layout`): ZeRO-1's sharded optimizer state gives the
replicated layout's numbers, holds 1/N of the bytes, and checkpoints without
its padding."""

import jax
import numpy as np
import optax
import pytest

from conftest import STEPS, digits, fit_digits, leaves, max_diff, mlp_trainer
from dpax.errors import DpaxError
from dpax.layout import ShardedOptimizer, check_sharded_optimizer


def test_the_sharded_layout_pads_to_a_multiple_of_n_and_checkpoints_without_it():
    layout = ShardedOptimizer(n_devices=8, n_params=13)
    assert layout.padded == 16
    padded = np.arange(16.0)
    saved = layout.to_logical("opt_state.0.mu", padded)
    assert saved.shape == (13,)
    np.testing.assert_array_equal(layout.from_logical("opt_state.0.mu", saved, padded),
                                  np.r_[np.arange(13.0), 0, 0, 0])
    assert layout.to_logical("params.w", padded) is padded  # only the optimizer's vectors


@pytest.mark.parametrize("backend,steps_per_call,clip", [
    ("pmap", 1, None), ("shard_map", 4, None), ("shard_map", 1, 1.0)])
def test_the_sharded_layout_rule_lives_in_one_place(backend, steps_per_call, clip):
    with pytest.raises(DpaxError, match="`shard_optimizer_state` needs"):
        check_sharded_optimizer(backend, steps_per_call, clip)
    if clip is None:  # a clip lives in the optax chain, which the Trainer cannot see
        with pytest.raises(DpaxError, match="`shard_optimizer_state` needs"):
            mlp_trainer(2, backend=backend, steps_per_call=steps_per_call,
                        shard_optimizer_state=True)


# -- ZeRO-1 ------------------------------------------------------------------------------
def opt_bytes_on_first_device(t):
    first = t.backend.devices[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(t.state.opt_state)
               for s in x.addressable_shards if s.device == first)


@pytest.mark.parametrize("name,tx", [("momentum", optax.sgd(0.05, momentum=0.9)),
                                     ("adam", optax.adam(3e-3))])
def test_sharded_optimizer_state_equals_replicated(name, tx):
    rep, zero = mlp_trainer(8, tx=tx), mlp_trainer(8, tx=tx, shard_optimizer_state=True)
    curve_rep = [r["loss"] for r in fit_digits(rep, 61)]
    curve_zero = [r["loss"] for r in fit_digits(zero, 61)]
    diff = max_diff(leaves(zero), leaves(rep))
    rel = max(abs(a - b) / a for a, b in zip(curve_rep, curve_zero))
    ratio = opt_bytes_on_first_device(zero) / (opt_bytes_on_first_device(rep) / 8)
    print(f"ZeRO-1 {name}: params {diff:.2e}, loss curve rel {rel:.2e}, "
          f"optimizer bytes/device = {ratio:.3f} x replicated/8")
    assert diff <= 1e-5 and rel <= 1e-5
    assert 0.9 <= ratio <= 1.1
    # Its checkpoint is device-count independent: resume on 3 devices.
    other = mlp_trainer(3, tx=tx, shard_optimizer_state=True)
    other.load_state_dict(zero.state_dict())
    rep.fit(digits().x_train, digits().y_train, batch_size=61, until_step=STEPS + 3)
    other.fit(digits().x_train, digits().y_train, batch_size=61, until_step=STEPS + 3)
    assert max_diff(leaves(other), leaves(rep)) <= 1e-5
