"""Hybrid sharding (`replicas`): the devices in groups, the state split inside
a group and replicated across them, trains what one device trains; each
gradient crosses the groups once, as its slice; a checkpoint resumes across
a change of groups, layout and device count; bad counts are refused."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dpax
from conftest import digits, fit_digits, leaves, max_diff
from dpax.bench.baselines import compiled_step, step_comms
from dpax.bench.workloads import WORKLOADS
from dpax.cli import main
from dpax.errors import DpaxError
from dpax.models import losses
from dpax.parallel import comms
from dpax.parallel.layout import FSDP
from dpax.training.estimate import BETWEEN, INSIDE, link_bytes
from test_batchnorm_dropout import BatchNormMLP
from test_layout import BATCH, compare, trainer

SCALARS = 64 * 4  # loss, count and metric sums ride along in the across-groups all-reduce


@pytest.mark.parametrize("sharding,n,replicas", [("full", 4, 2), ("optimizer", 8, 4)])
def test_groups_train_what_one_device_trains(sharding, n, replicas):
    """Adam, an uneven batch of 61 rows, leaves padded inside each group."""
    t = trainer(n, "adam", sharding=sharding, replicas=replicas)
    assert dict(t.backend.mesh.shape) == {"replicas": replicas, "data": n // replicas}
    diff, rel = compare(t, "adam")
    print(f"{sharding} N={n} in {replicas} groups: params {diff:.2e}, loss curve rel {rel:.2e}")
    assert diff <= 1e-4 and rel <= 1e-4  # as test_layout holds Adam on one axis


def seeded_mlp(seed):
    ds = digits()
    return dpax.models.MLP(ds.input_shape, ds.n_out, hidden=23, rngs=nnx.Rngs(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("sharding,n,replicas", [("full", 4, 2), ("optimizer", 8, 4),
                                                 ("full", 6, 3)])
def test_groups_train_what_one_device_trains_from_several_seeds(sharding, n, replicas, seed):
    runs = []
    for devices, kw in ((1, {}), (n, {"sharding": sharding, "replicas": replicas})):
        t = dpax.Trainer(seeded_mlp(seed), dpax.classification_loss, optax.adam(3e-3),
                         devices=devices, **kw)
        fit_digits(t, BATCH)
        runs.append(leaves(t))
    diff = max_diff(*runs)
    print(f"{sharding} N={n} in {replicas} groups, seed {seed}: params {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.slow
def test_groups_with_batchnorm_dropout_and_accumulation_equal_one_device():
    """`dpax.check_equivalence` with the layout: BatchNorm statistics and
    dropout masks over the global batch whatever the groups."""
    ds = digits()
    result = dpax.check_equivalence(
        lambda: BatchNormMLP(ds.input_shape, ds.n_out, rngs=nnx.Rngs(1)),
        losses.classification_loss, ds.x_train, ds.y_train, devices=8, batch_size=61,
        steps=3, grad_accum=3, sharding="full", replicas=2)
    print(result.report())
    assert result.equivalent and max(result.param_diff, result.state_diff) <= 1e-5


@pytest.fixture(scope="module")
def fsdp_in_two_groups():
    w = WORKLOADS["mlp"]
    t = dpax.Trainer(w.make(), w.loss(), w.tx(), devices=8, sharding="full", replicas=2)
    return t, step_comms(t, compiled_step(t, w.batch_size, w))


def test_gathers_and_scatters_stay_in_a_group_and_a_slice_crosses(fsdp_in_two_groups):
    """From the compiled step's HLO: each param gathered and each gradient
    reduce-scattered once inside its group of 4, and only each device's
    gradient slice (1/4 of the gradients) all-reduced across the groups."""
    _, c = fsdp_in_two_groups
    found, least, padded = c["found"], c["minimum"], c["padded"]
    print(f"mlp full x8 in 2 groups: {found}; least {least}")
    across = comms.ACROSS + "all-reduce"
    assert set(found) == {"reduce-scatter", "all-gather", across}
    for kind in ("reduce-scatter", "all-gather"):
        assert found[kind]["bytes"] == padded[kind] <= 1.01 * least[kind]
    assert padded[across] <= found[across]["bytes"] <= padded[across] + SCALARS
    assert padded[across] == padded["reduce-scatter"] // 4


def test_each_device_holds_a_group_share_and_the_groups_the_same(fsdp_in_two_groups):
    t, _ = fsdp_in_two_groups
    for leaf in jax.tree.leaves(t.state.params):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
        assert shards[0].data.size * 4 == leaf.size  # a quarter of the padded leaf
        for a, b in zip(shards[:4], shards[4:]):  # group 2 holds what group 1 holds
            assert a.index == b.index
            np.testing.assert_array_equal(a.data, b.data)


def test_replica_groups_are_read_in_each_of_xlas_spellings():
    explicit = "%a = f32[4]{0} all-reduce(%x), replica_groups={{0,2},{1,3}}, to_apply=%add"
    iota = "%b = f32[4]{0} all-reduce(%x), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add"
    mesh = ("%c = f32[8]{0} all-gather(%x), replica_groups=mesh['axis_0'=2,'axis_1'=2], "
            "device_ids=([2,2]T(1,0)) {'axis_0'}, dimensions={0}")
    assert comms.replica_groups(explicit) == [[0, 2], [1, 3]]
    assert comms.replica_groups(iota) == [[0, 2], [1, 3]]
    # The mesh's axis_0 runs along device ids 0, 1 (ids laid [2,2] transposed).
    assert comms.replica_groups(mesh) == [[0, 1], [2, 3]]
    everyone = "%d = f32[4]{0} all-reduce(%x), replica_groups={}, to_apply=%add"
    found = comms.collectives("\n".join([explicit, iota, mesh, everyone]), 4, group=2)
    assert [c.across for c in found] == [True, True, False, True]


def test_the_estimate_counts_each_link_as_a_ring_over_its_devices():
    """32 devices, 8 per host: FSDP over all of them sends its gathers and
    scatters over the hosts' network; in 4 groups (one per host) only the
    all-reduce of a device's 1/8 slice does."""
    g = 8 * 2**20
    flat = FSDP.step_collectives({"w": jax.ShapeDtypeStruct((g // 4,), np.float32)}, 32)
    hybrid = FSDP.step_collectives({"w": jax.ShapeDtypeStruct((g // 4,), np.float32)}, 32,
                                   replicas=4)
    assert hybrid == {"reduce-scatter": g, "all-gather": g, comms.ACROSS + "all-reduce": g // 8}
    assert link_bytes(flat, 32, 1, 8) == {BETWEEN: 2 * g * 31 / 32}
    assert link_bytes(hybrid, 32, 4, 8) == {INSIDE: 2 * g * 7 / 8,
                                            BETWEEN: 2 * (g // 8) * 3 / 4}
    # Groups of 16 span two hosts, and groups of 6 straddle hosts of 8: their
    # own gathers cross too.
    for n, r in ((32, 2), (48, 8)):
        moved = FSDP.step_collectives({"w": jax.ShapeDtypeStruct((g // 4,), np.float32)}, n,
                                      replicas=r)
        assert set(link_bytes(moved, n, r, 8)) == {BETWEEN}


def test_the_estimate_holds_a_group_share_per_device():
    """8 devices in 2 groups hold what 4 devices hold without groups; a bad
    count is refused from Python as from the CLI."""
    from dpax.training.estimate import Hardware, estimate

    def est(devices, **kw):
        return estimate(lambda: dpax.models.MLP((64,), 10, hidden=23, rngs=nnx.Rngs(0)),
                        losses.classification_loss, optax.adam(1e-3),
                        {"x": jax.ShapeDtypeStruct((64,), np.float32),
                         "y": jax.ShapeDtypeStruct((), np.int32)},
                        batch_size=64, devices=devices, layout="optimizer", **kw)

    grouped, four = est(8, replicas=2), est(4)
    for part in ("params", "optimizer", "gradients", "update"):
        assert grouped.memory[part] == four.memory[part], part
    assert grouped.collectives[comms.ACROSS + "all-reduce"] > 0 and grouped.replicas == 2
    assert est(8, replicas="processes", hardware=Hardware(devices_per_host=4)).replicas == 2
    for bad in (3, 0, "hosts"):
        with pytest.raises(DpaxError, match="replicas"):
            est(8, replicas=bad)


def test_a_replicated_state_has_no_groups_and_says_so():
    with pytest.warns(dpax.DpaxWarning, match="changes nothing with `sharding=replicated`"):
        t = trainer(4, replicas=2)
    assert t.backend.replicas == 1 and dict(t.backend.mesh.shape) == {"data": 4}


def test_a_loss_that_sums_over_one_group_is_refused_before_training():
    """The pmap idiom `psum(x, "data")` sums every device without groups and
    one group's with them: refused there, before the first step."""
    def loss(model, batch):
        per_example, metrics = dpax.classification_loss(model, batch)
        m = batch["mask"].astype(np.float32)
        mean = jax.lax.psum((per_example * m).sum(), "data") / jax.lax.psum(m.sum(), "data")
        return per_example * (1 + 0.1 * mean), metrics

    flat = dpax.Trainer(seeded_mlp(0), loss, optax.adam(3e-3), devices=4, sharding="full")
    fit_digits(flat, BATCH, steps=1)  # one axis: the sum spans every device
    grouped = dpax.Trainer(seeded_mlp(0), loss, optax.adam(3e-3), devices=4, sharding="full",
                           replicas=2)
    with pytest.raises(DpaxError, match="psum over data, which with `replicas` spans one group"):
        fit_digits(grouped, BATCH, steps=1)
    assert int(grouped.state.step) == 0


@pytest.mark.parametrize("kw,says", [
    ({"devices": 4, "sharding": "full", "replicas": 3}, "does not divide the 4 devices"),
    ({"devices": 2, "sharding": "full", "replicas": 0}, "whole number >= 1 or 'processes'"),
    ({"devices": 2, "sharding": "full", "replicas": "hosts"}, "'processes'")])
def test_a_bad_group_count_is_refused_before_training(kw, says):
    with pytest.raises(DpaxError, match=says):
        trainer(kw.pop("devices"), **kw)


@pytest.mark.parametrize("flags,says", [
    (["--replicas", "3"], "--replicas 3 does not divide the 8 devices into equal groups; "
                          "use a divisor of the device count"),
    (["--replicas", "processes"], "--replicas processes makes one group per host: give "
                                  "--devices-per-host")])
def test_the_cli_refuses_a_bad_group_count_in_one_line(flags, says, capsys):
    assert main(["estimate", "--devices", "8", *flags, "--sharding", "full",
                 "--model", "mlp"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines() == [f"dpax: error: {says}"]


@pytest.mark.slow
def test_a_checkpoint_of_two_groups_resumes_in_one_and_on_three_devices(tmp_path, capsys):
    """Saved at step 10 by FSDP on 4 devices in 2 groups; resumed by FSDP on
    the 4 in one group, and by ZeRO-1 on 3 devices: each ends where the
    uninterrupted run does."""
    flags = ["--model", "mlp", "--optimizer", "adam", "--lr", "0.003", "--batch-size", "61",
             "--steps", "20", "--log-every", "5"]
    ck, ref = str(tmp_path / "ck"), str(tmp_path / "ref")
    assert main(["train", *flags, "--devices", "4", "--sharding", "full", "--replicas", "2",
                 "--checkpoint-dir", ck, "--checkpoint-every", "10", "--out", ref]) == 0
    assert "in 2 replica groups" in capsys.readouterr().out
    for name, more in (("one-group", ["--devices", "4", "--sharding", "full"]),
                       ("three", ["--devices", "3", "--sharding", "optimizer"])):
        out = str(tmp_path / name)
        assert main(["train", *flags, *more, "--resume", f"{ck}/10", "--out", out]) == 0
        with np.load(f"{ref}/params.npz") as a, np.load(f"{out}/params.npz") as b:
            diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
        print(f"2 groups -> {name}: max |diff| {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw-mask", "clip-global-norm", "lamb"])
@pytest.mark.parametrize("seed", [0, 1])
def test_optax_chains_that_look_at_shapes_and_norms_in_groups(name, seed):
    """User code unlike the bench's: transformations that read a leaf's rank,
    the global norm or a layer's trust ratio, on 6 devices in 3 groups."""
    from test_optax_layouts import BATCH as ROWS
    from test_optax_layouts import STEPS, TRANSFORMS, LayerNormMLP, data, one_device

    x, y = data()
    t = dpax.Trainer(LayerNormMLP(nnx.Rngs(seed)), dpax.classification_loss,
                     TRANSFORMS[name](), devices=6, sharding="full", replicas=3)
    t.fit(x, y, batch_size=ROWS, until_step=STEPS, seed=seed)
    diff = max_diff(jax.tree.leaves(t.params), one_device(name, seed))
    print(f"{name} seed {seed}, full on 6 in 3 groups: {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_a_linen_model_with_batchnorm_and_dropout_in_groups():
    from test_bridge import linen_cnn

    runs = []
    for devices, kw in ((1, {}), (4, {"sharding": "optimizer", "replicas": 2})):
        t = dpax.Trainer(linen_cnn(1), dpax.classification_loss, optax.sgd(0.05),
                         devices=devices, **kw)
        fit_digits(t, BATCH, steps=4)
        runs.append(leaves(t))
    diff = max_diff(*runs)
    print(f"Linen CNN, ZeRO-1 on 4 in 2 groups: {diff:.1e}")
    assert diff <= 1e-5
