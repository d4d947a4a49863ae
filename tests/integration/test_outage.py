"""A remote outage never costs a checkpoint (moto over HTTP through a proxy that goes down and comes back)."""

from __future__ import annotations

import pytest

from persist_core import AnyOf, CheckpointEngine, CheckpointReader, KeepEveryNSteps, KeepLastN, RemoteError, WriteError
from persist_core.tiers.remote import RemoteTier
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(128, 128), random=True)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "1")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "10")
    monkeypatch.setenv("PERSIST_REMOTE_IO_TIMEOUT_S", "3")  # a connection the proxy left half-open costs 3 s


@pytest.fixture
def uploads(monkeypatch):
    """The order of upload attempts that got through."""
    done: list[int] = []
    original = RemoteTier.upload

    def upload(tier, local_ckpt, manifest):
        original(tier, local_ckpt, manifest)
        done.append(manifest.step)

    monkeypatch.setattr(RemoteTier, "upload", upload)
    return done


def _options(proxy) -> dict:
    return {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"retries": {"max_attempts": 1}}}


def test_an_outage_keeps_every_unsynced_checkpoint_and_the_same_engine_uploads_them_newest_first(
    tmp_path, bucket, proxy, fast, uploads
):
    url = f"s3://{bucket}/run"
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=_options(proxy), keep_local=KeepLastN(1),
                              keep_remote=KeepLastN(10), remote_timeout_s=2)
    engine.save(state_for(1), step=1)
    engine.wait()
    assert uploads == [1]
    proxy.outage(True)
    for step in (2, 3, 4):
        engine.save(state_for(step), step=step)  # never raises an upload failure: training goes on
    with pytest.raises(RemoteError, match=r"un-synced steps \[2, 3, 4\].*never deleted"):
        engine.wait()
    assert [c.step for c in engine.list()] == [2, 3, 4]  # KeepLastN(1) took the uploaded 1, no un-synced one
    behind = engine.summary()
    assert behind["remote_behind_steps"] == 3 and behind["remote_behind_bytes"] > 3 * 128 * 128 * 4
    assert behind["upload_failures"] >= 1 and behind["oldest_unsynced_age_s"] > 0
    proxy.outage(False)
    engine.wait()  # the remote is back: retried at once, the newest first once an upload gets through
    assert uploads[0] == 1 and sorted(uploads[1:]) == [2, 3, 4] and uploads.index(4) <= 2, uploads
    assert [c.step for c in engine.list(tier="remote")] == [1, 2, 3, 4]
    assert [c.step for c in engine.list()] == [4]  # uploaded: now retention may go on
    assert engine.summary()["remote_behind_steps"] == 0
    engine.close()


def test_a_restart_during_an_outage_deletes_nothing_and_a_later_engine_uploads_the_backlog(
    tmp_path, bucket, s3_options, proxy, fast
):
    url, local = f"s3://{bucket}/run", tmp_path / "a"
    proxy.outage(True)
    first = CheckpointEngine(local, remote_url=url, storage_options=_options(proxy), keep_local=KeepLastN(1),
                             remote_timeout_s=1)
    for step in (1, 2):
        first.save(state_for(step), step=step)
    with pytest.raises(RemoteError, match=r"un-synced steps \[1, 2\]"):
        first.close()
    second = CheckpointEngine(local, remote_url=url, storage_options=_options(proxy), keep_local=KeepLastN(1),
                              remote_timeout_s=1)  # restarted, the remote still down: it cannot list it
    second.save(state_for(3), step=3)
    with pytest.raises(RemoteError, match=r"un-synced steps \[3\]"):
        second.close()
    assert [c.step for c in CheckpointReader(local).list()] == [1, 2, 3]  # nothing the remote lacks was deleted
    with CheckpointEngine(local, remote_url=url, storage_options=s3_options, keep_local=KeepLastN(1)) as third:
        third.wait()
        assert [c.step for c in third.list(tier="remote")] == [1, 2, 3]
        third.prune()
        assert [c.step for c in third.list()] == [3]


