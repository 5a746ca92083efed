"""`for_xla_cpu`: the same gradients as `jax.grad`, no weight-gradient dot left
for XLA:CPU to fold into one its fast kernels refuse, and checkpointed blocks
that XLA can no longer merge with their forward pass (the memory saving
itself: test_gpt.py)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpax.models import gpt
from dpax.xla_cpu import dots
from dpax.xla_cpu.backward import for_xla_cpu

pytestmark = pytest.mark.tuned  # the opt-in tuning: make test-tuned


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _lhs_first_dim_dots(hlo: str) -> int:
    """Dots that contract their lhs's first dimension: what algsimp makes of
    transpose(dot) (YNNPACK refuses them)."""
    return len(re.findall(r" dot\(.*lhs_contracting_dims=\{0", hlo))


def _transposed_dots(hlo: str) -> int:
    """2-D dots that write a column-major result."""
    return len(re.findall(r"\]\{0,1\} dot\(", hlo))


def _instructions(hlo: str) -> list[str]:
    """Each HLO instruction's shape (with layout) and opcode, names and metadata left out."""
    return re.findall(r"= (\S+) ([a-z-]+)\(", hlo)


def _windowed_ops(hlo: str) -> set[str]:
    """HLO ops over windows or scattering into them (XLA expands a
    select-and-scatter into a reduce-window and a scatter)."""
    return set(re.findall(r" ([a-z-]*(?:window|scatter)[a-z-]*)\(", hlo))


def _dense_loss(ws, x):  # dense layers on [batch, tokens, features], as in a transformer
    for w in ws:
        x = jnp.tanh(x @ w)
    return x.sum()


