"""One writing run per remote_url (moto over HTTP): another run is refused, naming the holder; the same run
on a fresh machine, or anyone after the lease expired, takes over."""

from __future__ import annotations

import json
import time

import pytest
import s3fs

from persist_core import CheckpointEngine, CheckpointReader, ConfigError, DirectoryInUseError, KeepLastN
from functools import partial
from tests.support import states


state_for = partial(states.state_for, shape=(1024,))


def test_a_second_run_on_one_remote_url_is_refused_and_prunes_nothing_until_the_first_is_done(
    tmp_path, bucket, s3_options
):
    url = f"s3://{bucket}/run"
    first = CheckpointEngine(tmp_path / "a", remote_url=url, storage_options=s3_options)
    for step in (1, 2, 3):
        first.save(state_for(step), step=step)
    first.wait()
    second = CheckpointEngine(tmp_path / "b", remote_url=url, storage_options=s3_options, keep_remote=KeepLastN(1),
                              remote_timeout_s=3, start_over=True)  # it would set the first run's aside, too
    second.save(state_for(10), step=10)  # training goes on: the refusal comes from the upload
    with pytest.raises(DirectoryInUseError, match=r"written by another run: run_id='run-[0-9a-f]+' on host=.* "
                                                  r"pid=\d+.*own remote_url.*run_id="):
        second.wait()
    assert [c.step for c in first.list("remote")] == [1, 2, 3]  # KeepLastN(1) of the second pruned nothing
    assert [c.step for c in second.list()] == [10]  # kept locally
    first.close()  # gives the lease back
    second.wait()  # retried at once: now it is the writer
    assert [c.step for c in second.list("remote")] == [10]
    assert [c.step for c in second.abandoned("remote")] == [1, 2, 3]  # set aside (kept) only once it writes there
    second.close()


def test_the_same_run_on_a_fresh_machine_and_anyone_after_expiry_take_over(tmp_path, bucket, s3_options):
    url = f"s3://{bucket}/run"
    old = CheckpointEngine(tmp_path / "old", remote_url=url, storage_options=s3_options, run_id="job-7")
    old.save(state_for(1), step=1)
    old.wait()  # holds the lease, and is never closed: a machine that vanished
    with CheckpointEngine(tmp_path / "new", remote_url=url, storage_options=s3_options, run_id="job-7") as new:
        assert new.load()["step"] == 1  # resume on a fresh machine, one line
        new.save(state_for(2), step=2)
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    lease = f"{bucket}/run/.lease.json"
    fs.pipe_file(lease, json.dumps({"run_id": "job-8", "host": "gone", "pid": 1, "expires": time.time() - 1}).encode())
    with CheckpointEngine(tmp_path / "other", remote_url=url, storage_options=s3_options) as later:
        assert later.load()["step"] == 2  # it continues the remote's checkpoints (else it would be refused)
        later.save(state_for(3), step=3)  # an expired lease is free
    assert [c.step for c in CheckpointReader(tmp_path / "x", remote_url=url, storage_options=s3_options)
            .list("remote")] == [1, 2, 3]
    with pytest.raises(ConfigError, match="run_id=''"):
        CheckpointEngine(tmp_path / "y", run_id="")
    old.close()


def test_a_fresh_machine_that_resumes_from_the_remote_continues_that_run_without_waiting(tmp_path, bucket,
                                                                                        s3_options):
    url = f"s3://{bucket}/run"
    gone = CheckpointEngine(tmp_path / "gone", remote_url=url, storage_options=s3_options)
    gone.save(state_for(1), step=1)
    gone.wait()  # its machine vanishes with the lease held (never closed)
    with CheckpointEngine(tmp_path / "fresh", remote_url=url, storage_options=s3_options) as fresh:
        assert fresh.load()["step"] == 1  # the one line of a fresh-machine resume
        fresh.save(state_for(2), step=2)
        fresh.wait()
        assert [c.step for c in fresh.list("remote")] == [1, 2]
    assert (tmp_path / "fresh" / ".run-id").read_text() == (tmp_path / "gone" / ".run-id").read_text()
    gone.close()
