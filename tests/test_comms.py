"""Each state layout's compiled step moves the least its layout needs: counted
from XLA's optimized HLO (`dpax.parallel.comms`), against the gradient and
param bytes in their stored shapes."""

import pytest

from dpax.bench.baselines import compiled_step, step_comms
from dpax.bench.workloads import WORKLOADS
from dpax.parallel import comms
from dpax.training.trainer import Trainer

SCALARS = 64 * 4  # loss, count and metric sums ride along in the step's all-reduce


def test_parser_counts_each_kind_and_its_logical_bytes():
    hlo = """
  %all-reduce.1 = (f32[10]{0}, bf16[4,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1}}
  %reduce-scatter.2 = f32[3,5]{1,0} reduce-scatter(%c), dimensions={0}
  %all-gather.3 = f32[12]{0} all-gather(%d), dimensions={0}
  %ags = (f32[3]{0}, f32[12]{0}) all-gather-start(%e), dimensions={0}
  %agd = f32[12]{0} all-gather-done(%ags)
  ROOT %ars = s32[2]{0} all-reduce-start(%f), to_apply=%add
  %add.9 = f32[10]{0} add(%x, %y)
"""
    found = comms.collectives(hlo, n=4)
    assert found == [comms.Collective("all-reduce", 40 + 64),
                     comms.Collective("reduce-scatter", 4 * 60),
                     comms.Collective("all-gather", 48), comms.Collective("all-gather", 48),
                     comms.Collective("all-reduce", 8)]
    assert comms.summary(found)["all-gather"] == {"count": 2, "bytes": 96}
    assert comms.wire_bytes("all-reduce", 100, 4) == 150
    assert comms.wire_bytes("all-gather", 100, 4) == 75


# Replicated shard_map on 8 devices only: what its one all-reduce moves does
# not depend on N (2 compiled the same step to count the same bytes).
@pytest.mark.parametrize("workload,n,backend,layout", [
    ("mlp", 8, "shard_map", "replicated"),
    ("mlp", 4, "pmap", "replicated"), ("mlp", 3, "shard_map", "optimizer"),
    ("mlp", 8, "shard_map", "full"),
    pytest.param("gpt", 4, "shard_map", "replicated", marks=pytest.mark.slow),
    pytest.param("gpt", 4, "shard_map", "optimizer", marks=pytest.mark.slow),
    pytest.param("gpt", 4, "shard_map", "full", marks=pytest.mark.slow)])
def test_each_layout_moves_the_least_it_needs(workload, n, backend, layout):
    w = WORKLOADS[workload]
    t = Trainer(w.make(), w.loss(), w.tx(), devices=n, backend=backend, sharding=layout)
    c = step_comms(t, compiled_step(t, w.batch_size, w))
    found, least, padded = c["found"], c["minimum"], c["padded"]
    print(f"{workload} {layout} x{n} ({backend}): {found}; least {least}")
    if layout == "replicated":
        g = least["all-reduce"]
        assert least == padded == {"all-reduce": g}
        # One all-reduce: the gradients and the scalars packed together.
        assert set(found) == {"all-reduce"} and found["all-reduce"]["count"] == 1
        assert g <= found["all-reduce"]["bytes"] <= g + SCALARS
    else:
        g = least["reduce-scatter"]
        assert least == {"reduce-scatter": g, "all-gather": g}
        # Each gradient reduce-scattered once and each param gathered once, in
        # the padded shapes the layout splits (under 1% more here), no more; an
        # all-reduce only for the scalars.
        for kind in ("reduce-scatter", "all-gather"):
            assert found[kind]["bytes"] == padded[kind] <= 1.01 * g
        assert set(found) <= {"reduce-scatter", "all-gather", "all-reduce"}
        assert found.get("all-reduce", {"bytes": 0})["bytes"] <= SCALARS
