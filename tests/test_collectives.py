"""The order of dpax's cross-device sums: the root cause of issue 15.

XLA:CPU's in-process all-reduce adds the devices' values in rank order; across
processes (gloo) the order differs, and a near-tie in a max-pool turned that
last bit into a 1e-3 parameter difference. dpax adds in rank order itself
across processes; these tests pin both halves in one process: XLA's order is
the rank order, and dpax's emulation gives XLA's bits. (The 2-process side is in
test_multiprocess.py.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpax.parallel import collectives
from dpax.parallel.collectives import PACK_MAX, psum_tree
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


def test_synced_sum_values_and_gradients_are_the_same_in_both_orders():
    """SyncBatchNorm's sums: forward and backward through `synced_sum`."""
    x = values(4, 33)
    mesh = Mesh(np.array(jax.devices()[:4]), (AXIS,))

    def loss_and_grad(v):
        def local(v):  # a per-device loss of the replicated sums, as in BatchNorm
            replicated, per_device = collectives.synced_sum((v, jnp.sum(v)), AXIS)
            return jnp.sum(jnp.sin(per_device[0]) * v) / per_device[1] + 0 * replicated[1]
        value, grad = jax.value_and_grad(local)(v[0])
        return value[None], grad[None]

    def both():
        f = jax.jit(jax.shard_map(loss_and_grad, mesh=mesh, in_specs=P(AXIS),
                                  out_specs=(P(AXIS), P(AXIS))))
        return [np.asarray(a) for a in f(x)]

    native = both()
    with collectives.force_rank_order():
        emulated = both()
    for a, b in zip(native, emulated):
        np.testing.assert_array_equal(a, b)
    # The gradient is the sum over devices: check it against finite reasoning.
    total = x.sum(0)
    s = total.sum()
    expect = (np.sin(total) + (np.cos(total) * x).sum(0)) / s - (np.sin(total) * x).sum() / s**2
    np.testing.assert_allclose(native[1][0], expect, rtol=2e-4)


def test_psum_tree_packed_sums_like_psum_in_one_buffer_per_dtype():
    """The step's all-reduce: small leaves packed per dtype, large ones as they
    are (the XLA:CPU tuning); unpacked (the generic path) it is psum itself."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), (AXIS,))
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(4, 3, 5)).astype(np.float32),
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

    assert all_reduces(plain_text) == all_reduces(unpacked_text) == len(tree) == 10
    assert all_reduces(text) == 4  # packed f32, s32 and bf16, and the big leaf