def test_weight_gradients_keep_their_values_and_lose_the_folded_dots(monkeypatch):
    """Over [batch, tokens, features] each weight gradient's dot contracts
    two dimensions; timed faster apart (as on the bench's GPT), it is kept
    apart with the smaller margin, and its values stay."""
    margins = []
    monkeypatch.setattr(dots, "keep_apart", lambda *a: margins.append(a[4]) or True)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    ws = [jax.random.normal(k1, (24, 48)) / 5, jax.random.normal(k2, (48, 16)) / 7]
    x = jax.random.normal(k3, (8, 12, 24))
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    for a, b in zip(plain(ws, x), kept(ws, x)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    assert _lhs_first_dim_dots(_compiled(plain, ws, x)) == 2  # one per kernel: folded
    assert _lhs_first_dim_dots(_compiled(kept, ws, x)) == 0
    assert set(margins) == {dots.MARGIN_SEVERAL}


def test_a_token_gradient_timed_folded_is_left_to_xla(monkeypatch):
    """With few tokens the kept pair's transposes cost more than the dots
    (a 12 x 768 GPT on 32 tokens: the step 0.59x): timed so, the program is
    XLA's own."""
    monkeypatch.setattr(dots, "keep_apart", lambda *a: False)
    ws = [jnp.ones((24, 48)) / 5, jnp.ones((48, 16)) / 7]
    x = jnp.ones((8, 12, 24))
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    assert _instructions(_compiled(kept, ws, x)) == _instructions(_compiled(plain, ws, x))


def test_a_checkpointed_gpt_gradient_is_unchanged(monkeypatch):
    """Nested jits and checkpointed blocks' backward passes are rewritten too:
    a checkpointed block recomputes inside a conditional."""
    monkeypatch.setattr(dots, "keep_apart", lambda *a: True)  # as timed on larger shapes
    model = gpt.GPT(256, 16, layers=2, width=32, heads=2, remat="block", rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
        return optax.softmax_cross_entropy_with_integer_labels(m(x[:, :-1]), x[:, 1:]).mean()

    x = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)
    # Each compiled once, both read and run: op by op, the gradients took 20 s.
    plain, kept = (jax.jit(f).lower(params, x).compile()
                   for f in (jax.grad(loss), for_xla_cpu(jax.grad(loss))))
    for a, b in zip(jax.tree.leaves(plain(params, x)), jax.tree.leaves(kept(params, x))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    assert _lhs_first_dim_dots(plain.as_text()) > 0
    assert _lhs_first_dim_dots(kept.as_text()) == 0
    assert kept.as_text().count(" conditional(") == 2  # one per block


def test_a_model_the_rewrite_cannot_take_trains_without_it(monkeypatch):
    def refuse(*args):
        raise NotImplementedError("a primitive it does not know")

    monkeypatch.setattr("dpax.xla_cpu.backward._eval", refuse)
    monkeypatch.setattr(dots, "keep_apart", lambda *a: True)  # a pair to rewrite
    ws = [jnp.ones((4, 6)) / 3]
    x = jnp.ones((2, 3, 4))
    with pytest.warns(UserWarning, match="training without it"):
        got = for_xla_cpu(jax.grad(_dense_loss))(ws, x)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(jax.grad(_dense_loss)(ws, x)[0]))


def test_a_transposed_literal_is_left_as_it_is():
    def f(w):  # a scalar constant transposed: a jaxpr Literal, not a dot's result
        return jax.lax.transpose(2.0, ()) * jnp.sum(w)

    w = jnp.arange(3.0)
    assert float(for_xla_cpu(f)(w)) == float(f(w))


def _dense_2d():
    return [jnp.ones((24, 48)) / 5, jnp.ones((48, 16)) / 7], jnp.ones((8, 24))


def test_a_2d_dense_gradient_timed_folded_is_left_to_xla(monkeypatch):
    """On [batch, features] the weight gradient's dot contracts one dimension,
    and which form is faster depends on the shapes (`dpax.xla_cpu.dots`):
    where the folded one is, the program is unchanged."""
    monkeypatch.setattr(dots, "keep_apart", lambda *a: False)
    ws, x = _dense_2d()
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    # The same instructions; the barrier would have left each weight gradient
    # in a transposed layout and added a copy of it after its dot.
    assert _instructions(_compiled(kept, ws, x)) == _instructions(_compiled(plain, ws, x))


def test_a_2d_dense_gradient_timed_apart_keeps_its_values(monkeypatch):
    seen = []
    monkeypatch.setattr(dots, "keep_apart", lambda lhs, rhs, params, perm, *_: seen.append(
        (lhs.shape, rhs.shape, perm)) or True)
    ws, x = _dense_2d()
    plain, kept = jax.grad(_dense_loss), for_xla_cpu(jax.grad(_dense_loss))
    for a, b in zip(plain(ws, x), kept(ws, x)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    # Apart, each weight gradient's dot writes JAX's [out, in] order (the
    # gradient in a column-major layout) and a copy transposes it; folded, it
    # writes the [in, out] row-major gradient itself.
    assert _transposed_dots(_compiled(plain, ws, x)) == 0
    assert _transposed_dots(_compiled(kept, ws, x)) == 2
    # Asked with the dot's own operands: (cotangent, input) of each layer.
    assert {(lhs, rhs) for lhs, rhs, _ in seen} == {((8, 16), (8, 48)), ((8, 48), (8, 24))}


_SPEC = (jax.ShapeDtypeStruct((64, 10), jnp.float32), jax.ShapeDtypeStruct((64, 64), jnp.float32),
         {"dimension_numbers": (((0,), (0,)), ((), ())), "preferred_element_type": None}, (1, 0))


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    """An empty choice cache and no choice made in this process."""
    monkeypatch.setenv("DPAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dots, "_decided", {})
    return tmp_path / dots.DIR


def test_a_shape_is_timed_once_per_machine(fresh_choices, monkeypatch):
    """The first run on a machine times a shape and keeps the choice; later
    processes (a resumed run, other ranks) read it and time nothing: they
    must take the same dot, whose last bits can differ between the forms."""
    monkeypatch.setattr(dots, "seconds", lambda *a: {"folded": 3e-4, "apart": 1e-4})
    assert dots.keep_apart(*_SPEC) is True
    [kept] = fresh_choices.iterdir()
    assert json.loads(kept.read_text())["apart"] is True

    def never(*a):
        raise AssertionError("timed again")

    monkeypatch.setattr(dots, "seconds", never)
    monkeypatch.setattr(dots, "_decided", {})  # a new process
    assert dots.keep_apart(*_SPEC) is True


@pytest.mark.parametrize("folded,apart,chosen", [
    (3e-4, 1e-4, True), (1.2e-4, 1e-4, False), (1e-4, 2e-4, False),
    (3e-5, 1e-5, False)])  # a call of microseconds: its timing is noise
def test_the_pair_is_kept_apart_only_by_a_clear_margin(fresh_choices, monkeypatch, folded,
                                                        apart, chosen):
    monkeypatch.setattr(dots, "seconds", lambda *a: {"folded": folded, "apart": apart})
    assert dots.keep_apart(*_SPEC) is chosen


def test_a_dot_too_small_to_time_stays_folded_untimed(fresh_choices, monkeypatch):
    """Below MIN_MACS a call is all dispatch: no timing, no choice kept."""
    def never(*a):
        raise AssertionError("timed")

    monkeypatch.setattr(dots, "seconds", never)
    lhs, rhs, params, perm = _SPEC
    small = jax.ShapeDtypeStruct((8, 10), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32)
    assert dots.macs(*small, params["dimension_numbers"]) == 8 * 10 * 64 < dots.MIN_MACS
    assert dots.keep_apart(*small, params, perm) is False
    assert not fresh_choices.exists()
    # Batch dimensions count once: 4 x (8 x 8 outputs x 16 summed).
    batched = (jax.ShapeDtypeStruct((4, 16, 8), jnp.float32),
               jax.ShapeDtypeStruct((4, 16, 8), jnp.float32))
    assert dots.macs(*batched, (((1,), (1,)), ((0,), (0,)))) == 4 * 8 * 8 * 16
    assert dots.macs(lhs, rhs, params["dimension_numbers"]) >= dots.MIN_MACS  # the others' shape


def test_the_first_process_to_decide_wins(fresh_choices):
    spec = {"lhs": "a shape"}
    key = dots.key_of(spec)
    assert dots._write_once(key, spec, False) is False  # another process, first
    assert dots._write_once(key, spec, True) is False  # this one takes its choice
    assert [p.name for p in fresh_choices.iterdir()] == [f"{key}.json"]  # no temp file left


def test_an_unreadable_choice_is_timed_again(fresh_choices, monkeypatch):
    monkeypatch.setattr(dots, "seconds", lambda *a: {"folded": 3e-4, "apart": 1e-4})
    assert dots.keep_apart(*_SPEC) is True
    [kept] = fresh_choices.iterdir()
    kept.write_text("{not json")
    monkeypatch.setattr(dots, "_decided", {})
    assert dots.keep_apart(*_SPEC) is True  # its own timing; the broken file stays


def test_both_forms_are_timed_on_the_shapes_asked():
    t = dots.seconds(*_SPEC)
    assert set(t) == {"folded", "apart"}
    assert all(0 < v < 10 for v in t.values())


@pytest.mark.parametrize("shape,window,kind", [
    ((4, 9, 7, 3), (1, 2, 2, 1), "max"),  # odd sides: the last row/column is in no window
    ((2, 6, 6, 2), (1, 3, 2, 1), "max"),
    ((3, 10, 4), (1, 3, 1), "min"),
    ((5, 12), (1, 4), "max")])
def test_non_overlapping_pools_and_their_gradients_keep_their_bits(shape, window, kind):
    """Rewritten into reshapes and a one-hot choice: the same outputs and
    gradients as `reduce_window` and `select_and_scatter_add`, ties (integer
    inputs) going to the first element of the window, as XLA defines it."""
    init, op = (-jnp.inf, jax.lax.max) if kind == "max" else (jnp.inf, jax.lax.min)

    def loss(x):
        y = jax.lax.reduce_window(x, init, op, window, window, "VALID")
        return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape)), y

    rng = np.random.default_rng(0)
    for x in (rng.integers(-2, 3, shape).astype(np.float32),
              rng.normal(size=shape).astype(np.float32)):
        plain, kept = jax.grad(loss, has_aux=True), for_xla_cpu(jax.grad(loss, has_aux=True))
        for a, b in zip(plain(x), kept(x)):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        assert not _windowed_ops(_compiled(kept, x))
        assert _windowed_ops(_compiled(plain, x))  # XLA's own: a windowed loop and a scatter


def test_an_overlapping_pool_is_left_to_xla():
    def loss(x):
        return nnx.max_pool(x, (3, 3), strides=(2, 2)).sum()

    x = jnp.ones((2, 9, 9, 1))
    assert _windowed_ops(_compiled(for_xla_cpu(jax.grad(loss)), x)) == {"reduce-window", "scatter"}
