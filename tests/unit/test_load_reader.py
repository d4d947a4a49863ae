"""Readers never write on the remote: with read-only credentials every read path works."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from click.testing import CliRunner
from fsspec.implementations.memory import MemoryFileSystem

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main as persist
from tests.support.states import assert_state_equal

_WRITES = ("pipe_file", "rm_file", "rm", "put_file", "makedirs", "mkdir", "touch", "mv", "cp_file", "_rm")


@pytest.fixture
def read_only(monkeypatch):
    """Make the memory filesystem refuse every write, as read-only credentials do; record attempts."""
    attempts: list[str] = []

    def refuse(name):
        def write(self, *args, **kwargs):
            attempts.append(name)
            raise PermissionError(f"{name}: read-only credentials")
        return write

    def opener(original):
        def _open(self, path, mode="rb", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                attempts.append(f"open({mode})")
                raise PermissionError("open for writing: read-only credentials")
            return original(self, path, mode, *args, **kwargs)
        return _open

    def arm():
        for name in _WRITES:
            if hasattr(MemoryFileSystem, name):
                monkeypatch.setattr(MemoryFileSystem, name, refuse(name))
        monkeypatch.setattr(MemoryFileSystem, "_open", opener(MemoryFileSystem._open))
        return attempts

    return arm


def test_a_reader_lists_and_loads_with_read_only_credentials_and_writes_nothing(tmp_path, read_only):
    url = f"memory://readers/{uuid.uuid4().hex}"
    with CheckpointEngine(tmp_path / "writer", remote_url=url) as engine:
        for step in (1, 2):
            engine.save({"w": torch.full((32,), float(step)), "step": step}, step=step)
    attempts = read_only()
    with CheckpointReader(tmp_path / "eval", remote_url=url) as reader:  # an eval job on a fresh machine
        assert [c.step for c in reader.list("remote")] == [1, 2]
        assert reader.latest().step == 2
        assert_state_equal(reader.load(), {"w": torch.full((32,), 2.0), "step": 2})
    runner = CliRunner()
    for args in (["ls", url, "--json"], ["inspect", url, "--json"], ["verify", url]):
        result = runner.invoke(persist, args)
        assert result.exit_code == 0, (args, result.output)
    assert json.loads(runner.invoke(persist, ["ls", url, "--json"]).output)[-1]["step"] == 2
    engine = CheckpointEngine(tmp_path / "eval2", remote_url=url)  # constructing an engine writes nothing either
    engine.close()
    assert attempts == []


def test_a_fresh_machine_load_streams_into_the_tensors_and_leaves_a_verified_local_copy(tmp_path):
    from tests.support.golden import golden_state

    url = f"memory:///reader-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url, torch_loadable=True) as engine:
        engine.save(golden_state(), step=12).wait()
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as reader:
        state = reader.load()
        stats = reader.last_load
        assert reader.loaded_from_remote
    assert_state_equal(state, golden_state())  # aliasing (tied tensors, views) kept, as from a local copy
    assert state["tied"]["a"].data_ptr() == state["tied"]["b"].data_ptr()
    saved = tmp_path / "a" / "step-000000000012"
    assert set(stats.remote_files) == {"rank-00000.ckpt"} and stats.remote_bytes >= (saved / "rank-00000.ckpt").stat().st_size
    copy = tmp_path / "fresh" / "step-000000000012"  # committed by close(): byte for byte the saved shard
    assert (copy / "rank-00000.ckpt").read_bytes() == (saved / "rank-00000.ckpt").read_bytes()
    assert not [p for p in (tmp_path / "fresh").iterdir() if p.name.startswith(".tmp")]
    with CheckpointReader(tmp_path / "fresh") as offline:  # the next restore needs no remote
        assert_state_equal(offline.load(), golden_state())


def test_a_streamed_restore_that_fails_verification_leaves_no_local_copy(tmp_path):
    from persist_core import CorruptCheckpointError
    from tests.support.golden import golden_state

    url = f"memory:///reader-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.save(golden_state(), step=12).wait()
    fs = MemoryFileSystem()
    path = f"{url.removeprefix('memory://')}/step-000000000012/rank-00000.safetensors"
    raw = bytearray(fs.cat_file(path))
    raw[-100] ^= 0xFF  # a flipped bit in the data section
    fs.pipe_file(path, bytes(raw))
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as reader:
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            reader.load(12)
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == []


class _OneRank:
    """The decision channel of a job of one rank (what ``agreed_load`` gathers over)."""

    world_size = 1

    def all_gather(self, value):
        return [value]


def test_agreeing_on_the_restore_lists_the_remote_once(tmp_path, monkeypatch):
    from persist_core.load.agree import agreed_load
    from persist_core.tiers.remote import RemoteTier

    url = f"memory:///reader-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        for step in (1, 2):
            engine.save({"w": torch.full((8,), float(step)), "step": step}, step=step)
    listed = []
    original = RemoteTier.committed_steps
    monkeypatch.setattr(RemoteTier, "committed_steps", lambda self: listed.append(1) or original(self))
    with CheckpointReader(tmp_path / "fresh", remote_url=url) as reader:
        state = agreed_load(reader, _OneRank(), rank=0)
        assert reader.loaded_step == 2 and reader.loaded_from_remote
    assert_state_equal(state, {"w": torch.full((8,), 2.0), "step": 2})
    assert len(listed) == 1  # what the ranks agreed on is what each loads from: not listed again
