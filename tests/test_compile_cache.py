"""The persistent compilation cache (`dpax.parallel.compile_cache`): a second
Trainer, run or resume reads its compiled steps from disk and trains the same
bits; `none` compiles everything afresh; a directory it cannot write is
refused before anything runs, through both entry points."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import fit_digits, leaves, mlp_trainer
from dpax.cli import main
from dpax.errors import DpaxError, DpaxWarning
from dpax.parallel import compile_cache

SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs", "jax_compilation_cache_max_size")


@pytest.fixture(autouse=True)
def _restore_jax_cache():
    """The cache is process-wide: each test leaves it as the session set it."""
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compile_cache.compilation_cache.reset_cache()
    compile_cache._off_by_dpax = False
    compile_cache._warned.clear()


@pytest.fixture
def cache_events():
    """Counts of JAX's cache hits and misses from here on."""
    counts = {"hits": 0, "misses": 0}

    def listen(event, **_):
        for kind in counts:
            if event == f"/jax/compilation_cache/cache_{kind}":
                counts[kind] += 1

    jax.monitoring.register_event_listener(listen)
    yield counts
    jax.monitoring.unregister_event_listener(listen)


def entries(path) -> list[str]:
    return [f for f in os.listdir(path) if f.endswith("-cache")]


def test_a_second_trainer_reads_its_steps_from_the_cache_and_trains_the_same_bits(
        tmp_path, cache_events):
    cache = str(tmp_path / "xla")
    first = mlp_trainer(2, compile_cache=cache)
    assert first.compile_cache == cache and jax.config.jax_compilation_cache_dir == cache
    fit_digits(first, 50, steps=3)
    written = entries(cache)
    assert written and cache_events["misses"] > 0

    cache_events.update(hits=0, misses=0)
    second = mlp_trainer(2, compile_cache=cache)  # new jit functions: only the disk has them
    fit_digits(second, 50, steps=3)
    assert cache_events["hits"] >= 1 and cache_events["misses"] == 0, cache_events
    assert entries(cache) == written
    for a, b in zip(leaves(first), leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_none_compiles_afresh_and_default_turns_it_on_again(cache_events):
    session = jax.config.jax_compilation_cache_dir
    t = mlp_trainer(2, compile_cache="none")
    assert t.compile_cache is None and not jax.config.jax_enable_compilation_cache
    fit_digits(t, 50, steps=2)
    assert cache_events == {"hits": 0, "misses": 0}
    assert mlp_trainer(1).compile_cache == session  # dpax turned it off, not the user
    with compile_cache.off():  # as `dpax bench` times compilations
        assert mlp_trainer(1).compile_cache is None
    assert jax.config.jax_enable_compilation_cache


def test_a_cache_the_user_turned_off_stays_off():
    jax.config.update("jax_enable_compilation_cache", False)  # JAX_ENABLE_COMPILATION_CACHE=false
    assert mlp_trainer(1).compile_cache is None
    assert not jax.config.jax_enable_compilation_cache


def test_default_keeps_the_directory_jax_was_given():
    session = jax.config.jax_compilation_cache_dir  # conftest's, as a user's own setting
    assert session and mlp_trainer(1).compile_cache == session


def test_the_default_directory_is_per_machine_under_dpax_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DPAX_CACHE_DIR", str(tmp_path))
    jax.config.update("jax_compilation_cache_dir", None)  # no directory given to JAX
    device = jax.devices()[0]
    path = compile_cache.use(compile_cache.DEFAULT, device)
    assert os.path.dirname(path) == str(tmp_path / "xla") and os.path.isdir(path)
    assert path == compile_cache.default_dir(device) == jax.config.jax_compilation_cache_dir
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_SECS
    assert jax.config.jax_compilation_cache_max_size == compile_cache.MAX_BYTES


def test_a_default_directory_that_cannot_be_written_means_no_cache_and_a_warning(
        tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    monkeypatch.setenv("DPAX_CACHE_DIR", str(a_file))  # as a home that cannot be written
    jax.config.update("jax_compilation_cache_dir", None)
    with pytest.warns(DpaxWarning, match="no compilation cache: .* cannot be written") as said:
        assert mlp_trainer(1).compile_cache is None
        assert mlp_trainer(1).compile_cache is None  # said once, as the CLI and its Trainer ask
    assert len(said) == 1 and jax.config.jax_compilation_cache_dir is None


def test_a_directory_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    with pytest.raises(DpaxError, match="cannot be written"):
        mlp_trainer(1, compile_cache=str(a_file / "xla"))
    with pytest.raises(DpaxError, match="`compile_cache` is empty"):
        mlp_trainer(1, compile_cache="")
    assert {name: getattr(jax.config, name) for name in SETTINGS} == before

    out = tmp_path / "run"
    code = main(["train", "--model", "mlp", "--steps", "2", "--devices", "1", "--quiet",
                 "--out", str(out), "--compile-cache", str(a_file / "xla")])
    said = capsys.readouterr().err.splitlines()
    assert code == 2 and len(said) == 1, said
    assert "--compile-cache" in said[0] and "cannot be written" in said[0], said
    assert not out.exists()


def test_a_resumed_run_compiles_nothing_its_first_run_compiled(tmp_path, cache_events):
    cache, ck = tmp_path / "xla", tmp_path / "ck"
    flags = ["--model", "mlp", "--batch-size", "50", "--devices", "2", "--log-every", "5",
             "--quiet", "--compile-cache", str(cache), "--checkpoint-dir", str(ck),
             "--checkpoint-every", "5"]
    assert main(["train", *flags, "--steps", "5", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "run.json").read_text())["compile_cache"] == str(cache)
    cache_events.update(hits=0, misses=0)
    assert main(["train", *flags, "--steps", "10", "--resume",
                 "--out", str(tmp_path / "b")]) == 0
    assert cache_events["hits"] > 0 and cache_events["misses"] == 0, cache_events
