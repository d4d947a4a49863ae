"""One writer per ``local_dir`` and rank; what a live process owns is never removed; gc respects a live job.

Real processes hold the locks (a second job, a writer seen from another PID namespace, a kill in the
middle of a deletion); the outage comes from the proxy in front of the moto server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from persist_core import CheckpointEngine, CheckpointReader, DirectoryInUseError, RemoteError
from persist_core.cli import main as cli
from persist_core.layout import checkpoint_dirname
from tests.support.fakes import GatedOps

CHILD = [sys.executable, "-m", "tests.support.owner_child"]
ROOT = Path(__file__).resolve().parents[2]


class Child:
    """A child process of ``owner_child`` that holds what it holds until :meth:`release` or :meth:`kill`."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CHILD, *args], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), line
        self.pid = int(line.split()[1])

    def release(self) -> None:
        self.proc.communicate("", timeout=60)
        assert self.proc.returncode == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def gc(*args: str):
    return CliRunner().invoke(cli, ["gc", *args], catch_exceptions=False)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if not p.name.startswith((".lock-", ".history")))


def test_a_second_job_on_one_local_dir_is_refused_naming_the_holder_until_it_is_gone(tmp_path):
    d = tmp_path / "ckpt"
    first = Child("engine", str(d))
    with pytest.raises(DirectoryInUseError, match=rf"in use by another writer for rank 0: host={socket.gethostname()} "
                                                  rf"pid={first.pid} since .*own local_dir"):
        CheckpointEngine(d)
    assert CheckpointReader(d).load()["w"].equal(torch.ones(16))  # readers take no lock
    first.kill()  # SIGKILL: its lock goes with it
    with CheckpointEngine(d) as engine:
        assert engine.load()["w"].equal(torch.ones(16))
        engine.save({"w": torch.zeros(16)}, step=2)


def test_two_engines_in_one_process_and_the_lock_is_free_again_after_close(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        engine.save({"w": torch.ones(4)}, step=1)
        with pytest.raises(DirectoryInUseError, match=f"pid={os.getpid()}"):
            CheckpointEngine(ckpt_dir)
        assert [c.step for c in engine.list()] == [1]  # the refused one deleted nothing
    with CheckpointEngine(ckpt_dir) as again:
        assert [c.step for c in again.list()] == [1]


def test_a_live_writer_the_pid_check_cannot_see_keeps_its_temporary_directory(ckpt_dir):
    ckpt_dir.mkdir()
    other = Child("mark", str(ckpt_dir))
    tmp = ckpt_dir / ".tmp-step-000000000007-pid999999-c0ffee"
    CheckpointEngine(ckpt_dir).close()  # start-up cleanup
    assert (tmp / "rank-00000.safetensors").read_bytes() == b"half written"
    out = gc(str(ckpt_dir), "--keep-last", "1", "--incomplete-older-than", "0")
    assert out.exit_code == 0 and tmp.exists() and "kept incomplete" in out.output and "owned by a live" in out.output
    other.kill()
    CheckpointEngine(ckpt_dir).close()  # the owner is gone: now it is dead, and removed
    assert names(ckpt_dir) == []


def test_gc_with_age_zero_leaves_a_live_writers_directory_alone(ckpt_dir):
    ops = GatedOps()
    with CheckpointEngine(ckpt_dir, file_ops=ops, direct_io="off") as engine:
        handle = engine.save({"w": torch.ones(1 << 16)}, step=3)
        ops.entered.wait(30)  # the writer is inside its temporary directory
        out = gc(str(ckpt_dir), "--keep-last", "1", "--incomplete-older-than", "0")
        assert out.exit_code == 0 and f"kept incomplete {ckpt_dir}/.tmp-step-000000000003-pid{os.getpid()}" in out.output
        ops.gate.set()
        handle.wait()
        assert [c.step for c in engine.list()] == [3]


def test_a_kill_in_the_middle_of_a_deletion_leaves_no_half_checkpoint_and_the_next_start_cleans_it(ckpt_dir):
    with CheckpointEngine(ckpt_dir) as engine:
        for step in (1, 2):
            engine.save({"w": torch.full((1 << 16,), float(step))}, step=step)
    dying = subprocess.run([*CHILD, "die-deleting", str(ckpt_dir), "1"], cwd=ROOT, stdin=subprocess.DEVNULL)
    assert dying.returncode == -signal.SIGKILL
    assert checkpoint_dirname(1) not in names(ckpt_dir)  # out of the checkpoints in one rename
    with CheckpointEngine(ckpt_dir) as engine:
        assert names(ckpt_dir) == [checkpoint_dirname(2)]  # the dead temporary went at start
        assert engine.load()["w"][0] == 2


def _options(proxy) -> dict:
    return {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"retries": {"max_attempts": 1}}}


def test_gc_on_a_live_job_during_an_outage_keeps_what_is_not_uploaded(tmp_path, bucket, proxy, monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "3")  # a connection the outage left stale is retried at once
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "10")
    local, url = tmp_path / "ckpt", f"s3://{bucket}/run"
    engine = CheckpointEngine(local, remote_url=url, storage_options=_options(proxy), remote_timeout_s=3)
    engine.save({"w": torch.ones(1024)}, step=1)
    engine.wait()
    proxy.outage(True)
    for step in (2, 3, 4):
        engine.save({"w": torch.full((1024,), float(step))}, step=step)
    with pytest.raises(RemoteError):
        engine.wait()
    record = json.loads((local / ".unsynced.json").read_text())
    assert record["remote"] == url and record["steps"] == [2, 3, 4]
    out = gc(str(local), "--keep-last", "1")
    assert out.exit_code == 0, out.output
    assert "removed step 1 " in out.output and "kept step 2: not yet uploaded to " + url in out.output
    assert [c.step for c in engine.list()] == [2, 3, 4]
    proxy.outage(False)
    engine.wait()  # every un-synced step uploads: nothing was taken from under the job
    engine.close()
    assert json.loads((local / ".unsynced.json").read_text())["steps"] == []
    with CheckpointEngine(tmp_path / "fresh", remote_url=url, storage_options=_options(proxy)) as fresh:
        assert [c.step for c in fresh.list("remote")] == [1, 2, 3, 4]
