"""The upload queue (:class:`UploadQueue`) on its own, over a fake remote: the order uploads go in, newer jobs
superseding queued ones the remote policy drops, protection of what is not uploaded, and listing an unreachable
remote once per attempt. Synchronised with events and handles, no sleeps."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from persist_core import AnyOf, CheckpointInfo, ConfigError, KeepEveryNSteps, KeepLastN, RemoteError
from persist_core.handle import ErrorLedger, SaveHandle, SaveStats
from persist_core.layout import MANIFEST_NAME
from persist_core.sync.job import SyncJob
from persist_core.sync.queue import UploadQueue


class FakeRemote:
    """A remote tier in memory that can be held (``gate``) and taken down (``down``)."""

    url = "fake://remote"
    backoff_s = 60.0  # no retry timer in these tests: a retry comes from drain() or from an upload that worked

    def __init__(self, *held: int) -> None:
        self.held = {s: self._info(s) for s in held}
        self.depends: dict[int, set[int]] = {}  # step -> what it references (incremental saves)
        self.down = False
        self.gate = threading.Event()
        self.gate.set()
        self.first_started = threading.Event()
        self.uploaded: list[int] = []
        self.removed: list[int] = []
        self.lists = 0

    def _info(self, step: int) -> CheckpointInfo:
        return CheckpointInfo(step=step, time=float(step), nbytes=1, path=f"{self.url}/{step}", tier="remote")

    def list(self) -> list[CheckpointInfo]:
        self.lists += 1
        if self.down:
            raise RemoteError("the remote is down")
        return [self.held[s] for s in sorted(self.held)]

    def listing(self) -> list[tuple[CheckpointInfo, object]]:
        return [(info, SimpleNamespace(depends_on=lambda s=info.step: set(self.depends.get(s, ()))))
                for info in self.list()]

    def upload(self, local_ckpt: Path, manifest: object, files: object = None) -> None:
        self.first_started.set()
        assert self.gate.wait(30)
        if self.down:
            raise RemoteError("the remote is down")
        assert manifest.depends_on() <= set(self.held), "a manifest went up before what it references"
        self.uploaded.append(manifest.step)
        self.held[manifest.step] = self._info(manifest.step)
        self.depends[manifest.step] = manifest.depends_on()

    def hidden(self) -> list[tuple[int, int]]:  # no branch in these tests: nothing taken off the live branch
        if self.down:
            raise RemoteError("the remote is down")
        return []

    def remove(self, step: int) -> None:
        self.removed.append(step)
        self.held.pop(step, None)

    def hint(self, error: BaseException) -> str:
        return ""


@pytest.fixture
def make(tmp_path):
    """``make(remote, keep_remote=...) -> (sync, job)``: a started queue, and ``job(step)`` that makes a job."""
    queues: list[UploadQueue] = []

    def build(remote: FakeRemote, keep_remote=None, local: dict[int, SyncJob] | None = None,
              backlog: list[SyncJob] = ()) -> tuple[UploadQueue, object]:
        """``local``: the committed local checkpoints a job may reference (uploaded again when the remote lacks
        them); ``backlog``: the jobs an earlier run left."""
        sync = UploadQueue(remote, keep_remote=keep_remote, ledger=ErrorLedger(), backlog=lambda steps: list(backlog),
                          after_upload=lambda job: None, latest_step=lambda: 0,
                          local_job=lambda step: (local or {}).get(step))
        queues.append(sync)
        sync.start()
        return sync, job

    def job(step: int, depends_on: tuple[int, ...] = ()) -> SyncJob:
        ckpt = tmp_path / f"step-{step}"
        ckpt.mkdir()
        (ckpt / MANIFEST_NAME).write_text("{}")
        manifest = SimpleNamespace(step=step, nbytes=10, time=float(step), node=None, nodes=(),
                                   depends_on=lambda: set(depends_on))
        return SyncJob(local_ckpt=ckpt, manifest=manifest, committed_at=0.0,
                       handle=SaveHandle(SaveStats(step=step, nbytes=10)))

    build.job = job
    yield build
    for sync in queues:
        sync.close(give_up=True, give_up_after_s=5)


def failed(job: SyncJob) -> None:
    """Wait until ``job``'s upload failed (its handle's remote phase ends with the error)."""
    with pytest.raises(RemoteError, match="down"):
        job.handle.wait_remote(30)


def test_without_a_remote_policy_uploads_go_in_the_order_submitted_and_none_is_superseded(make):
    remote = FakeRemote()
    remote.gate.clear()
    sync, job = make(remote)
    jobs = [job(1)]
    sync.submit(jobs[0])
    assert remote.first_started.wait(30)  # 1 is uploading, held
    for step in (2, 3, 4):
        jobs.append(job(step))
        sync.submit(jobs[-1])
    remote.gate.set()
    assert sync.drain(30)
    assert remote.uploaded == [1, 2, 3, 4]
    assert not any(j.handle.stats.superseded for j in jobs)


def test_a_newer_job_supersedes_queued_ones_the_remote_policy_drops_never_milestones_nor_the_newest(make):
    remote = FakeRemote()
    remote.gate.clear()
    sync, job = make(remote, keep_remote=AnyOf(KeepLastN(1), KeepEveryNSteps(4)))
    jobs = [job(1)]
    sync.submit(jobs[0])
    assert remote.first_started.wait(30)
    for step in range(2, 7):
        jobs.append(job(step))
        sync.submit(jobs[-1])
    remote.gate.set()
    assert sync.drain(30)
    assert [j.step for j in jobs if j.handle.stats.superseded] == [2, 3, 5]
    assert remote.uploaded == [1, 4, 6]
    for j in jobs:
        j.handle.wait_remote(30)  # a superseded job's remote phase ends too, without an error


def test_what_is_queued_uploading_or_failed_is_protected_until_it_is_uploaded(make):
    remote = FakeRemote()
    remote.gate.clear()
    sync, job = make(remote)
    first, second = job(1), job(2)
    sync.submit(first)
    assert remote.first_started.wait(30)
    sync.submit(second)
    assert sync.listed and sync.unsynced_steps() == {1, 2}  # uploading, queued
    assert sync.unsynced_bytes() == 20 and sync.backlog()["remote_behind_steps"] == 2
    remote.down = True
    remote.gate.set()
    failed(first)
    failed(second)
    assert sync.unsynced_steps() == {1, 2}  # failed: kept, retried
    assert not sync.drain(0.2)  # still down
    assert sync.failures >= 2
    remote.down = False
    assert sync.drain(30)
    assert sync.unsynced_steps() == set() and remote.uploaded == [2, 1]  # the newest first


def test_failed_uploads_are_retried_newest_first_then_what_the_policy_keeps_then_the_rest(make):
    remote = FakeRemote()
    remote.down = True
    sync, job = make(remote, keep_remote=AnyOf(KeepLastN(1), KeepEveryNSteps(2)))
    for step in (1, 2, 3, 4, 5):
        j = job(step)
        sync.submit(j)
        failed(j)  # one at a time: nothing is queued when the next comes, so nothing is superseded
    assert sync.unsynced_steps() == {1, 2, 3, 4, 5}
    remote.down = False
    assert sync.drain(30)
    assert remote.uploaded == [5, 2, 4, 1, 3]
    assert sorted(remote.held) == [2, 4, 5]  # remote retention after each upload
    assert sync.known_steps() == {2, 4, 5}


def test_until_the_remote_is_listed_it_is_listed_once_per_upload_attempt(make):
    remote = FakeRemote()
    remote.down = True
    sync, job = make(remote)
    assert sync.wait_listed(30) is None  # the start-up listing was tried, and failed
    assert not sync.listed
    for step in (1, 2):
        j = job(step)
        sync.submit(j)
        failed(j)
    assert remote.lists == sync.failures == 3  # the start-up listing, then one per attempt (each a failure)
    remote.down = False
    assert sync.drain(30)
    assert sync.listed and remote.uploaded == [2, 1]


def test_a_fresh_run_during_an_outage_lists_once_per_attempt_then_refuses_beside_another_runs_checkpoints(make):
    remote = FakeRemote(7)  # another run's checkpoint
    remote.down = True
    sync, job = make(remote)
    assert sync.wait_listed(30) is None
    sync.fresh_run(lambda steps: ConfigError(f"another run's checkpoints {sorted(steps)}"))
    first = job(1)
    sync.submit(first)
    failed(first)
    assert remote.lists == 2  # the start-up listing and this attempt's: not twice per attempt
    remote.down = False
    assert sync.drain(30)  # listed now: nothing of this run is uploaded
    assert sync.wait_listed(0) == {7}
    with pytest.raises(ConfigError, match=r"another run's checkpoints \[7\]"):
        second = job(2)
        sync.submit(second)
        second.handle.wait_remote(30)
    assert remote.uploaded == [] and sync.unsynced_steps() == {1, 2}  # kept (protected), never retried


# ---- incremental saves (issue 43): references


def test_a_queued_job_that_another_references_is_never_superseded(make):
    remote = FakeRemote()
    remote.gate.clear()
    sync, job = make(remote, keep_remote=KeepLastN(1))
    jobs = [job(1)]
    sync.submit(jobs[0])
    assert remote.first_started.wait(30)
    for step, deps in ((2, ()), (3, (2,)), (4, (2,)), (5, ())):
        jobs.append(job(step, deps))
        sync.submit(jobs[-1])
    # at 3: 2 is referenced (kept); at 4: 3 superseded, 2 still referenced; at 5 (full): 2 and 4 superseded
    remote.gate.set()
    assert sync.drain(30)
    assert [j.step for j in jobs if j.handle.stats.superseded] == [2, 3, 4]
    assert remote.uploaded == [1, 5]


def test_retries_go_newest_first_but_never_before_what_they_reference(make):
    remote = FakeRemote()
    remote.down = True
    sync, job = make(remote)
    for step, deps in ((1, ()), (2, (1,)), (3, (1,))):
        j = job(step, deps)
        sync.submit(j)
        with pytest.raises(RemoteError):
            j.handle.wait_remote(30)
    remote.down = False
    assert sync.drain(30)
    assert remote.uploaded == [1, 3, 2]  # 3 is the newest, but 1 goes first: 3 references it


def test_remote_retention_keeps_what_an_unsynced_job_references(make):
    remote = FakeRemote()
    sync, job = make(remote, keep_remote=KeepLastN(1))
    for step in (1, 2):  # one at a time: a queued 1 would be superseded by 2
        sync.submit(job(step))
        assert sync.drain(30)
    assert sorted(remote.held) == [2]
    remote.down = True
    dependent = job(3, (2,))
    sync.submit(dependent)
    with pytest.raises(RemoteError):
        dependent.handle.wait_remote(30)
    remote.down = False
    sync.submit(job(4))  # uploaded first (the newest); retention then must not remove 2: 3 still waits for it
    assert sync.drain(30)
    assert remote.uploaded == [1, 2, 4, 3]
    assert sorted(remote.held) == [4]  # once 3 went up, the policy dropped 2 and 3, the newest first
    assert remote.removed == [1, 3, 2]


def test_what_a_job_references_and_the_remote_lacks_is_uploaded_again_from_the_local_disk_first(make):
    local: dict[int, SyncJob] = {}
    remote = FakeRemote()
    sync, job = make(remote, local=local)
    local[1] = job(1)
    assert sync.wait_listed(30) == set()
    dependent = job(2, (1,))
    sync.submit(dependent)
    assert sync.drain(30)
    assert remote.uploaded == [1, 2]
    dependent.handle.wait_remote(30)  # no error: it waited for step 1


def test_a_backlog_naming_only_a_dependent_brings_what_it_references_first(make):
    remote = FakeRemote()
    sync, _ = make(remote, local={5: make.job(5)}, backlog=[make.job(6, (5,))])
    assert sync.drain(30)
    assert remote.uploaded == [5, 6]
