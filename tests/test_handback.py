"""The trained state handed back to the user's model: the values of the
state given, in arrays of the model's own, where the model's were; found by
NNX's walk once and reused only while the model holds the same Variables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpax.training import handback
from dpax.training.handback import ModelHandback


class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.b = nnx.Linear(4, 2, rngs=rngs)
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


class Opaque(nnx.Module, pytree=False):  # not a pytree: JAX cannot walk it
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)


_state = nnx.state  # NNX's walk, uncounted (`_walks`)


def _trained(model, shift, device=None):
    """A state of the model's structure and other values (the Trainer's),
    on `device` (default: where the model's arrays are)."""
    state = jax.tree.map(lambda x: x + shift, _state(model))
    return state if device is None else jax.device_put(state, device)


def _values(model):
    return [np.asarray(x) for x in jax.tree.leaves(_state(model))]


def _holds(model, state):
    """The model's arrays hold `state`'s values."""
    return all(np.array_equal(a, np.asarray(b))
               for a, b in zip(_values(model), jax.tree.leaves(state)))


def _walks(monkeypatch):
    """Count NNX's walks of a model (`nnx.state` calls) from `handback`."""
    walks = []

    def state(*args, **kw):
        walks.append(1)
        return _state(*args, **kw)

    monkeypatch.setattr(handback.nnx, "state", state, raising=True)
    return walks


def test_every_call_hands_back_the_values_in_copies_of_the_models_own():
    model = Net(nnx.Rngs(0))
    sink = ModelHandback(model)
    for call in range(3):
        state = _trained(model, call + 1)
        want = [np.asarray(x) for x in jax.tree.leaves(state)]
        sink.write(state)
        assert all(np.array_equal(a, b) for a, b in zip(_values(model), want))
        # The Trainer's next step donates its buffers: the model's must outlive them.
        mine = jax.tree.leaves(_state(model))
        for x in jax.tree.leaves(state):
            x.delete()
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(mine, want))


def test_nnx_walks_the_model_once_while_it_holds_the_same_variables(monkeypatch):
    model = Net(nnx.Rngs(0))
    sink = ModelHandback(model)
    walks = _walks(monkeypatch)
    for call in range(3):
        sink.write(_trained(model, call + 1))
    assert len(walks) == 1


def test_a_replaced_layer_or_variable_gets_the_state_as_nnx_update_gives_it(monkeypatch):
    model = Net(nnx.Rngs(0))
    sink = ModelHandback(model)
    sink.write(_trained(model, 1))
    walks = _walks(monkeypatch)
    model.b = nnx.Linear(4, 2, rngs=nnx.Rngs(5))  # new Variables in the same places
    state = _trained(model, 2)
    sink.write(state)
    assert len(walks) == 1
    np.testing.assert_array_equal(model.b.kernel.get_value(), state["b"]["kernel"].get_value())
    model.a.bias = nnx.Param(jnp.zeros(4))
    state = _trained(model, 3)
    sink.write(state)
    assert len(walks) == 2
    np.testing.assert_array_equal(model.a.bias.get_value(), state["a"]["bias"].get_value())


def test_the_models_arrays_stay_where_they_were():
    """Trained on other devices (the state arrives on device 0), a model kept
    on device 3 keeps its arrays there, on the compiled copy's calls too."""
    device = jax.devices()[3]
    model = Net(nnx.Rngs(0))
    nnx.update(model, jax.device_put(_state(model), device))
    sink = ModelHandback(model)
    for call in range(3):
        state = _trained(model, call + 1, jax.devices()[0])
        sink.write(state)
        assert {d for x in jax.tree.leaves(_state(model)) for d in x.devices()} == {device}
        np.testing.assert_array_equal(model.a.kernel.get_value(),
                                      state["a"]["kernel"].get_value())


class Pairs(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(3, 4, rngs=rngs)
        self.pair = nnx.Variable({"x": jnp.zeros(2), "y": jnp.ones(2)})  # two leaves


@pytest.mark.parametrize("make, walks_made", [
    (Opaque, 3),  # JAX cannot walk it: NNX's walk and update each call
    (Pairs, 1 + 3),  # one walk to find out, then NNX's update each call
])
def test_models_the_quick_walk_cannot_serve_are_updated_by_nnx(monkeypatch, make, walks_made):
    model = make(nnx.Rngs(0))
    sink = ModelHandback(model)
    walks = _walks(monkeypatch)
    for call in range(3):
        state = _trained(model, call + 1)
        sink.write(state)
        assert _holds(model, state)
    assert len(walks) == walks_made


def test_host_arrays_are_placed_where_the_models_were():
    """With several processes a split layout's params arrive as host arrays."""
    model = Net(nnx.Rngs(0))
    sink = ModelHandback(model)
    for call in range(3):
        state = jax.tree.map(np.asarray, _trained(model, call + 1))
        sink.write(state)
        for mine, given in zip(jax.tree.leaves(_state(model)), jax.tree.leaves(state)):
            assert isinstance(mine, jax.Array) and mine.devices() == {jax.devices()[0]}
            np.testing.assert_array_equal(mine, given)
