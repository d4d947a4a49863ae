"""The remote tier against fsspec's memory and local (``file://``) filesystems: sync, fallback,
retention, back-pressure, errors."""

from __future__ import annotations

import json
import shutil
import threading
import uuid

import fsspec
import pytest
import torch

from persist_core import (
    AnyOf,
    CheckpointEngine,
    CheckpointReader,
    CheckpointNotFoundError,
    ConfigError,
    KeepEveryNSteps,
    KeepLastN,
    PersistError,
    RemoteError,
)
from tests.support.states import assert_state_equal
from persist_core.sync.queue import UploadQueue
from tests.support.fakes import GatedUploads
from functools import partial
from tests.support import states


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    if request.param == "file":
        yield (tmp_path / "remote[7]").as_uri()
        return
    root = f"/persist-tests/{uuid.uuid4().hex}/run[7]*"  # glob characters must not matter
    yield f"memory://{root}"
    store = fsspec.filesystem("memory").store
    for key in [k for k in store if k.startswith(root)]:
        del store[key]


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "3")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "1")


state_for = partial(states.state_for, random=True, opt={"lr": 0.1})


def test_saves_reach_the_remote_and_a_fresh_machine_resumes(tmp_path, url):
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        for step in (10, 20):
            handle = engine.save(state_for(step), step=step)
            handle.wait_local()
            handle.wait_remote()
            assert handle.stats.upload_s > 0 and handle.stats.lag_s >= handle.stats.upload_s
        assert [(i.step, i.tier) for i in engine.list(tier="remote")] == [(10, "remote"), (20, "remote")]
        assert [(i.step, i.tier) for i in engine.list(tier="all")] == [(10, "local"), (10, "remote"), (20, "local"), (20, "remote")]
    fresh = CheckpointEngine(tmp_path / "fresh-machine", remote_url=url)
    assert fresh.list() == []
    assert_state_equal(fresh.load(), state_for(20))  # streamed into the tensors ...
    fresh.reader.wait_copies()  # ... with a local copy written alongside, committed after the load
    assert [i.step for i in fresh.list()] == [20]  # now cached locally
    assert_state_equal(fresh.load(10), state_for(10))
    fresh.close()


def test_corrupt_local_copy_falls_back_to_the_remote(tmp_path, url):
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.save(state_for(1), step=1).wait()
    (shard,) = (tmp_path / "a" / "step-000000000001").glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[5000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        assert_state_equal(engine.load(1), state_for(1))
        assert_state_equal(engine.load(1, verify=True), state_for(1))  # the local copy was replaced


def test_remote_prefix_without_manifest_is_invisible(tmp_path, url):
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(f"{root}/step-000000000005", exist_ok=True)
    fs.pipe_file(f"{root}/step-000000000005/rank-00000.safetensors", b"partial")
    engine = CheckpointEngine(tmp_path / "a", remote_url=url)
    assert engine.list(tier="remote") == []
    with pytest.raises(CheckpointNotFoundError):
        engine.load()
    engine.close()


def test_per_tier_retention(tmp_path, url):
    keep_remote = AnyOf(KeepLastN(2), KeepEveryNSteps(3))
    with CheckpointEngine(tmp_path / "a", remote_url=url, keep_local=KeepLastN(1), keep_remote=keep_remote) as engine:
        for step in range(1, 8):
            engine.save(state_for(step), step=step).wait()
        assert [i.step for i in engine.list()] == [7]
        assert [i.step for i in engine.list(tier="remote")] == [3, 6, 7]
        assert_state_equal(engine.load(3), state_for(3))  # comes back from the remote


def test_local_retention_keeps_what_is_not_uploaded_yet(tmp_path, url, monkeypatch):
    gate = GatedUploads(monkeypatch)
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, keep_local=KeepLastN(1))
    for step in (1, 2, 3):
        engine.save(state_for(step), step=step).wait_local()
    assert [i.step for i in engine.list()] == [1, 2, 3]  # none uploaded: all stay
    gate.gate.set()
    engine.wait()
    assert [i.step for i in engine.list()] == [3] and [i.step for i in engine.list(tier="remote")] == [1, 2, 3]
    engine.close()


def test_slow_remote_supersedes_queued_uploads_but_never_milestones(tmp_path, url, monkeypatch):
    gate = GatedUploads(monkeypatch)
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, keep_remote=AnyOf(KeepLastN(1), KeepEveryNSteps(4)))
    handles = [engine.save(state_for(1), step=1)]
    assert gate.first_started.wait(60)  # step 1 is uploading and blocked
    handles += [engine.save(state_for(s), step=s) for s in range(2, 7)]
    for h in handles:
        h.wait_local()
    gate.gate.set()
    for h in handles:
        h.wait()
    superseded = [h.step for h in handles if h.stats.superseded]
    assert superseded == [2, 3, 5]
    assert gate.started == [1, 4, 6]
    assert [i.step for i in engine.list(tier="remote")] == [4, 6]
    engine.close()


