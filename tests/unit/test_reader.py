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
