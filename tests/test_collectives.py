"""The order of dpax's cross-device sums, and sums that do not depend on it.

XLA:CPU's in-process all-reduce adds the devices' values in rank order; across
processes (gloo) the order differs, and a near-tie in a max-pool turned that
last bit into a 1e-3 parameter difference. dpax adds in rank order itself
across processes; these tests pin both halves in one process: XLA's order is
the rank order, and dpax's emulation gives XLA's bits. (The 2-process side is in
test_multiprocess.py.) One device and N devices add a batch's rows in
different orders, which no rank order fixes: the exact sums BatchNorm's
statistics use have the same bits for any split.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpax import collectives
from dpax.collectives import PACK_MAX, SCALAR_MAX, psum_tree
from dpax.parallel.mesh import AXIS


def values(n, size, seed=0):
    """Per-device values of one magnitude, where any change of order shows."""
    return (np.random.default_rng(seed).random((n, size)) * 100).astype(np.float32)


REPLICATED = P()


def run(fn, x, out_specs=REPLICATED):
    mesh = Mesh(np.array(jax.devices()[: len(x)]), (AXIS,))
    return np.asarray(jax.jit(jax.shard_map(lambda v: fn(v[0]), mesh=mesh, in_specs=P(AXIS),
                                            out_specs=out_specs))(x))


def rank_order(x):
    acc = np.zeros_like(x[0])
    for row in x:
        acc = acc + row
    return acc


@pytest.mark.parametrize("n", [2, 4, 8])
def test_xla_cpu_adds_the_devices_in_rank_order(n):
    """The assumption the emulation rests on; a JAX upgrade that breaks it fails here."""
    x = values(n, 129)
    np.testing.assert_array_equal(run(lambda v: jax.lax.psum(v, AXIS), x), rank_order(x))
    if n > 2:  # two terms commute; from three on, another order shows
        assert not np.array_equal(rank_order(x[::-1]), rank_order(x))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_rank_order_emulation_gives_xlas_bits(n):
    x = values(n, 1000, seed=n)
    native = run(lambda v: collectives.psum_tree({"v": v}, AXIS, pack=True)["v"], x)
    with collectives.force_rank_order():
        emulated = run(lambda v: collectives.psum_tree({"v": v}, AXIS, pack=True)["v"], x)
        scattered = run(lambda v: collectives.reduce_scatter(v, AXIS), x[:, :n * 50],
                        out_specs=P(AXIS))
    np.testing.assert_array_equal(emulated, native)
    np.testing.assert_array_equal(
        scattered, run(lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True), x[:, :n * 50],
                       out_specs=P(AXIS)))


def test_two_sum_keeps_the_rounding_error_exactly():
    rng = np.random.default_rng(0)
    a = (rng.normal(size=1000) * 10.0 ** rng.integers(-8, 8, 1000)).astype(np.float32)
    b = (rng.normal(size=1000) * 10.0 ** rng.integers(-8, 8, 1000)).astype(np.float32)
    s, e = jax.jit(collectives.two_sum)(a, b)
    exact = a.astype(np.float64) + b.astype(np.float64)
    np.testing.assert_array_equal(np.asarray(s, np.float64) + np.asarray(e, np.float64), exact)


def _exact_totals(x, n):
    """`exact_sums` of the rows of x split over n devices (the first rows on
    device 0, ...), as the replicated totals, and the gradient of a loss of them."""
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))

    def per_device(v):
        def loss(v):  # every device's share of sum(sin(s1) + s2): the devices add up to it
            replicated, per_dev = collectives.exact_sums((v, jnp.square(v)), AXIS)
            return jnp.sum(jnp.sin(per_dev[0]) + per_dev[1]) / n + 0 * jnp.sum(replicated[0])
        value, grad = jax.value_and_grad(loss)(v)
        totals, _ = collectives.exact_sums((v, jnp.square(v)), AXIS)
        return totals, grad

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS),
                              out_specs=((P(), P()), P(AXIS)), check_vma=n > 1))
    return f(x)


@pytest.mark.parametrize("rows", [61, 64, 7])
def test_exact_sums_have_the_same_bits_on_any_device_count(rows):
    """SyncBatchNorm's statistics: the sums of a batch's rows have the same bits
    on 1, 2, 4 and 8 devices (padded rows are zeros, as masked rows are), and
    are the correctly rounded sums; the gradient is a plain sum's."""
    rng = np.random.default_rng(rows)
    x = (rng.normal(size=(rows, 300)) + rng.normal(size=300) * 5).astype(np.float32)
    results = {}
    for n in (1, 2, 4, 8):
        padded = np.zeros((-(-rows // n) * n, 300), np.float32)
        padded[:rows] = x
        (s1, s2), grad = _exact_totals(padded, n)
        results[n] = (np.asarray(s1), np.asarray(s2), np.asarray(grad)[:rows])
    for n in (2, 4, 8):
        np.testing.assert_array_equal(results[n][0], results[1][0])
        np.testing.assert_array_equal(results[n][1], results[1][1])
        np.testing.assert_allclose(results[n][2], results[1][2], rtol=1e-6, atol=1e-6)
    exact = np.array([math.fsum(c) for c in x.astype(np.float64).T], np.float32)
    assert np.mean(results[1][0] == exact) >= 0.99  # correctly rounded, but for rare ties
    # The gradient of sum(sin(s1) + s2) is cos(s1) + 2 x, for every row.
    np.testing.assert_allclose(results[1][2], np.cos(results[1][0]) + 2 * x, rtol=1e-5,
                               atol=1e-5)


def test_psum_tree_packed_sums_like_psum_in_one_buffer_per_dtype():
    """The step's all-reduce: small leaves packed per dtype, large ones as they
    are (the XLA:CPU tuning); on the generic path only the scalar-sized leaves
    (<= SCALAR_MAX elements: a step's loss, count and metric sums) are."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (AXIS,))
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(4, 3, 7)).astype(np.float32),
            "b": rng.normal(size=(4,)).astype(np.float32),
            "c": rng.integers(-9, 9, (4, 7)).astype(np.int32),
            "h": rng.normal(size=(4, 2)).astype(jnp.bfloat16),
            "big": rng.normal(size=(4, PACK_MAX + 1)).astype(np.float32)}

    def reduce(fn):
        mapped = jax.shard_map(lambda t: fn(jax.tree.map(lambda x: x[0], t), AXIS), mesh=mesh,
                               in_specs=P(AXIS), out_specs=P())
        return jax.jit(mapped)(tree), jax.jit(mapped).lower(tree).as_text()

    for i in range(5):
        tree[f"small{i}"] = rng.normal(size=(4, i + 1)).astype(np.float32)
    packed, text = reduce(lambda t, axis: psum_tree(t, axis, pack=True))
    unpacked, unpacked_text = reduce(psum_tree)
    plain, plain_text = reduce(jax.lax.psum)
    for k in tree:
        for got in (packed, unpacked):
            assert got[k].dtype == plain[k].dtype and got[k].shape == plain[k].shape
            np.testing.assert_array_equal(np.asarray(got[k], np.float32),
                                          np.asarray(plain[k], np.float32))
    def all_reduces(text):  # JAX emits one per buffer; XLA may combine them later
        return len(re.findall(r'"stablehlo.all_reduce"', text))

    assert all_reduces(plain_text) == len(tree) == 10
    assert all_reduces(text) == 4  # packed f32, s32 and bf16, and the big leaf
    assert SCALAR_MAX >= 5 and SCALAR_MAX < 3 * 7  # the small leaves under it, "a" over it
    assert all_reduces(unpacked_text) == 5  # packed f32, s32 and bf16; "a"; the big leaf


@pytest.mark.parametrize("n", [1, 4])
def test_batchnorm_sums_have_the_bits_of_three_exact_sums(n):
    """SyncBatchNorm's statistics (`layers._global_sums`: the sums and squared
    sums stacked into one exact sum, the whole-number count a plain psum)
    have the bits of `exact_sums` of the three apart, totals and gradients."""
    from dpax.models.layers import _global_sums

    rng = np.random.default_rng(n)
    rows = 4 * 61
    x = (rng.normal(size=(rows, 40)) + rng.normal(size=40) * 5).astype(np.float32)
    count = (rng.random(rows) < 0.9).astype(np.float32) * 16  # masked rows x per_row
    mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))

    def per_device(v, c):
        def stats(total):
            def loss(v):
                replicated, per_dev = total((v, jnp.square(v), c))
                return jnp.sum(jnp.sin(per_dev[0] / per_dev[2]) + per_dev[1]) / n
            return total((v, jnp.square(v), c))[0], jax.grad(loss)(v)
        return (stats(lambda vals: _global_sums(vals, AXIS, rows * 16)),
                stats(lambda vals: collectives.exact_sums(vals, AXIS)))

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                              out_specs=(((P(), P(), P()), P(AXIS)),) * 2, check_vma=n > 1))
    (ours, our_grad), (theirs, their_grad) = f(x, count)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(our_grad), np.asarray(their_grad))
    assert float(ours[2]) == count.sum()