def test_upload_failure_is_raised_once_and_nothing_partial_is_listed(tmp_path, url, monkeypatch, fast_retries):
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, remote_timeout_s=0.5)
    calls = []
    counted = threading.Event()  # the engine's own background retry waits for the test to count the first round

    pipe = type(engine._parts.tier.fs).pipe_file

    def broken_pipe(self, path, value, **kwargs):
        if not path.endswith("manifest.json"):
            return pipe(self, path, value, **kwargs)
        if len(calls) == 3:
            counted.wait(60)
        calls.append(path)
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(type(engine._parts.tier.fs), "pipe_file", broken_pipe)  # the manifest never lands
    handle = engine.save(state_for(1), step=1)
    with pytest.raises(PersistError, match="committing .*after 3 attempts.*local checkpoints are intact"):
        handle.wait()
    assert len(calls) == 3  # the per-operation attempts
    counted.set()
    handle.wait()  # raised once
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):  # retried in the background, still failing
        engine.wait()
    assert engine.list(tier="remote") == [] and [i.step for i in engine.list()] == [1]
    monkeypatch.undo()
    engine.close()  # the remote is healthy again: the retry gets it through
    assert [i.step for i in CheckpointReader(tmp_path / "b", remote_url=url).list(tier="remote")] == [1]


def test_a_new_engine_uploads_what_an_earlier_run_left_unsynced(tmp_path, url):
    with CheckpointEngine(tmp_path / "a") as local_only:
        local_only.save(state_for(1), step=1).wait()
        local_only.save(state_for(2), step=2).wait()
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        engine.wait()
        assert [i.step for i in engine.list(tier="remote")] == [1, 2]


@pytest.mark.parametrize(
    ("remote_url", "match"),
    [("nosuchproto://bucket/x", r"remote_url='nosuchproto://bucket/x'.*fsspec URL"),
     ("gs://bucket/x", r"remote_url='gs://bucket/x' needs an fsspec backend.*pip install")],
)
def test_bad_remote_urls_are_config_errors(tmp_path, remote_url, match):
    pytest.importorskip("fsspec")
    if remote_url.startswith("gs://"):
        try:
            import gcsfs  # noqa: F401
            pytest.skip("gcsfs is installed")
        except ImportError:
            pass
    with pytest.raises(ConfigError, match=match):
        CheckpointEngine(tmp_path / "a", remote_url=remote_url)


def test_an_unwritable_file_url_fails_the_first_upload_once_and_keeps_the_local_copy(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    engine = CheckpointEngine(tmp_path / "a", remote_url=f"file://{blocker}/remote",
                              remote_timeout_s=0.5)  # construction writes nothing
    handle = engine.save(state_for(1), step=1)
    with pytest.raises(RemoteError, match="file://.*file/remote"):
        handle.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):
        engine.close()
    assert [i.step for i in CheckpointReader(tmp_path / "a").list()] == [1]


def test_keep_remote_without_remote_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="keep_remote"):
        CheckpointEngine(tmp_path / "a", keep_remote=KeepLastN(1))


@pytest.mark.slow  # a child interpreter, or a second or more on 2 cores
def test_interpreter_exit_without_close_still_commits_and_uploads(tmp_path):
    import subprocess
    import sys

    remote = (tmp_path / "remote").as_uri()
    code = ("import sys, torch\nfrom persist_core import CheckpointEngine, CheckpointReader\n"
            "engine = CheckpointEngine(sys.argv[1], remote_url=sys.argv[2])\n"
            "engine.save({'x': torch.arange(1000)}, step=3)\n")  # no wait(), no close()
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "a"), remote], check=True, timeout=120)
    with CheckpointEngine(tmp_path / "b", remote_url=remote) as engine:
        assert [i.step for i in engine.list(tier="remote")] == [3]
        assert engine.load()["x"].equal(torch.arange(1000))


def test_a_manifest_whose_step_was_flipped_is_corrupt_and_never_overwrites_another_checkpoint(tmp_path, url):
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:
        for step in (5, 7):
            engine.save(state_for(step), step=step)
    manifest = tmp_path / "a" / "step-000000000005" / "manifest.json"
    raw = manifest.read_bytes()
    assert raw.count(b'"step":5,') == 1
    manifest.write_bytes(raw.replace(b'"step":5,', b'"step":7,'))  # one bit: 0x35 -> 0x37
    with CheckpointEngine(tmp_path / "b", remote_url=url) as other:
        other._tier.remove(5)  # the remote lacks 5: a new engine on "a" would upload it
    with CheckpointEngine(tmp_path / "a", remote_url=url) as engine:  # its backlog: what the remote lacks
        engine.wait()
        assert [c.step for c in engine.list()] == [7]  # 5 is corrupt: skipped, said why, not deleted
        assert (tmp_path / "a" / "step-000000000005").is_dir()
    with CheckpointEngine(tmp_path / "fresh", remote_url=url) as fresh:
        assert [c.step for c in fresh.list(tier="remote")] == [7]
        assert_state_equal(fresh.load(7), state_for(7))  # before: step 5's state under step 7's name


