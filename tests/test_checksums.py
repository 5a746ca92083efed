"""A step directory's checksums (`dpax.training.checksums`): every kind of
damage is found and named, in the same words whichever processes look."""

import json
import os

import pytest

from dpax.training import checksums


@pytest.fixture
def step_dir(tmp_path):
    """A step directory shaped like Orbax's, its manifest written."""
    files = {"state/manifest.ocdbt": b"m" * 10, "state/d/big": os.urandom(3 << 20),
             "state/d/small": b"s" * 100, "meta/metadata": b"{}", "data/p.json": b"[]"}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(tmp_path / rel), exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    (tmp_path / "_CHECKPOINT_METADATA").write_text("{}")
    checksums.write(str(tmp_path))
    return tmp_path


def flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_an_intact_step_passes_and_orbax_rewriting_its_metadata_does_not_matter(step_dir):
    listed = json.loads((step_dir / checksums.MANIFEST).read_text())["files"]
    assert sorted(listed) == ["data/p.json", "meta/metadata", "state/d/big", "state/d/small",
                              "state/manifest.ocdbt"]
    (step_dir / "_CHECKPOINT_METADATA").write_text('{"commit_timestamp_nsecs": 1}')
    (step_dir / "commit_success.txt").write_text("written after the manifest")
    assert checksums.check(str(step_dir)) is None


@pytest.mark.parametrize("damage,words", [
    (lambda d: flip(d / "state/d/big", 1 << 20), "state/d/big does not match its checksum"),
    (lambda d: os.truncate(d / "state/d/small", 50), "state/d/small changed size"),
    (lambda d: os.remove(d / "meta/metadata"), "meta/metadata is missing"),
    (lambda d: os.remove(d / checksums.MANIFEST), "it has no dpax_checksums.json"),
    (lambda d: (d / checksums.MANIFEST).write_text('{"files": '), "dpax_checksums.json is "
                                                                  "damaged"),
    (lambda d: (d / checksums.MANIFEST).write_text(
        '{"format": 1, "algorithm": "crc32", "files": {}}'), "dpax_checksums.json is damaged"),
])
def test_each_kind_of_damage_is_found_and_named(step_dir, damage, words):
    damage(step_dir)
    found = checksums.check(str(step_dir))
    assert found is not None and words in found.text, found


def test_the_files_are_shared_out_whole_and_by_size():
    sizes = [100, 1, 50, 50, 7, 3, 90]
    names = [f"f{i}" for i in range(len(sizes))]
    files = {n: {"bytes": b} for n, b in zip(names, sizes)}
    shares = [checksums.share(names, files, p, 3) for p in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(len(names)))
    loads = [sum(sizes[i] for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes) // 2  # not all the big ones on one


def test_processes_that_check_a_share_each_agree_with_one_that_checks_all(step_dir):
    flip(step_dir / "state/d/small", 3)
    flip(step_dir / "state/d/big", 5)
    alone = checksums.check(str(step_dir))
    found = [checksums.check(str(step_dir), p, 3) for p in range(3)]
    least = min(f.rank for f in found if f is not None)  # what `distributed.least` agrees on
    assert least == alone.rank
    assert checksums.damage(str(step_dir), least) == alone  # named alike by every process
    assert any(f is None for f in found)  # a process whose share is intact


def test_a_file_system_that_cannot_map_files_gets_the_same_checksums(step_dir, monkeypatch):
    """Where mmap fails (some FUSE mounts), the files are read in blocks."""
    import mmap

    def unmappable(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", unmappable)
    monkeypatch.setattr(checksums, "_BLOCK", 1 << 20)  # several blocks for the 3 MiB file
    assert checksums.check(str(step_dir)) is None
    flip(step_dir / "state/d/big", 2 << 20)
    assert "state/d/big does not match its checksum" in checksums.check(str(step_dir)).text