def test_a_backlog_over_its_cap_refuses_the_save_with_a_write_error_and_deletes_nothing(tmp_path, bucket, proxy, fast):
    url = f"s3://{bucket}/run"
    proxy.outage(True)
    one = 128 * 128 * 4 + 8192
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=_options(proxy), keep_local=KeepLastN(1),
                              remote_timeout_s=3, max_unsynced_bytes=2 * one + 4096)  # 3 s: room to recover below
    engine.save(state_for(1), step=1)
    engine.save(state_for(2), step=2)
    with pytest.raises(RemoteError):
        engine.wait()
    with pytest.raises(WriteError, match=r"step=3 not saved: .*\(\[1, 2\]\) still wait for s3://.*Nothing was deleted"):
        engine.save(state_for(3), step=3)
    assert [c.step for c in engine.list()] == [1, 2]
    proxy.outage(False)
    engine.wait()
    engine.save(state_for(3), step=3).wait()  # uploaded: room again
    engine.close()


def test_after_an_outage_the_newest_goes_first_then_the_milestones_then_the_rest(tmp_path, bucket, proxy, fast,
                                                                                 uploads):
    url, policy = f"s3://{bucket}/run", AnyOf(KeepLastN(1), KeepEveryNSteps(4))
    proxy.outage(True)
    down = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=_options(proxy), keep_remote=policy,
                            remote_timeout_s=1)
    for step in range(1, 10):
        down.save(state_for(step), step=step).wait_local()
    with pytest.raises(RemoteError):
        down.close()  # the job ends during the outage: 1..9 un-synced
    assert uploads == []
    proxy.outage(False)
    with CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=_options(proxy), keep_remote=policy) as up:
        up.wait()
        assert uploads == [9, 4, 8], uploads  # the newest, then the milestones KeepEveryNSteps(4) keeps for good
        assert [c.step for c in up.list("remote")] == [4, 8, 9]


def test_a_fresh_run_during_an_outage_saves_locally_and_uploads_nothing_beside_another_runs_checkpoints(
    tmp_path, bucket, s3_options, proxy, fast
):
    import s3fs

    from persist_core import ConfigError

    url = f"s3://{bucket}/run"
    with CheckpointEngine(tmp_path / "m1", remote_url=url, storage_options=s3_options) as first:
        for step in (8, 16):
            first.save(state_for(step), step=step)
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    before = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/run") if not p.endswith(".lease.json")}
    proxy.outage(True)
    fresh = CheckpointEngine(tmp_path / "m2", remote_url=url, storage_options=_options(proxy), remote_timeout_s=2)
    fresh.save(state_for(8), step=8).wait_local()  # the remote cannot be listed: saved locally, nothing uploaded
    assert [c.step for c in fresh.list()] == [8]
    proxy.outage(False)
    with pytest.raises(ConfigError, match=r"newest step 16.*start_over=True"):
        fresh.wait()  # listed now: another run's checkpoints there, so this run's are not uploaded
    fresh.close()
    fs.invalidate_cache()
    assert {p: fs.cat_file(p) for p in fs.find(f"{bucket}/run") if not p.endswith(".lease.json")} == before
    assert [c.step for c in CheckpointReader(tmp_path / "m2").list()] == [8]  # kept locally


def test_a_remote_down_at_start_is_one_warning_counted_in_upload_failures_and_its_recovery_is_said(
    tmp_path, bucket, proxy, fast, caplog
):
    import logging

    caplog.set_level(logging.WARNING, logger="persist_core.sync")
    proxy.outage(True)
    # the first save waits (up to remote_timeout_s) for the start-up listing to be tried: a loaded machine's
    # failed listing can take seconds, and the count is read right after
    engine = CheckpointEngine(tmp_path / "a", remote_url=f"s3://{bucket}/run", storage_options=_options(proxy),
                              remote_timeout_s=30)
    engine.save(state_for(1), step=1).wait_local()
    assert engine.summary()["upload_failures"] >= 1  # the outage shows while it lasts
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "listing" in r.getMessage()]
    proxy.outage(False)
    engine.wait()
    assert [c.step for c in engine.list("remote")] == [1]
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    engine.close()