def test_a_checkpoint_removed_by_another_process_before_its_upload_is_named_not_a_raw_error(tmp_path, url,
                                                                                             monkeypatch):
    gate = GatedUploads(monkeypatch)
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, remote_timeout_s=5)
    engine.save(state_for(1), step=1).wait_local()
    assert gate.first_started.wait(60)
    shutil.rmtree(tmp_path / "a" / "step-000000000001")  # someone's rm -rf behind the job's back
    gate.gate.set()
    with pytest.raises(PersistError, match=r"step=1 was removed from .* by another process before its upload"):
        engine.wait()
    engine.save(state_for(2), step=2)  # the job goes on
    engine.close()
    assert [i.step for i in CheckpointReader(tmp_path / "b", remote_url=url).list(tier="remote")] == [2]


def test_close_after_the_remote_timed_out_does_not_upload_the_queue_first(tmp_path, url, monkeypatch):
    """A black-holed remote: close() after remote_timeout_s finishes only the upload under way."""
    gate = GatedUploads(monkeypatch)
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, remote_timeout_s=0.2)
    for step in (1, 2, 3):
        engine.save(state_for(step), step=step)
    with pytest.raises(RemoteError, match=r"un-synced steps \[1, 2, 3\]"):
        engine.wait()
    stop = UploadQueue._stop

    def stop_then_open(sync):  # the upload under way (step 1) ends once close stopped the queue
        stop(sync)
        gate.gate.set()

    monkeypatch.setattr(UploadQueue, "_stop", stop_then_open)
    with pytest.raises(RemoteError):
        engine.close()  # raised again: still un-synced
    assert gate.started == [1]
    assert [c.step for c in CheckpointReader(tmp_path / "a").list()] == [1, 2, 3]
    assert json.loads((tmp_path / "a" / ".unsynced.json").read_text())["steps"] == [2, 3]
    with CheckpointEngine(tmp_path / "a", remote_url=url) as again:  # the next engine uploads them
        again.wait()
        assert [c.step for c in again.list("remote")] == [1, 2, 3]


@pytest.mark.parametrize("remote", [False, True], ids=["no-remote", "healthy-remote"])
def test_a_nearly_full_disk_with_a_healthy_remote_fails_as_it_would_without_one(tmp_path, url, monkeypatch, remote):
    """A disk with under 10% free and an upload under way (the remote answering): the save is not refused for the
    remote's backlog ("uploads failing: 0 attempts"); the shard's write fails on the full disk, and says so."""
    from persist_core.errors import WriteError
    from persist_core.sync import side
    from tests.support.fakes import FailingOps

    gate = GatedUploads(monkeypatch)
    ops = FailingOps(fail_at=1 << 60, always=True)
    root = tmp_path / "a"
    engine = CheckpointEngine(root, remote_url=url if remote else None, file_ops=ops)
    engine.save(state_for(1), step=1).wait_local()
    if remote:
        assert gate.first_started.wait(60)  # step 1 is uploading: un-synced, nothing failed
    total = shutil.disk_usage(root).total
    monkeypatch.setattr(side.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(total, total, total // 20))
    ops.fail_at = ops.calls + 1  # the disk is full from here
    with pytest.raises(WriteError) as caught:
        engine.save(state_for(2), step=2).wait_local()
    said = str(caught.value)
    assert "No space left on device" in said and str(root) in said, said
    assert "upload" not in said and "remote" not in said, said
    ops.fail_at = 1 << 60
    gate.gate.set()
    engine.close()
    assert [i.step for i in CheckpointReader(root).list()] == [1]


@pytest.mark.parametrize("trial", range(8))
def test_a_clean_close_leaves_a_record_that_names_nothing_as_not_uploaded(tmp_path, memory_url, trial):
    """Every step uploaded, the record says so (``persist gc`` and ``rm`` read it): the writer thread's rewrite after
    its last commit raced the sync thread's after the upload, and named the newest step while it was still pending."""
    from persist_core.sync.record import read_unsynced

    with CheckpointEngine(tmp_path, remote_url=memory_url) as engine:
        for step in (1, 2):
            engine.save(states.state_for(step, (16,)), step=step)
    assert read_unsynced(tmp_path) == (memory_url, set())
