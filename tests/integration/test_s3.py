"""The remote tier against a moto S3 server over HTTP, through s3fs, as a user reaches S3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import time

import pytest
import torch

from persist_core import AnyOf, CheckpointEngine, CheckpointReader, KeepEveryNSteps, KeepLastN, RemoteError
from tests.support.fakes import record_upload_turns
from tests.support.states import assert_state_equal
from tests.support import states

ROOT = Path(__file__).resolve().parents[2]


def state_for(step: int, n: int = 256) -> dict:
    return states.state_for(step, (n, n), random=True, bias=torch.bfloat16,
                            rng=torch.Generator().manual_seed(step).get_state())


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_PART_BYTES", str(5 << 20))  # S3's minimum: several parts per shard
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "10")


def test_round_trip_retention_and_fresh_machine_restore(tmp_path, bucket, s3_options, small_parts):
    url = f"s3://{bucket}/run-7"
    keep_remote = AnyOf(KeepLastN(2), KeepEveryNSteps(20))
    with CheckpointEngine(tmp_path / "nvme", remote_url=url, storage_options=s3_options,
                          keep_local=KeepLastN(1), keep_remote=keep_remote) as engine:
        for step in (10, 20, 30, 40):
            handle = engine.save(state_for(step, n=1536), step=step)  # ~9.4 MB: a multipart upload
            handle.wait_remote()
            assert handle.stats.upload_gbps > 0
        assert [i.step for i in engine.list(tier="remote")] == [20, 30, 40]
        assert [i.step for i in engine.list()] == [40]
    fresh = CheckpointEngine(tmp_path / "fresh", remote_url=url, storage_options=s3_options)
    assert_state_equal(fresh.load(), state_for(40, n=1536))
    assert_state_equal(fresh.load(20), state_for(20, n=1536))
    fresh.close()


def test_a_missing_bucket_is_found_by_the_first_upload_and_named_once(tmp_path, s3_options):
    url = "s3://no-such-bucket-here/x"
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=s3_options,
                              remote_timeout_s=1)  # no network, no write
    handle = engine.save(state_for(1), step=1)
    with pytest.raises(RemoteError, match=r"remote_url='s3://no-such-bucket-here/x' does not exist.*create it"):
        handle.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):  # retried meanwhile, still failing
        engine.close()
    assert [i.step for i in CheckpointReader(tmp_path / "a").list()] == [1]  # the local copy is intact


def test_an_unreachable_endpoint_is_reported_by_the_upload_not_the_constructor(tmp_path, proxy, bucket, monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "2")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "1")
    proxy.kill()
    options = {"client_kwargs": {"endpoint_url": proxy.url},
               "config_kwargs": {"retries": {"max_attempts": 1}}}
    engine = CheckpointEngine(tmp_path / "a", remote_url=f"s3://{bucket}/x", storage_options=options,
                              remote_timeout_s=1)
    handle = engine.save(state_for(1), step=1)
    with pytest.raises(RemoteError, match=rf"s3://{bucket}/x failed after 2 attempts.*check the network"):
        handle.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):
        engine.close()


def test_a_job_restarted_during_an_outage_resumes_from_local_and_a_later_engine_uploads_the_rest(
    tmp_path, bucket, s3_endpoint, s3_options, proxy, monkeypatch
):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "2")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "1")
    url, local = f"s3://{bucket}/run", tmp_path / "a"
    with CheckpointEngine(local, remote_url=url, storage_options=s3_options) as engine:
        engine.save(state_for(1), step=1)
    proxy.kill()  # the outage begins; the job is restarted during it
    down = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    engine = CheckpointEngine(local, remote_url=url, storage_options=down,
                              remote_timeout_s=1)  # before: a ConfigError, the job dead
    assert_state_equal(engine.load(), state_for(1))  # resumes from its local checkpoint
    handle = engine.save(state_for(2), step=2)
    with pytest.raises(RemoteError, match="check the network"):
        handle.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[2\]"):
        engine.close()
    with CheckpointEngine(local, remote_url=url, storage_options=s3_options) as after:  # the remote is back
        after.wait()  # uploads what the outage left behind
        assert [i.step for i in after.list(tier="remote")] == [1, 2]


def test_connection_resets_mid_upload_still_commit(tmp_path, bucket, proxy, small_parts):
    url = f"s3://{bucket}/run"
    options = {"client_kwargs": {"endpoint_url": proxy.url}}
    with CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=options) as engine:
        engine.save(state_for(0, n=8), step=0).wait()  # listed the remote, took the lease: the resets below hit
        proxy.reset_connections(3, after_bytes=1 << 20)        # the upload
        engine.save(state_for(1, n=1536), step=1).wait()
    assert proxy.resets_done >= 1
    direct = {"client_kwargs": {"endpoint_url": proxy.url}}
    with CheckpointEngine(tmp_path / "b", remote_url=url, storage_options=direct) as fresh:
        assert_state_equal(fresh.load(1), state_for(1, n=1536))


def test_dead_remote_fails_once_keeps_local_and_lists_nothing_partial(tmp_path, bucket, s3_endpoint, proxy, monkeypatch):
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "2")
    monkeypatch.setenv("PERSIST_REMOTE_BACKOFF_MS", "10")
    url = f"s3://{bucket}/run"
    options = {"client_kwargs": {"endpoint_url": proxy.url}, "config_kwargs": {"retries": {"max_attempts": 1}}}
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=options, remote_timeout_s=1)
    proxy.kill()
    handle = engine.save(state_for(1), step=1)
    handle.wait_local()
    with pytest.raises(RemoteError, match="failed after 2 attempts"):
        handle.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):  # one error naming what is left
        engine.wait()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):
        engine.close()
    direct = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    with CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=direct) as check:
        assert [i.step for i in check.list()] == [1]
        check.wait()  # a healthy remote again: the new engine uploads what the old one could not
        assert [i.step for i in check.list(tier="remote")] == [1]


def test_sigkill_during_upload_leaves_no_partial_checkpoint_and_a_new_engine_finishes_it(
    tmp_path, bucket, s3_endpoint, proxy, small_parts
):
    url = f"s3://{bucket}/run"
    local = tmp_path / "a"
    proxy.stall_after(256 << 10)  # the probe gets through; the upload hangs part-way
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.support.upload_child", str(local), url, proxy.url],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout.readline().strip() == "committed locally"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        child.stdout.close()
    direct = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    import s3fs

    fs = s3fs.S3FileSystem(**direct, skip_instance_cache=True)
    assert not fs.exists(f"{bucket}/run/step-000000000001/manifest.json")
    with CheckpointEngine(local, remote_url=url, storage_options=direct) as engine:
        engine.wait()  # the new engine redoes the upload the killed one never finished
        assert [i.step for i in engine.list(tier="remote")] == [1]
    with CheckpointEngine(tmp_path / "fresh", remote_url=url, storage_options=direct) as fresh:
        assert_state_equal(fresh.load(), state_for(1, n=1536))


def test_a_remote_that_stops_answering_mid_request_costs_bounded_time(tmp_path, bucket, proxy, monkeypatch):
    """A half-open connection (the proxy holds every byte): each request fails after PERSIST_REMOTE_IO_TIMEOUT_S
    instead of botocore's minutes, so wait() and close() end within remote_timeout_s plus one request."""
    monkeypatch.setenv("PERSIST_REMOTE_IO_TIMEOUT_S", "2")
    monkeypatch.setenv("PERSIST_REMOTE_RETRIES", "1")
    url = f"s3://{bucket}/stalled"
    options = {"client_kwargs": {"endpoint_url": proxy.url}}
    engine = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=options, remote_timeout_s=3)
    proxy.stall_after(0)  # from now on nothing reaches the server, and nothing is refused either
    engine.save(state_for(1), step=1)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match=r"un-synced steps \[1\]"):
        engine.close()
    assert time.monotonic() - t0 < 45  # without the bound: minutes (s3fs x botocore attempts x 60 s reads)
    assert [c.step for c in CheckpointReader(tmp_path / "a").list()] == [1]  # committed locally, kept


def test_upload_threads_wait_for_the_turn_a_guarded_update_holds(tmp_path, bucket, s3_options, small_parts, monkeypatch):
    callers = record_upload_turns(monkeypatch)
    with CheckpointEngine(tmp_path / "nvme", remote_url=f"s3://{bucket}/turn", storage_options=s3_options) as engine:
        engine.save(state_for(1, n=1536), step=1).wait_remote()  # ~9.4 MB: a multipart upload on s3transfer's threads
        assert [i.step for i in engine.list(tier="remote")] == [1]
    # the writer threads wait for the turn before each block; so do the threads sending the upload's parts
    assert any(not name.startswith("persist-") for name in callers), callers  # s3transfer's threads
