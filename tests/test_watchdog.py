"""The watchdog times every wait of a multi-process run on its peers. One
process stands in for a stopped peer here: a device computation that takes
longer than the timeout (a host callback that sleeps), dispatched
asynchronously as a step's collective is. The watchdog's exit is recorded
instead of taken; its report (a line, then every thread's Python stack)
shows where the process waited."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dpax.cli.exits import EXIT_STALLED
from dpax.parallel import watchdog
from dpax.training.checkpoint import Checkpointer

TIMEOUT_S = 0.5
LATE_S = 2.5  # how long the stand-in peer keeps a device computation waiting


@pytest.fixture
def dog(tmp_path):
    """An installed watchdog; yields a function that returns (stalls, report)."""
    stalls = []
    report = tmp_path / "report.txt"
    with open(report, "w+") as out, watchdog.installed(
            TIMEOUT_S, rank=0, stream=out, on_stall=lambda: stalls.append(EXIT_STALLED)):
        yield lambda: (stalls, report.read_text())


def late(x: jax.Array) -> jax.Array:
    """`x`, ready only LATE_S after this returns (on two devices, so the
    dispatch does not wait for it)."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    replicated = NamedSharding(mesh, P())

    def wait(a):
        time.sleep(LATE_S)
        return np.asarray(a)

    slow = jax.jit(lambda v: jax.pure_callback(wait, jax.ShapeDtypeStruct(v.shape, v.dtype), v),
                   out_shardings=replicated)
    return slow(jax.device_put(x, replicated))


def test_a_save_whose_state_is_still_being_computed_is_timed(dog, tmp_path):
    """A save reads whether the state is finite before Orbax copies it: with
    the state split over processes that read waits on every peer (what hung
    a rank until JAX's heartbeat abort, without the watchdog's report)."""
    ckpt = Checkpointer(str(tmp_path / "ck"))
    ckpt.save(1, {"w": jnp.ones(4)}, None, {})  # Orbax's first save: its own setup
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path / "ck"))
    assert ckpt.save(7, {"w": late(jnp.ones(4))}, None, {})
    ckpt.close()
    exits, report = dog()
    assert exits == [EXIT_STALLED], report
    assert "rank 0 stalled: waited" in report and "at step 7" in report
    assert "in all_finite" in report  # where it waited: the finite check's read
    assert ckpt.steps() == [1, 7]  # the wait ended, and the save is whole


def test_a_wait_inside_a_wait_leaves_the_outer_one_timed(dog):
    with watchdog.waiting(3):
        with watchdog.waiting():  # e.g. a metrics read inside a save
            pass
        jax.block_until_ready(late(jnp.ones(4)))  # still inside the outer wait
    exits, report = dog()
    assert exits == [EXIT_STALLED], report
    assert "at step 3" in report


def test_no_report_while_nothing_waits(dog):
    """Host work and compiles are not waits: as long as they take, no report."""
    time.sleep(4 * TIMEOUT_S)
    exits, report = dog()
    assert exits == [] and report == ""
