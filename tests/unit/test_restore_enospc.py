"""A restore on a small disk, and the local copy a streamed restore leaves (issue 40, item 5).

A fresh machine whose ``local_dir`` cannot hold the checkpoint still loads it (the bytes are in memory;
the local copy is dropped with one warning naming the path, and removed); a download (``fetch``,
``persist pull``) that runs out of space fails with an error naming the path and leaves nothing; a
reader used without ``with`` commits its copy at ``close()`` and at interpreter exit. The full disk is a
fake: every write into ``local_dir`` past a byte budget fails with ``ENOSPC``.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader
from persist_core.cli import main as persist
from persist_core.errors import WriteError
from persist_core.layout import checkpoint_dirname
from tests.support.states import assert_state_equal

NBYTES = 1 << 20  # each checkpoint's tensor: 1 MiB


def state(step: int) -> dict:
    return {"w": torch.full((NBYTES // 4,), float(step)), "step": step}


@pytest.fixture
def remote(tmp_path) -> str:
    """A remote holding steps 1 and 2 (written from another machine's ``local_dir``)."""
    url = f"memory:///enospc-{uuid.uuid4().hex[:8]}"
    with CheckpointEngine(tmp_path / "writer", remote_url=url) as engine:
        for step in (1, 2):
            engine.save(state(step), step=step)
    return url


class FullDisk:
    """Writes (``os.pwrite``, ``os.write``) into files under ``root`` succeed until ``budget`` bytes are
    written, then fail with ENOSPC, as a small disk fills."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, budget: int) -> None:
        self.root, self.budget, self.refused = str(root), budget, 0
        real_pwrite, real_write = os.pwrite, os.write

        def pwrite(fd: int, data: bytes, offset: int) -> int:
            self._take(fd, data)
            return real_pwrite(fd, data, offset)

        def write(fd: int, data: bytes) -> int:
            self._take(fd, data)
            return real_write(fd, data)

        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "write", write)

    def _take(self, fd: int, data: bytes) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if not path.startswith(self.root + "/"):
            return
        n = memoryview(data).nbytes
        if n > self.budget:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= n


def leftovers(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(".tmp-"))


@pytest.mark.parametrize("budget", [64 << 10, 0], ids=["small-disk", "full-disk"])
def test_an_older_step_loads_from_the_remote_on_a_disk_too_small_for_its_local_copy(remote, tmp_path, monkeypatch,
                                                                                   caplog, budget):
    fresh = tmp_path / "fresh"
    with CheckpointEngine(fresh, remote_url=remote) as engine:  # a fresh machine
        disk = FullDisk(monkeypatch, fresh, budget)
        with caplog.at_level(logging.WARNING, logger="persist_core"):
            assert_state_equal(engine.load(1), state(1))  # the bytes are in memory: the load goes on
            engine.reader.wait_copies()
        assert disk.refused >= 1
        assert [c.step for c in engine.list()] == []  # no local copy, and no partial one
        assert [name for name in leftovers(fresh) if not name.endswith(".owner")] == []
        said = [r.getMessage() for r in caplog.records if "local copy" in r.getMessage()]
        assert len(said) == 1, said  # once, however many blocks failed
        assert str(fresh) in said[0] and "No space left on device" in said[0]
        monkeypatch.undo()  # space again: the run goes on
        engine.resume_from(1, from_remote=True)
        engine.save(state(3), step=2)
        engine.wait()
        assert [c.step for c in engine.list()] == [2]


def test_a_copy_whose_very_first_write_fails_leaves_no_mark(remote, tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    with CheckpointReader(fresh, remote_url=remote) as reader:
        FullDisk(monkeypatch, fresh, 0)
        reader.load(1)
        reader.wait_copies()
    assert leftovers(fresh) == []


def test_no_local_copy_is_started_where_the_file_system_says_it_will_not_fit(remote, tmp_path, monkeypatch, caplog):
    fresh = tmp_path / "fresh"
    with CheckpointReader(fresh, remote_url=remote) as reader:
        real = os.statvfs(fresh)
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result(
            (real.f_bsize, 4096, real.f_blocks, 10, 10, *real[5:])))  # 40 KiB free
        disk = FullDisk(monkeypatch, fresh, 1 << 40)
        with caplog.at_level(logging.WARNING, logger="persist_core"):
            assert_state_equal(reader.load(2), state(2))
        reader.wait_copies()
    assert disk.budget == 1 << 40  # not a byte written: no copy was started
    assert leftovers(fresh) == [] and not (fresh / checkpoint_dirname(2)).exists()
    said = [r.getMessage() for r in caplog.records if "local copy" in r.getMessage()]
    assert len(said) == 1 and str(fresh) in said[0] and "40960" in said[0], said


def test_fetch_on_a_full_disk_names_the_path_and_leaves_nothing(remote, tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    with CheckpointReader(fresh, remote_url=remote) as reader:
        FullDisk(monkeypatch, fresh, 64 << 10)
        with pytest.raises(WriteError) as caught:
            reader.fetch(1)
    assert caught.value.errno == errno.ENOSPC  # still an OSError with its errno
    assert str(fresh) in str(caught.value) and "No space left on device" in str(caught.value)
    assert leftovers(fresh) == [] and not (fresh / checkpoint_dirname(1)).exists()


def test_persist_pull_on_a_full_disk_is_one_line_naming_the_path(remote, tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    FullDisk(monkeypatch, fresh, 64 << 10)
    done = CliRunner().invoke(persist, ["pull", remote, str(fresh), "--step", "1"])
    assert done.exit_code == 2, done.output
    assert str(fresh) in done.output and "No space left on device" in done.output
    assert "Traceback" not in done.output
    assert leftovers(fresh) == []


def test_a_reader_without_with_commits_its_copy_at_close(remote, tmp_path):
    reader = CheckpointReader(tmp_path / "fresh", remote_url=remote)  # as the README once wrote it
    assert_state_equal(reader.load(), state(2))
    reader.close()
    assert leftovers(tmp_path / "fresh") == []
    assert [c.step for c in CheckpointReader(tmp_path / "fresh").list()] == [2]


@pytest.mark.slow  # a child interpreter
def test_a_reader_without_with_commits_its_copy_before_the_interpreter_exits(tmp_path):
    url = f"file://{tmp_path}/remote"
    with CheckpointEngine(tmp_path / "writer", remote_url=url) as engine:
        engine.save(state(1), step=1)
    fresh = tmp_path / "fresh"
    child = textwrap.dedent(f"""
        import threading
        from persist_core import CheckpointReader
        from persist_core.load import local_copy as tee

        finish = tee.LocalCopy.finish
        def slow_finish(self):  # a slow disk: the copy is still being committed when the script ends
            threading.Event().wait(1.0)
            return finish(self)
        tee.LocalCopy.finish = slow_finish
        reader = CheckpointReader({str(fresh)!r}, remote_url={url!r})
        assert reader.load()["step"] == 1
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", child], check=True, env=env, timeout=120)
    assert leftovers(fresh) == []
    assert [c.step for c in CheckpointReader(fresh).list()] == [1]
