"""load/sources.py (issue 54): the memory tier is one more ``HostReader`` to the load flow. Each copy of a step is
read alike, newest first, a copy that does not verify passing the load to the next; what a load asks of a source
beyond reading (the steps a whole load can read, the newest, the step a path names) comes from its listing."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from persist_core import CheckpointEngine, CorruptCheckpointError
from persist_core.assembly.blocks import LoadStats
from persist_core.assembly.plan import LoadOptions
from persist_core.format.manifest import Manifest
from persist_core.load.sources import held_steps, newest, read_copies, step_at
from persist_core.memory import MemoryStore, Snapshot
from persist_core.tiers import LocalTier, RemoteTier, Tier, TierReader
from persist_core.tiers.local import checkpoint_dir, read_manifest
from persist_core.tiers.tier import CheckpointInfo, HostReader


def _saved(tmp_path: Path, step: int = 5) -> tuple[dict, Manifest, Path]:
    """A one-process checkpoint on disk: its state, manifest and single shard file."""
    w = torch.arange(4096, dtype=torch.float32)
    state = {"w": w, "tied": w, "n": 7}
    with CheckpointEngine(tmp_path / "ckpt") as engine:
        engine.save(state, step)
    manifest = read_manifest(checkpoint_dir(tmp_path / "ckpt", step))
    return state, manifest, checkpoint_dir(tmp_path / "ckpt", step) / manifest.files[0].name


def _copy(src: Path, dst: Path, *, flip_at: int | None = None) -> Path:
    shutil.copyfile(src, dst)
    if flip_at is not None:
        with open(dst, "r+b") as f:
            f.seek(flip_at)
            byte = f.read(1)
            f.seek(flip_at)
            f.write(bytes([byte[0] ^ 0xFF]))
    return dst


def _read(copies, step, into=None):
    with ThreadPoolExecutor(2) as pool:
        return read_copies(copies, step, into, what="memory", options=LoadOptions(), pool=pool, stats=LoadStats())


def test_the_read_sides_are_split_by_what_each_tier_holds(tmp_path):
    """Disk: a checkpoint tier and a host reader; remote: a checkpoint tier, no host reader; memory: a host reader
    (its store and each slot's copy), never a checkpoint tier (nothing prunes or verifies it as one)."""
    local = LocalTier(tmp_path)
    assert isinstance(local, Tier) and isinstance(local, HostReader) and local.copies(3) == [local]
    remote = RemoteTier(f"memory://{tmp_path.name}/remote")
    assert isinstance(remote, Tier) and not isinstance(remote, HostReader)
    store = MemoryStore(tmp_path / "run" / "rank-0", identity="x")
    _, manifest, _ = _saved(tmp_path)
    snap = Snapshot(manifest, tmp_path / "slot")
    for memory in (store, snap):
        assert isinstance(memory, HostReader) and isinstance(memory, TierReader) and not isinstance(memory, Tier)
    assert snap.copies(manifest.step) == [snap] and snap.copies(manifest.step + 1) == []


def test_a_copy_that_does_not_verify_passes_the_load_to_the_older_one(tmp_path, caplog):
    state, manifest, shard = _saved(tmp_path)
    bad = Snapshot(manifest, _copy(shard, tmp_path / "slot-0", flip_at=manifest.files[0].size - 8))
    good = Snapshot(manifest, _copy(shard, tmp_path / "slot-1"))
    with caplog.at_level(logging.WARNING):
        loaded, got = _read([bad, good], manifest.step)
    assert got is manifest and torch.equal(loaded["w"], state["w"]) and loaded["n"] == 7
    assert loaded["w"].untyped_storage().data_ptr() == loaded["tied"].untyped_storage().data_ptr()  # shared as saved
    assert "slot-0" in caplog.text and f"step={manifest.step}" in caplog.text
    into = {"w": torch.zeros(4096), "tied": torch.zeros(4096), "n": 0}
    loaded, _ = _read([bad, good], manifest.step, into)
    assert loaded["w"] is into["w"] and torch.equal(into["w"], state["w"])
    with pytest.raises(CorruptCheckpointError):
        _read([bad], manifest.step)
    with pytest.raises(CorruptCheckpointError, match="no memory copy of step=5"):
        _read([], manifest.step)


def test_a_slot_longer_than_its_image_reads_and_a_missing_one_is_a_corrupt_copy(tmp_path):
    state, manifest, shard = _saved(tmp_path)
    longer = _copy(shard, tmp_path / "slot-0")
    with open(longer, "ab") as f:
        f.write(b"\0" * 4096)  # a slot is the size of the largest snapshot it held
    loaded, _ = _read([Snapshot(manifest, longer)], manifest.step)
    assert torch.equal(loaded["w"], state["w"])
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        _read([Snapshot(manifest, tmp_path / "gone")], manifest.step)


class _Listed:
    """A TierReader's listing, for the questions a load asks of it."""

    kind = "memory"
    location = "listed"

    def __init__(self, *copies: tuple[int, int | None, str]) -> None:  # (step, part, path), oldest first
        self._copies = copies

    def committed_steps(self) -> list[int]:
        return sorted({s for s, _, _ in self._copies})

    def list(self) -> list[CheckpointInfo]:
        return [CheckpointInfo(step=s, time=0.0, nbytes=1, path=p, tier="memory") for s, _, p in self._copies]

    def read_manifest(self, step: int) -> Manifest:
        part = next(part for s, part, _ in reversed(self._copies) if s == step)
        return dataclasses.replace(_MANIFEST, step=step, part=part)

    def read_blocks(self, *args, **kwargs) -> None:
        raise AssertionError("not read")


_MANIFEST = Manifest(step=0, time=0.0, world_size=1, tree={}, tensors=(), objects=(), files=())


@pytest.mark.parametrize(("copies", "newer_than", "whole", "latest"), [
    ([], -1, set(), None),
    ([(3, None, "/a"), (4, None, "/b")], -1, {3, 4}, "/b"),
    ([(3, None, "/a"), (4, None, "/b")], 4, {3, 4}, None),  # the disk holds step 4 already
    ([(3, None, "/a"), (4, 1, "/b")], -1, {3}, "/a"),  # step 4 is a rank's part of sharded tensors: targets only
    ([(3, None, "/a"), (3, None, "/b")], 2, {3}, "/b"),  # a step in two slots: the newer written
])
def test_what_a_load_asks_of_a_sources_listing(copies, newer_than, whole, latest):
    source = _Listed(*copies)
    assert held_steps(source) == {s for s, _, _ in copies}
    assert held_steps(source, whole=True) == whole
    found = newest(source, newer_than=newer_than)
    assert (found and found.path) == latest
    for step, _, path in copies:
        assert step_at(source, path) == step
    assert step_at(source, "/elsewhere") is None
